"""H-score (Bao et al., ICIP 2019, "An Information-Theoretic Approach to Transferability in Task
Transfer Learning") and its shrinkage-regularised variant (Ibrahim, Ponomareva & Mazumder 2022,
"Newer is not always better: Rethinking transferability metrics, their peculiarities, stability
and performance").

H(f) = tr(cov(f)^-1 cov(E[f | y])): how much of the feature covariance is explained by the class
means, i.e. the optimal value of the soft-HGR objective, an asymptotic proxy for the log-loss of
a linear classifier on the features. With D close to or above n, ``cov(f)`` is badly
conditioned and the inverse amplifies noise; Ibrahim et al. replace it by the Ledoit-Wolf
shrunk covariance ``cov_a = (1 - a) cov(f) + a mu I`` and scale the between-class covariance by
``(1 - a)`` to match, which makes the score stable in high dimension.

Plain ``hscore`` is kept faithful, and so it degenerates when D is near or above n: with
cov(f) of full rank n - 1 every centred class-mean direction is inside its range and
H = C - 1 exactly for *every* model (a tie, whatever the features). ``pca_dim`` (an option of
both metrics, default off) first projects the features on their top ``pca_dim`` principal
components, a common dimension for every model of a zoo (as GBC and PARC do), which removes
the tie; the benchmark reports both forms.
"""

from __future__ import annotations

import numpy as np
from scipy import linalg

from zoopick.selection.metrics.gbc import pca_project
from zoopick.selection.metrics.leep import one_hot, target_labels
from zoopick.selection.metrics.registry import MetricError, register


def reduce_features(features: np.ndarray, pca_dim: int | None, metric: str) -> np.ndarray:
    """``features`` projected on their top ``min(pca_dim, D, n - 1)`` principal components, or
    unchanged when ``pca_dim`` is None or not below D. The scores are invariant to the sign of
    each component, so any PCA solver gives the same score."""
    if pca_dim is None:
        return features
    if isinstance(pca_dim, bool) or not isinstance(pca_dim, int | np.integer) or pca_dim < 1:
        raise MetricError(f"{metric}: pca_dim must be a positive integer or None, got {pca_dim!r}")
    n, d = features.shape
    k = min(int(pca_dim), d, n - 1)
    if k >= d:
        return features
    if not np.any(features.var(axis=0) > 0):
        raise MetricError(f"{metric}: features have zero variance")
    return pca_project(features, k)


def _centred_class_means(
    features: np.ndarray, y: np.ndarray, c: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Centred features, class means of the centred features (C, D) and class counts."""
    f = features - features.mean(axis=0)
    counts = np.bincount(y, minlength=c).astype(np.float64)
    means = np.asarray(one_hot(y, c) @ f) / counts[:, None]
    return f, means, counts


@register("hscore", needs={"features"})
def hscore(
    *,
    labels: np.ndarray,
    features: np.ndarray,
    rcond: float | None = None,
    pca_dim: int | None = None,
) -> float:
    """H-score (Bao et al. 2019): tr(pinv(cov f) cov(E[f|y])) on centred features.

    Higher is better. ``pca_dim``: score the top ``pca_dim`` principal components instead of
    the raw features (default: the faithful form; it ties at C - 1 when D >= n - 1).

    ``rcond``: eigenvalues of cov(f) below ``rcond * largest`` are treated as zero by the
    pseudo-inverse; the default ``max(n, D) * machine eps`` is numpy's matrix-rank tolerance, so
    only numerically-zero directions are dropped.
    """
    y, c = target_labels(labels, "hscore")
    features = reduce_features(features, pca_dim, "hscore")
    n, d = features.shape
    f, means, counts = _centred_class_means(features, y, c)
    # Both covariances are normalised by n - 1 (np.cov), so the factor cancels in the trace:
    # H = sum_c n_c m_c^T pinv(f^T f) m_c.
    lam, Q = linalg.eigh(f.T @ f)
    if lam[-1] <= 0:
        raise MetricError("hscore: features have zero variance")
    tol = (max(n, d) * np.finfo(np.float64).eps) if rcond is None else rcond
    keep = lam > tol * lam[-1]
    proj = means @ Q[:, keep]  # class means in the eigenbasis of cov(f)
    return float(np.sum(counts[:, None] * proj**2 / lam[keep]))


def ledoit_wolf(f: np.ndarray) -> tuple[np.ndarray, float]:
    """Ledoit-Wolf shrunk covariance of centred ``f`` and its shrinkage ``a``: the same
    estimator as ``sklearn.covariance.LedoitWolf(assume_centered=True)`` (checked against it in
    the tests), but from a single Gram matrix. sklearn forms a second (n, D) x (D, n) product for
    the sum of ``(f^2)^T f^2``, which collapses to the sum of squared row norms of ``f``."""
    n, d = f.shape
    s = f.T @ f / n
    mu = np.trace(s) / d
    sq_norms = np.einsum("ij,ij->i", f, f)
    s_fro2 = float(np.sum(s * s))
    beta = (float(np.sum(sq_norms**2)) / n - s_fro2) / (d * n)
    delta = (s_fro2 - 2.0 * mu * np.trace(s) + d * mu * mu) / d  # ||s - mu I||_F^2 / D
    a = 0.0 if beta <= 0 or delta <= 0 else min(beta, delta) / delta
    s *= 1.0 - a
    s.flat[:: d + 1] += a * mu
    return s, a


@register("hscore_shrink", needs={"features"})
def hscore_shrink(*, labels: np.ndarray, features: np.ndarray, pca_dim: int | None = None) -> float:
    """Shrinkage H-score (Ibrahim et al. 2022): H-score with Ledoit-Wolf covariance.

    tr(cov_a(f)^-1 (1 - a) cov(E[f|y])) with the Ledoit-Wolf shrunk covariance cov_a and its
    shrinkage a; higher is better. ``pca_dim`` as for ``hscore`` (default off)."""
    y, c = target_labels(labels, "hscore_shrink")
    features = reduce_features(features, pca_dim, "hscore_shrink")
    n = y.size
    f, means, counts = _centred_class_means(features, y, c)
    if not np.any(f):
        raise MetricError("hscore_shrink: features have zero variance")
    cov_a, a = ledoit_wolf(f)
    # Between-class covariance as np.cov of the per-sample class means (normalised by n - 1),
    # as in the authors' evaluation code; the shrunk covariance is normalised by n.
    weights = counts / (n - 1)
    try:
        sol = linalg.cho_solve(linalg.cho_factor(cov_a, lower=True), means.T)  # (D, C)
    except linalg.LinAlgError:
        # Only when a == 0 and cov(f) is singular: fall back to the pseudo-inverse.
        sol = np.linalg.pinv(cov_a, hermitian=True) @ means.T
    quad = np.einsum("cd,dc->c", means, sol)  # m_c^T cov_a^-1 m_c
    return float((1.0 - a) * np.sum(weights * quad))
