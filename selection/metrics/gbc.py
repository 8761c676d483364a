"""GBC: Gaussian Bhattacharyya Coefficient (Pandy et al., CVPR 2022, "Transferability
Estimation using Bhattacharyya Class Separability").

Features are reduced with PCA (64 dimensions, the paper's and reference code's setting), each
target class is modelled as a Gaussian, and the overlap of every pair of classes is measured by
the Bhattacharyya coefficient BC = exp(-D_B). GBC = -sum over ordered pairs i != j of BC_ij: 0
for perfectly separated classes, down to -C_t (C_t - 1) when all classes coincide. Higher is
better.

This matches the authors' reference implementation (google-research ``stable_transfer``):

* per-class mean and per-dimension variance (``np.var``, divided by n_c), each variance floored
  at 1e-4 (an absolute floor, as theirs);
* ``covariance="spherical"`` (the reference configuration and the default here): the class
  variance is the mean of those floored per-dimension variances, a scalar s_i, and

      D_B = 1/8 sum_d (mu_id - mu_jd)^2 / s + 1/2 (ln s - 1/2 ln s_i - 1/2 ln s_j),
      s = (s_i + s_j) / 2,

  with the log-variance term counted *once* (the reference sums the log of a scalar), not d
  times as the exact Bhattacharyya distance of two spherical Gaussians would;
* ``covariance="diagonal"``: the same with vector variances, the log terms summed over the
  dimensions (the exact distance of diagonal Gaussians).
"""

from __future__ import annotations

import numpy as np
from scipy import linalg
from scipy.sparse import linalg as sparse_linalg

from zoopick.selection.metrics.leep import one_hot, target_labels
from zoopick.selection.metrics.registry import MetricError, register

_COVARIANCES = ("diagonal", "spherical")


VARIANCE_FLOOR = 1e-4  # the reference code's np.maximum(variance, 1e-4)


def class_gaussians(
    z: np.ndarray, y: np.ndarray, c: int, covariance: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per-class means (C, d) and variances: (C, d) per dimension for "diagonal", (C, 1) for
    "spherical" (the mean of the per-dimension ones). Variances are maximum likelihood (divided
    by n_c) and floored at 1e-4 per dimension before any averaging, as in the reference code."""
    counts = np.bincount(y, minlength=c).astype(np.float64)[:, None]
    oh = one_hot(y, c)
    means = np.asarray(oh @ z) / counts
    dev = z - means[y]
    var = np.maximum(np.asarray(oh @ (dev * dev)) / counts, VARIANCE_FLOOR)
    if covariance == "spherical":
        var = var.mean(axis=1, keepdims=True)
    return means, var


def bhattacharyya_coefficients(means: np.ndarray, var: np.ndarray) -> np.ndarray:
    """(C, C) matrix of BC between diagonal Gaussians (``var`` (C, d)) or spherical ones
    (``var`` (C, 1): the squared distance is summed over d, the log term taken once, as the
    reference code does); computed in row chunks to bound memory."""
    c, d = means.shape
    log_var = np.log(var)
    bc = np.empty((c, c))
    step = max(1, 4_000_000 // max(1, c * d))
    for lo in range(0, c, step):
        hi = min(c, lo + step)
        s = (var[lo:hi, None, :] + var[None, :, :]) / 2  # (b, C, d) or (b, C, 1)
        diff2 = (means[lo:hi, None, :] - means[None, :, :]) ** 2
        db = np.sum(diff2 / s, axis=2) / 8 + 0.5 * np.sum(
            np.log(s) - 0.5 * (log_var[lo:hi, None, :] + log_var[None, :, :]), axis=2
        )
        bc[lo:hi] = np.exp(-db)
    return bc


def _top_eigenvectors(g: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest eigenvalues (descending) and eigenvectors of symmetric PSD ``g``. Lanczos
    (ARPACK, deterministic start vector) when k is small against the size, which avoids the
    O(D^3) full decomposition; LAPACK otherwise."""
    m = g.shape[0]
    if 4 * k < m:
        v0 = np.random.default_rng(0).standard_normal(m)
        lam, vecs = sparse_linalg.eigsh(g, k=k, which="LA", v0=v0)
    else:
        lam, vecs = linalg.eigh(g, subset_by_index=[m - k, m - 1])
    order = np.argsort(lam)[::-1]
    return lam[order], vecs[:, order]


def pca_project(x: np.ndarray, k: int) -> np.ndarray:
    """Scores of ``x`` on its top-``k`` principal components: what ``sklearn PCA(k)
    .fit_transform`` returns up to the sign of each component (irrelevant here: diagonal
    Gaussians are invariant to flipping a coordinate), computing only k eigenvectors."""
    n, d = x.shape
    xc = x - x.mean(axis=0)
    if n >= d:
        _, vecs = _top_eigenvectors(xc.T @ xc, k)
        return xc @ vecs
    # n < D: use the (n, n) Gram matrix; the scores are U S = eigenvectors * sqrt(eigenvalues).
    lam, u = _top_eigenvectors(xc @ xc.T, k)
    return u * np.sqrt(np.maximum(lam, 0.0))


@register("gbc", needs={"features"})
def gbc(
    *, labels: np.ndarray, features: np.ndarray, dim: int = 64, covariance: str = "spherical"
) -> float:
    """GBC (Pandy et al. 2022): minus the summed class-pair Bhattacharyya coefficients.

    Per-class Gaussians (``covariance`` "spherical", the reference configuration, or
    "diagonal") in a ``dim``-dimensional PCA space, variances floored at 1e-4 as the reference
    code; in [-C_t (C_t - 1), 0], higher is better."""
    y, c = target_labels(labels, "gbc")
    if covariance not in _COVARIANCES:
        raise MetricError(f"gbc: covariance must be one of {_COVARIANCES}, got {covariance!r}")
    if dim < 1:
        raise MetricError("gbc: dim must be >= 1")
    n, d = features.shape
    if not np.any(features.var(axis=0) > 0):
        raise MetricError("gbc: features have zero variance")
    z = pca_project(features, min(dim, d, n))
    means, var = class_gaussians(z, y, c, covariance)
    bc = bhattacharyya_coefficients(means, var)
    np.fill_diagonal(bc, 0.0)
    return float(-bc.sum())
