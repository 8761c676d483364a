"""TransRate (Huang et al., ICML 2022, "Frustratingly Easy Transferability Estimation").

TransRate estimates the mutual information between features and labels with the coding rate, a
rate-distortion surrogate for entropy (from Ma et al.'s MCR^2):

    R(Z, eps) = 1/2 logdet(I_d + d / (m eps^2) Z^T Z)        for Z of m rows and d columns,
    TransRate = R(Z, eps) - sum_c (n_c / n) R(Z_c, eps),

where Z are the centred features and Z_c the rows of class c. High TransRate means the features
are both complete (large overall rate) and compact within each class (small per-class rates).

Normalisation: the coding rate depends on the feature scale, so after centring the features are
rescaled by one global factor so that the mean squared row norm is 1 (||Z||_F^2 = n). This keeps
the geometry, makes ``eps`` a distortion relative to the feature spread, and makes the score
comparable across models whose features live on different scales.

Each logdet is computed on the smaller Gram matrix (Sylvester: logdet(I_d + a Z^T Z) =
logdet(I_m + a Z Z^T)), by Cholesky, so the per-class terms cost O(n_c^2 d) each.
"""

from __future__ import annotations

import numpy as np
from scipy import linalg

from zoopick.selection.metrics.leep import target_labels
from zoopick.selection.metrics.registry import MetricError, register


def coding_rate(Z: np.ndarray, eps: float) -> float:
    """R(Z, eps) = 1/2 logdet(I + d / (m eps^2) Z^T Z) for Z of shape (m, d)."""
    m, d = Z.shape
    a = d / (m * eps * eps)
    gram = Z.T @ Z if m >= d else Z @ Z.T
    gram *= a
    gram.flat[:: gram.shape[0] + 1] += 1.0
    chol = linalg.cholesky(gram, lower=True)  # I + PSD is positive definite
    return float(np.sum(np.log(np.diag(chol))))  # 1/2 logdet = sum log diag(L)


@register("transrate", needs={"features"})
def transrate(*, labels: np.ndarray, features: np.ndarray, eps: float = 1e-4) -> float:
    """TransRate (Huang et al. 2022): coding rate of features minus that given the labels.

    R(Z, eps) - sum_c n_c/n R(Z_c, eps) on centred, globally rescaled features; higher is
    better."""
    y, c = target_labels(labels, "transrate")
    if not eps > 0:
        raise MetricError(f"transrate: eps must be positive, got {eps}")
    n = y.size
    z = features - features.mean(axis=0)
    scale = np.sqrt(np.sum(z * z) / n)
    if scale == 0:
        raise MetricError("transrate: features have zero variance")
    z /= scale
    order = np.argsort(y, kind="stable")
    counts = np.bincount(y, minlength=c)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    zs = z[order]
    conditional = sum(
        counts[k] / n * coding_rate(zs[bounds[k] : bounds[k + 1]], eps) for k in range(c)
    )
    return coding_rate(z, eps) - conditional
