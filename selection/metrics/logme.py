"""LogME (You et al., ICML 2021, "LogME: Practical Assessment of Pre-trained Models for Transfer
Learning").

For each target class the one-hot indicator ``y`` is modelled as Bayesian linear regression on
the frozen features: ``w ~ N(0, alpha^-1 I)``, ``y | F, w ~ N(F w, beta^-1 I)``. The score is the
log marginal likelihood (evidence) maximised over ``(alpha, beta)``, divided by ``n`` and averaged
over classes. The maximisation uses MacKay's fixed-point updations

    gamma = sum_i beta s_i / (alpha + beta s_i),  alpha <- gamma / m^T m,
    beta <- (n - gamma) / ||F m - y||^2,

whose fixed point is a stationary point of the evidence. Everything is computed from one
eigendecomposition of the Gram matrix (``F^T F`` when ``n >= D``, ``F F^T`` when ``n < D``),
i.e. the SVD of ``F``, so each iteration costs O(min(n, D) * C_t) for all classes at once.
Features are used as given (no centring, no bias), as in the paper.
"""

from __future__ import annotations

import numpy as np

from zoopick.selection.metrics.leep import one_hot, target_labels
from zoopick.selection.metrics.registry import MetricError, register

_LOG_2PI = float(np.log(2.0 * np.pi))


def log_evidence(F: np.ndarray, y: np.ndarray, alpha: float, beta: float) -> float:
    """Log marginal likelihood of targets ``y`` (n,) given features ``F`` (n, D) at fixed
    ``alpha, beta``, evaluated directly in feature space (O(D^3)); used to check the fast path.

    L = n/2 log beta + D/2 log alpha - n/2 log 2pi - beta/2 ||F m - y||^2 - alpha/2 m^T m
        - 1/2 log|A|,   A = alpha I + beta F^T F,   m = beta A^-1 F^T y.
    """
    F = np.asarray(F, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n, d = F.shape
    A = alpha * np.eye(d) + beta * (F.T @ F)
    m = beta * np.linalg.solve(A, F.T @ y)
    sign, logdet_a = np.linalg.slogdet(A)
    if sign <= 0:
        raise MetricError("logme: A = alpha I + beta F^T F is not positive definite")
    res = F @ m - y
    return float(
        n / 2 * np.log(beta)
        + d / 2 * np.log(alpha)
        - n / 2 * _LOG_2PI
        - beta / 2 * (res @ res)
        - alpha / 2 * (m @ m)
        - logdet_a / 2
    )


def _spectrum(F: np.ndarray, Y_sums_fn) -> tuple[np.ndarray, np.ndarray]:
    """Nonzero eigenvalues ``sigma`` (r,) of ``F^T F`` and ``X = U^T Y`` (r, C) where ``U`` holds
    the matching left singular vectors of ``F``. ``Y_sums_fn(M)`` returns ``Y^T M``."""
    n, d = F.shape
    if n >= d:
        sigma, V = np.linalg.eigh(F.T @ F)
        keep = sigma > sigma[-1] * max(n, d) * np.finfo(np.float64).eps
        sigma, V = sigma[keep], V[:, keep]
        # U^T Y = S^-1 V^T F^T Y
        X = (V.T @ Y_sums_fn(F).T) / np.sqrt(sigma)[:, None]
    else:
        sigma, U = np.linalg.eigh(F @ F.T)
        keep = sigma > sigma[-1] * max(n, d) * np.finfo(np.float64).eps
        sigma, U = sigma[keep], U[:, keep]
        X = Y_sums_fn(U).T
    return sigma, X


def fit_evidence(
    F: np.ndarray,
    Y: np.ndarray,
    *,
    max_iter: int = 100,
    tol: float = 1e-10,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximise the evidence for every column of ``Y`` (n, C) by MacKay's fixed point.

    Returns ``(alphas, betas, evidences)`` (each (C,)); evidences are log marginal likelihoods
    (not divided by n) at the final ``(alpha, beta)``, identical to :func:`log_evidence`.
    """
    F = np.asarray(F, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    if Y.ndim == 1:
        Y = Y[:, None]
    return _fit(F, lambda M: Y.T @ M, (Y * Y).sum(axis=0), max_iter=max_iter, tol=tol)


def _fit(F, Y_sums_fn, y2, *, max_iter: int, tol: float):
    n, d = F.shape
    if not np.any(F):
        raise MetricError("logme: all features are zero")
    sigma, X = _spectrum(F, Y_sums_fn)
    s = sigma[:, None]
    x2 = X * X
    # Part of ||y||^2 outside the column space of F (a residual no (alpha, beta) can fit).
    res_out = np.maximum(y2 - x2.sum(axis=0), 0.0)
    # Tiny floors so a class exactly in (or orthogonal to) the span cannot divide by zero.
    m2_floor = 1e-12 * y2 / sigma[-1]
    res_floor = 1e-12 * y2

    def stats(t):
        shrink = t / (s + t)  # alpha / (alpha + beta s) per direction
        gamma = (s / (s + t)).sum(axis=0)
        m2 = (s * x2 / (s + t) ** 2).sum(axis=0) + m2_floor
        res2 = (x2 * shrink**2).sum(axis=0) + res_out + res_floor
        return gamma, m2, res2

    alpha = np.ones(y2.shape)
    beta = np.ones(y2.shape)
    for _ in range(max_iter):
        t = alpha / beta
        gamma, m2, res2 = stats(t)
        alpha = gamma / m2
        beta = (n - gamma) / res2
        t_new = alpha / beta
        if np.all(np.abs(t_new - t) <= tol * t):
            break
    gamma, m2, res2 = stats(alpha / beta)
    m2 -= m2_floor
    res2 -= res_floor
    with np.errstate(divide="ignore", invalid="ignore"):
        evidence = (
            d / 2 * np.log(alpha)
            + n / 2 * np.log(beta)
            - 0.5 * np.log(alpha + beta * s).sum(axis=0)
            - (d - sigma.size) / 2 * np.log(alpha)  # zero eigenvalues: log(alpha + 0)
            - beta / 2 * res2
            - alpha / 2 * m2
            - n / 2 * _LOG_2PI
        )
    if not np.all(np.isfinite(evidence)):
        raise MetricError("logme: evidence maximisation diverged (degenerate features?)")
    return alpha, beta, evidence


@register("logme", needs={"features"})
def logme(*, labels: np.ndarray, features: np.ndarray, max_iter: int = 100) -> float:
    """LogME (You et al. 2021): maximised Bayesian linear-regression evidence per sample.

    Evidence of each one-hot target column given the features, maximised over (alpha, beta),
    divided by n and averaged over classes; higher is better. ``max_iter`` caps the fixed-point
    iterations (they normally converge in a few)."""
    y, c = target_labels(labels, "logme")
    onehot = one_hot(y, c)  # (C, n); Y^T M = onehot @ M
    y2 = np.bincount(y, minlength=c).astype(np.float64)
    _, _, evidence = _fit(
        features, lambda M: np.asarray(onehot @ M), y2, max_iter=max_iter, tol=1e-10
    )
    return float(np.mean(evidence) / y.size)
