"""LEEP: Log Expected Empirical Prediction (Nguyen et al., ICML 2020, "LEEP: A New Measure to
Evaluate Transferability of Learned Representations").

LEEP treats the source head's softmax ``theta(x)`` as a soft assignment to source classes ``z``,
builds the empirical joint ``P(y, z) = 1/n sum_i theta_i(z) [y_i = y]`` over the target set, and
scores the model by how well the resulting "dummy classifier" ``sum_z P(y|z) theta(x)(z)``
predicts the true target labels: the mean log-likelihood. It needs no training at all, only the
logits of one forward pass.

This module also holds :func:`target_labels`, the label check every baseline metric shares
(remapping arbitrary non-negative ints to ``0..C_t-1`` and rejecting degenerate label sets).
"""

from __future__ import annotations

import numpy as np
from scipy import sparse

from zoopick.selection.metrics.registry import MetricError, register


def target_labels(labels: np.ndarray, metric: str) -> tuple[np.ndarray, int]:
    """Remap labels to ``0..C_t-1`` and return ``(y, C_t)``.

    Every transferability score compares classes, so a single class is meaningless; and with no
    more samples than classes no class has two members, so within-class statistics (and the
    empirical joints of LEEP/NCE) carry no information. Both are rejected with a
    :class:`MetricError` rather than producing a number nobody should trust.
    """
    classes, y = np.unique(labels, return_inverse=True)
    c = int(classes.size)
    if c < 2:
        raise MetricError(f"{metric} needs at least 2 target classes, got {c}")
    if y.size <= c:
        raise MetricError(
            f"{metric} needs more samples than target classes ({y.size} samples, {c} classes)"
        )
    return y.reshape(-1).astype(np.int64, copy=False), c


def one_hot(y: np.ndarray, c: int) -> sparse.csr_matrix:
    """Sparse ``(C_t, n)`` class-membership matrix: ``one_hot(y, c) @ X`` gives class sums."""
    n = y.size
    return sparse.csr_matrix((np.ones(n), (y, np.arange(n))), shape=(c, n))


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row softmax in float64, shifted by the row max so large logits cannot overflow."""
    z = logits - logits.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    return z


def leep_from_probs(theta: np.ndarray, y: np.ndarray, c: int) -> float:
    """LEEP of a row-stochastic "source" distribution ``theta`` (n, K) for labels ``y``.

    Shared with NLEEP, which plugs in Gaussian-mixture posteriors instead of a softmax head.
    """
    n = y.size
    joint = np.asarray(one_hot(y, c) @ theta) / n  # P(y, z), (C_t, K)
    pz = joint.sum(axis=0)  # P(z)
    with np.errstate(divide="ignore", invalid="ignore"):
        cond = np.where(pz > 0, joint / pz, 0.0)  # P(y | z); a z nobody uses contributes 0
    eep = (theta @ cond.T)[np.arange(n), y]  # sum_z P(y_i | z) theta_i(z)
    if np.any(eep <= 0):
        raise MetricError("leep: expected empirical prediction is zero for some sample")
    return float(np.mean(np.log(eep)))


@register("leep", needs={"logits"})
def leep(*, labels: np.ndarray, logits: np.ndarray) -> float:
    """LEEP (Nguyen et al. 2020): log-likelihood of labels under source softmax x P(y|z).

    Mean over samples of log sum_z P(y_i|z) theta_i(z), in (-inf, 0]; higher is better."""
    y, c = target_labels(labels, "leep")
    return leep_from_probs(softmax(logits), y, c)
