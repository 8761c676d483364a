"""NCE: Negative Conditional Entropy (Tran et al., ICCV 2019, "Transferability and Hardness of
Supervised Classification Tasks").

The source head's hard prediction ``z = argmax logits`` is treated as a discrete code for each
target example; NCE = -H(Y|Z) from the empirical joint of ``(y, z)``. If the source labels
already determine the target labels the conditional entropy is 0 (the best score); the more
target classes share a source label, the lower the score.
"""

from __future__ import annotations

import numpy as np

from zoopick.selection.metrics.leep import target_labels
from zoopick.selection.metrics.registry import register


@register("nce", needs={"logits"})
def nce(*, labels: np.ndarray, logits: np.ndarray) -> float:
    """NCE (Tran et al. 2019): negative conditional entropy of labels given source argmax.

    -H(Y|Z) = sum p(y,z) log p(y|z) with z = argmax logits, <= 0; higher is better."""
    y, c = target_labels(labels, "nce")
    n = y.size
    k = logits.shape[1]
    z = np.argmax(logits, axis=1)
    counts = np.bincount(y * k + z, minlength=c * k).reshape(c, k).astype(np.float64)
    cz = counts.sum(axis=0)  # n * p(z)
    nz = counts > 0
    p_yz = counts[nz] / n
    p_y_given_z = counts[nz] / np.broadcast_to(cz, counts.shape)[nz]
    return float(np.sum(p_yz * np.log(p_y_given_z)))
