"""SFDA: Self-challenging Fisher Discriminant Analysis (Shao et al., ECCV 2022, "Not All Models
Are Equal: Predicting Model Transferability in a Self-challenging Fisher Space").

How it is computed here, following the paper and the authors' reference implementation:

1. Regularised Fisher space. With class priors pi_c = n_c / n and class means mu_c, the
   within-class scatter is S_w = sum_c pi_c cov_c (covariances normalised by n_c). It is shrunk
   towards a scaled identity, S_l = (1 - l) S_w + l (tr S_w / D) I, with the adaptive strength
   l = max(exp(-a sigma_max(S_w)), 1e-10), a = 5, sigma_max the largest eigenvalue (found by
   power iteration; the paper's rule). The Fisher projection solves S_b v = e S_l v; the
   reference code keeps *all* D generalised eigenvectors V, so V V^T = S_l^-1 and the Gaussian
   class posterior in the Fisher space is exactly regularised LDA:
   p(c | x) = softmax_c(x^T S_l^-1 mu_c - 1/2 mu_c^T S_l^-1 mu_c + log pi_c).
   That is what is computed (one Cholesky solve instead of a D x D generalised eigenproblem).
2. Self-challenging (ConfMix). Each sample is moved towards the mean of the *other* classes'
   means in proportion to how unsure the first classifier is about it:
   x' = w x + (1 - w) mean_{k != y} mu_k, with w = softmax(p(. | x))_y (the reference code's
   softened confidence: a softmax over the probabilities). Hard, confusable samples thus become
   harder, and models whose features stay separable under this challenge score higher.
3. The Fisher classifier is refitted on the mixed features with the same l, and the score is the
   mean posterior of the true class, (1/n) sum_i p(y_i | x'_i), as in the reference code (which
   drops the log "for stability"); ``log=True`` gives the mean log-likelihood instead.

Faithful, it degenerates when D is near or above n (the classes are then linearly separable
for every model and SFDA ties at 1.0); ``pca_dim`` (default off) scores the top principal
components instead, a common dimension for every model, and the benchmark reports both forms.
"""

from __future__ import annotations

import numpy as np
from scipy import linalg, special

from zoopick.selection.metrics.hscore import reduce_features
from zoopick.selection.metrics.leep import one_hot, softmax, target_labels
from zoopick.selection.metrics.registry import MetricError, register


def largest_eigenvalue(S: np.ndarray, *, max_iter: int = 200, tol: float = 1e-8) -> float:
    """Largest eigenvalue of a symmetric PSD matrix by power iteration (cheap: O(D^2) a step)."""
    x = S.sum(axis=1)
    if not np.any(x):
        x = np.ones(S.shape[0])
    x /= np.linalg.norm(x)
    lam = 0.0
    for _ in range(max_iter):
        v = S @ x
        lam_new = float(x @ v)
        norm = np.linalg.norm(v)
        if norm == 0:
            return 0.0
        x = v / norm
        if abs(lam_new - lam) <= tol * abs(lam_new):
            return lam_new
        lam = lam_new
    return lam


def fisher_logits(
    X: np.ndarray, y: np.ndarray, c: int, shrinkage: float | None, a: float = 5.0
) -> tuple[np.ndarray, np.ndarray, float]:
    """Regularised-Fisher class log-posteriors up to a per-row constant (n, C), class means
    (C, D) and the shrinkage used."""
    n, d = X.shape
    counts = np.bincount(y, minlength=c).astype(np.float64)
    means = np.asarray(one_hot(y, c) @ X) / counts[:, None]
    dev = X - means[y]
    sw = dev.T @ dev / n  # sum_c pi_c cov_c
    if shrinkage is None:
        shrinkage = max(float(np.exp(-a * largest_eigenvalue(sw))), 1e-10)
    mu = np.trace(sw) / d
    if mu <= 0:
        raise MetricError("sfda: within-class scatter is zero (every class is a single point)")
    s = (1.0 - shrinkage) * sw
    s.flat[:: d + 1] += shrinkage * mu
    try:
        w = linalg.cho_solve(linalg.cho_factor(s, lower=True), means.T)  # S_l^-1 mu_c, (D, C)
    except linalg.LinAlgError as e:
        raise MetricError(f"sfda: regularised within-class scatter is singular: {e}") from e
    logits = X @ w - 0.5 * np.einsum("cd,dc->c", means, w) + np.log(counts / n)
    return logits, means, shrinkage


@register("sfda", needs={"features"})
def sfda(
    *,
    labels: np.ndarray,
    features: np.ndarray,
    shrinkage: float | None = None,
    log: bool = False,
    pca_dim: int | None = None,
) -> float:
    """SFDA (Shao et al. 2022): self-challenging regularised Fisher discriminant score.

    Mean true-class posterior of a regularised Fisher classifier refitted after the ConfMix
    step; higher is better.

    ``shrinkage``: fixed regularisation strength in [0, 1] (default: the paper's adaptive
    exp(-5 sigma_max(S_w))). ``log``: average log-posteriors instead of posteriors.
    ``pca_dim``: score the top ``pca_dim`` principal components (default off: the faithful
    form, which ties near 1.0 when D is near or above n, the classes then being separable
    in the Fisher space of any model).
    """
    y, c = target_labels(labels, "sfda")
    if shrinkage is not None and not 0.0 <= shrinkage <= 1.0:
        raise MetricError(f"sfda: shrinkage must be in [0, 1], got {shrinkage}")
    features = reduce_features(features, pca_dim, "sfda")
    n = y.size
    rows = np.arange(n)
    logits, means, lam = fisher_logits(features, y, c, shrinkage)
    # ConfMix: softened confidence in the true class, and the mean of the other classes' means.
    conf = softmax(softmax(logits))[rows, y][:, None]
    outer = (means.sum(axis=0) - means) / (c - 1)
    mixed = conf * features + (1.0 - conf) * outer[y]
    logits2, _, _ = fisher_logits(mixed, y, c, lam)
    log_p = logits2[rows, y] - special.logsumexp(logits2, axis=1)
    return float(np.mean(log_p) if log else np.mean(np.exp(log_p)))
