"""TransRate (Huang et al., ICML 2022, "Frustratingly Easy Transferability Estimation").

TransRate estimates the mutual information between features and labels with the coding rate, a
rate-distortion surrogate for entropy (from Ma et al.'s MCR^2):

    R(Z, eps) = 1/2 logdet(I_d + 1 / (m eps) Z^T Z)         for Z of m rows and d columns,
    TransRate = R(Z, eps) - 1/K sum_c R(Z_c, eps),

where Z are the centred features and Z_c the rows of class c. High TransRate means the features
are both complete (large overall rate) and compact within each class (small per-class rates).

This follows the authors' released code, not the paper's display formula: the rate uses
``1 / (m eps)`` (the paper writes ``d / (m eps^2)``, whose factor d made the score grow with the
feature dimension: a fixed class signal padded with noise to more dimensions scored far higher),
the class rates are averaged with equal weights ``1/K``, and ``eps`` defaults to their 1e-4.
Before that, as the authors do for model selection:

1. *Row L2 normalisation*: every feature vector is scaled to unit norm, so the rate does not
   depend on the scale of a model's features and ``eps`` is a distortion relative to it
   (coding rates are defined for features on the sphere in MCR^2).
2. *Centring* (their code).
3. *Projection on the class-mean subspace* (``project=True``, the default for model
   selection): features are projected on the span of the centred class means (at most K - 1
   directions) before the rates. Only there do the labels carry information; the rates of the
   remaining directions are large for the whole set and rank-deficient for small classes
   (a class of n_c < d samples spans n_c directions), which rewarded feature dimension and
   noise. ``project=False`` gives the released-code score on all normalised directions.

   One deviation, *cross-fitting*: estimated on the very samples it then scores, the
   class-mean subspace overfits. With D features and n_c samples a class, the noise part of
   each estimated class mean has squared norm ~ D / n_c, and along that direction the classes
   look separated by noise alone (a 16-d signal padded with noise to 512 dims scored 1.53 ->
   2.29). Here each class is split in two halves (seeded); the subspace is estimated on one
   half and the rates computed on the other, both ways, and the two scores averaged. Noise
   directions of one half carry no class separation in the other, so padding with noise no
   longer raises the score (1.57 -> 0.88 on that case).

Padding the features with pure noise then can only lower the score (the noise dilutes the
normalised signal and adds within-class spread inside the projected subspace), as a test
checks. Each logdet is computed on the smaller Gram matrix (Sylvester: logdet(I_d + a Z^T Z) =
logdet(I_m + a Z Z^T)) by Cholesky.
"""

from __future__ import annotations

import numpy as np
from scipy import linalg

from zoopick.selection.metrics.leep import one_hot, target_labels
from zoopick.selection.metrics.registry import MetricError, register


def coding_rate(Z: np.ndarray, eps: float) -> float:
    """R(Z, eps) = 1/2 logdet(I + 1 / (m eps) Z^T Z) for Z of shape (m, d) (the authors' form)."""
    m, d = Z.shape
    if m == 0 or d == 0:
        return 0.0
    a = 1.0 / (m * eps)
    gram = Z.T @ Z if m >= d else Z @ Z.T
    gram *= a
    gram.flat[:: gram.shape[0] + 1] += 1.0
    chol = linalg.cholesky(gram, lower=True)  # I + PSD is positive definite
    return float(np.sum(np.log(np.diag(chol))))  # 1/2 logdet = sum log diag(L)


def class_mean_basis(z: np.ndarray, y: np.ndarray, c: int) -> np.ndarray:
    """Orthonormal basis (d, r) of the span of the centred class means of ``z`` (r <= C - 1)."""
    counts = np.bincount(y, minlength=c).astype(np.float64)
    means = np.asarray(one_hot(y, c) @ z) / counts[:, None]
    means -= counts @ means / counts.sum()
    u, s, vt = linalg.svd(means, full_matrices=False)
    keep = s > (s[0] if s.size else 0.0) * 1e-10
    return vt[keep].T


def _halves(y: np.ndarray, c: int, seed: int) -> np.ndarray:
    """Boolean mask of a seeded half of every class (the smaller half when n_c is odd)."""
    rng = np.random.default_rng((seed, y.size, c))
    mask = np.zeros(y.size, dtype=bool)
    for k in range(c):
        rows = np.flatnonzero(y == k)
        mask[rng.permutation(rows)[: rows.size // 2]] = True
    return mask


def _rate_gap(z: np.ndarray, y: np.ndarray, eps: float) -> float:
    """R(Z) - mean over the classes present of R(Z_c)."""
    classes = np.unique(y)
    return coding_rate(z, eps) - float(np.mean([coding_rate(z[y == k], eps) for k in classes]))


@register("transrate", needs={"features"})
def transrate(
    *,
    labels: np.ndarray,
    features: np.ndarray,
    eps: float = 1e-4,
    project: bool = True,
    seed: int = 0,
) -> float:
    """TransRate (Huang et al. 2022): coding rate of features minus that given the labels.

    Authors' code: R(Z) - mean_c R(Z_c) with R = 1/2 logdet(I + Z^T Z / (m eps)), on row-L2-
    normalised, centred features; ``project`` (default) first projects them on the class-mean
    subspace, as the authors do for model selection, cross-fitted over two seeded halves of
    every class (``seed``; module docstring). Higher is better."""
    y, c = target_labels(labels, "transrate")
    if not eps > 0:
        raise MetricError(f"transrate: eps must be positive, got {eps}")
    norms = np.linalg.norm(features, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise MetricError("transrate: some feature vectors are all zero (cannot normalise)")
    z = features / norms
    z = z - z.mean(axis=0)
    if not np.any(z):
        raise MetricError("transrate: features have zero variance")
    if not project:
        return _rate_gap(z, y, eps)
    if np.bincount(y, minlength=c).min() < 2:
        raise MetricError("transrate: project=True needs at least 2 samples in every class")
    half = _halves(y, c, seed)
    scores = []
    for fit in (half, ~half):
        basis = class_mean_basis(z[fit], y[fit], c)
        scored = z[~fit] @ basis
        scores.append(_rate_gap(scored - scored.mean(axis=0), y[~fit], eps))  # centred, as theirs
    return float(np.mean(scores))
