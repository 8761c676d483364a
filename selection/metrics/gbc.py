"""GBC: Gaussian Bhattacharyya Coefficient (Pandy et al., CVPR 2022, "Transferability
Estimation using Bhattacharyya Class Separability").

Features are reduced with PCA (64 dimensions in the paper), each target class is modelled as a
Gaussian (diagonal covariance by default, or spherical), and the overlap of every pair of
classes is measured by the Bhattacharyya coefficient BC = exp(-D_B) with

    D_B = 1/8 (mu_i - mu_j)^T S^-1 (mu_i - mu_j) + 1/2 ln(det S / sqrt(det S_i det S_j)),
    S = (S_i + S_j) / 2.

GBC = -sum over ordered pairs i != j of BC_ij: 0 for perfectly separated classes, down to
-C_t (C_t - 1) when all classes coincide. Higher is better.
"""

from __future__ import annotations

import numpy as np
from scipy import linalg
from scipy.sparse import linalg as sparse_linalg

from zoopick.selection.metrics.leep import one_hot, target_labels
from zoopick.selection.metrics.registry import MetricError, register

_COVARIANCES = ("diagonal", "spherical")


def class_gaussians(
    z: np.ndarray, y: np.ndarray, c: int, covariance: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per-class means (C, d) and diagonal variances (C, d) (maximum likelihood, i.e. divided
    by n_c). Spherical: each class's variances replaced by their mean. Variances are floored at
    1e-12 of the mean overall variance so a singleton or constant class stays finite (its
    overlap with every other class is then ~0)."""
    counts = np.bincount(y, minlength=c).astype(np.float64)[:, None]
    oh = one_hot(y, c)
    means = np.asarray(oh @ z) / counts
    dev = z - means[y]
    var = np.asarray(oh @ (dev * dev)) / counts
    if covariance == "spherical":
        var = np.repeat(var.mean(axis=1, keepdims=True), z.shape[1], axis=1)
    floor = 1e-12 * float(np.mean(z.var(axis=0)))
    return means, np.maximum(var, floor)


def bhattacharyya_coefficients(means: np.ndarray, var: np.ndarray) -> np.ndarray:
    """(C, C) matrix of BC between diagonal Gaussians; computed in row chunks to bound memory."""
    c, d = means.shape
    log_var = np.log(var)
    bc = np.empty((c, c))
    step = max(1, 4_000_000 // max(1, c * d))
    for lo in range(0, c, step):
        hi = min(c, lo + step)
        s = (var[lo:hi, None, :] + var[None, :, :]) / 2  # (b, C, d)
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
    *, labels: np.ndarray, features: np.ndarray, dim: int = 64, covariance: str = "diagonal"
) -> float:
    """GBC (Pandy et al. 2022): minus the summed class-pair Bhattacharyya coefficients.

    Per-class Gaussians (``covariance`` "diagonal" or "spherical") in a ``dim``-dimensional PCA
    space; in [-C_t (C_t - 1), 0], higher is better."""
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
