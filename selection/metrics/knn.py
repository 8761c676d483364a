"""Leave-one-out k-nearest-neighbour accuracy on the frozen features.

A training-free, assumption-light baseline: if the features already put same-class examples
next to each other, a k-NN classifier on them is accurate, and fine-tuning starts from a good
place. Features are L2-normalised and compared by cosine similarity; each sample is classified
by a majority vote of its k most similar *other* samples. Ties in the vote go to the class with
the larger summed similarity, then to the smaller label, so the score is deterministic.

Cost: the n x n similarity matrix is never stored. It is computed in float32 row blocks
(similarities need no more precision to rank neighbours), and only the upper block triangle is
multiplied: block (i, j) serves both the rows of i and, transposed, the rows of j, halving the
work. The running top-k per row is merged block by block (``argpartition`` for a row's first
block, then only the few entries above its current k-th best), so memory stays at
O(block^2 + n k). Neighbours tied exactly at the k-th similarity are picked arbitrarily.
"""

from __future__ import annotations

import numpy as np

from zoopick.selection.metrics.leep import target_labels
from zoopick.selection.metrics.registry import MetricError, register

_BLOCK = 2048


def _merge_topk(
    best_s: np.ndarray, best_i: np.ndarray, s: np.ndarray, cols: np.ndarray, k: int
) -> None:
    """Merge candidate similarities ``s`` (b, m) with column indices ``cols`` (m,) into the
    running top-k ``best_s``/``best_i`` (b, k), in place.

    Once every row holds k finite similarities, only candidates above the row's current k-th
    best can matter; they are a small fraction of the block, found with one comparison pass and
    merged by a sort of just those entries. That is several times cheaper than partitioning
    every block row.
    """
    thr = best_s.min(axis=1)
    if np.isneginf(thr).any():  # first block these rows see: plain partition
        if s.shape[1] > k:
            part = np.argpartition(s, -k, axis=1)[:, -k:]
            s, idx = np.take_along_axis(s, part, axis=1), cols[part]
        else:
            idx = np.broadcast_to(cols, s.shape)
        all_s = np.concatenate([best_s, s], axis=1)
        all_i = np.concatenate([best_i, idx], axis=1)
        part = np.argpartition(all_s, -k, axis=1)[:, -k:]
        best_s[:] = np.take_along_axis(all_s, part, axis=1)
        best_i[:] = np.take_along_axis(all_i, part, axis=1)
        return
    rows, j = np.nonzero(s > thr[:, None])
    if rows.size == 0:
        return
    touched = np.unique(rows)
    all_rows = np.concatenate([rows, np.repeat(touched, k)])
    all_s = np.concatenate([s[rows, j], best_s[touched].ravel()])
    all_i = np.concatenate([cols[j], best_i[touched].ravel()])
    order = np.lexsort((-all_s, all_rows))  # by row, then similarity descending
    all_rows = all_rows[order]
    first = np.searchsorted(all_rows, touched)  # each touched row has >= k entries
    take = (first[:, None] + np.arange(k)).ravel()
    best_s[touched] = all_s[order[take]].reshape(-1, k)
    best_i[touched] = all_i[order[take]].reshape(-1, k)


def nearest_neighbours(x: np.ndarray, k: int, block: int = _BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Indices (n, k) and similarities (n, k) of each row's k most similar other rows under the
    inner product of ``x`` (unordered within the k)."""
    n = x.shape[0]
    best_s = np.full((n, k), -np.inf, dtype=x.dtype)
    best_i = np.full((n, k), -1, dtype=np.int64)
    starts = range(0, n, block)
    for a in starts:
        ra = slice(a, min(n, a + block))
        cols_a = np.arange(ra.start, ra.stop)
        for b in starts[a // block :]:
            rb = slice(b, min(n, b + block))
            s = x[ra] @ x[rb].T
            if b == a:
                np.fill_diagonal(s, -np.inf)  # leave one out: a sample is not its own neighbour
            _merge_topk(best_s[ra], best_i[ra], s, np.arange(b, rb.stop), k)
            if b != a:  # the same block serves the rows of rb, transposed
                _merge_topk(best_s[rb], best_i[rb], s.T, cols_a, k)
    return best_i, best_s


@register("knn", needs={"features"})
def knn(*, labels: np.ndarray, features: np.ndarray, k: int = 5) -> float:
    """Leave-one-out k-NN accuracy on L2-normalised features (cosine similarity).

    Majority vote of the ``k`` most similar other samples, ties broken by summed similarity
    then smaller label; in [0, 1], higher is better."""
    y, c = target_labels(labels, "knn")
    n = y.size
    if k < 1:
        raise MetricError(f"knn: k must be >= 1, got {k}")
    if n <= k:
        raise MetricError(f"knn: needs more than k={k} samples, got {n}")
    norms = np.linalg.norm(features, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise MetricError("knn: some feature vectors are all zero (cosine similarity undefined)")
    x = (features / norms).astype(np.float32)
    idx, sim = nearest_neighbours(x, k)
    nb = y[idx]  # (n, k) neighbour labels
    votes = np.zeros((n, c))
    simsum = np.zeros((n, c))
    rows = np.arange(n)
    for j in range(k):  # one neighbour per row at a time, so no index repeats within a step
        votes[rows, nb[:, j]] += 1.0
        simsum[rows, nb[:, j]] += sim[:, j]
    # Lexicographic (votes, summed similarity): one vote outweighs any similarity difference
    # (|summed similarity| <= k); argmax then breaks exact ties towards the smaller label.
    pred = np.argmax(votes * (2 * k + 1) + simsum, axis=1)
    return float(np.mean(pred == y))
