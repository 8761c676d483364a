"""PARC: Pairwise Annotation Representation Comparison (Bolya, Mittapalli & Hoffman, NeurIPS
2021, "Scalable Diverse Model Selection for Accessible Transfer Learning").

A representational-similarity score: if a model's features are good for the target task, pairs
of images the labels call different should also be far apart in feature space. As the authors'
code computes it:

1. features reduced by PCA to ``dim`` = 32 dimensions (their default), then standardised per
   dimension (sklearn's ``StandardScaler``);
2. the n x n dissimilarity matrices ``1 - corrcoef`` of the feature rows and of the one-hot
   label rows;
3. PARC = 100 x the Spearman correlation of their upper triangles (pairs i < j).

The PCA is the authors' exactly: sklearn's randomized solver, one power iteration, random state
1919. (The score is not invariant to the sign of a component, since the correlation between two
samples subtracts each sample's mean over the dimensions, so the solver and its sign convention
are kept.) One deviation: the two triangles hold n(n-1)/2 entries each, so datasets larger than
``max_samples`` (5,000) are scored on a seeded stratified subsample (the authors subsample above
15,000). Cost O(n^2 dim) time and O(n^2) memory.
"""

from __future__ import annotations

import numpy as np
from scipy import stats
from sklearn.decomposition import PCA

from zoopick.selection.metrics.leep import target_labels
from zoopick.selection.metrics.registry import MetricError, register
from zoopick.selection.metrics.sms import stratified_subsample


def _dissimilarity_triangle(x: np.ndarray) -> np.ndarray:
    """Upper triangle (i < j) of ``1 - corrcoef(rows of x)``."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.corrcoef(x)
    iu = np.triu_indices(x.shape[0], k=1)
    return 1.0 - r[iu]


@register("parc", needs={"features"})
def parc(
    *,
    labels: np.ndarray,
    features: np.ndarray,
    dim: int | None = 32,
    max_samples: int = 5000,
    seed: int = 0,
) -> float:
    """PARC (Bolya et al. 2021): Spearman (x100) of pairwise feature vs label dissimilarities.

    Features: PCA to ``dim`` (None: no reduction), standardised; dissimilarity
    ``1 - corrcoef`` between samples; in [-100, 100], higher is better. Above ``max_samples``
    samples a seeded stratified subsample is scored."""
    y, c = target_labels(labels, "parc")
    n, d = features.shape
    if max_samples < 2 * c:
        raise MetricError(f"parc: max_samples must be at least 2 per class, got {max_samples}")
    if n > max_samples:
        rows = stratified_subsample(y, max_samples / n, seed)
        y, features = y[rows], features[rows]
        n = y.size
    if not np.any(features.var(axis=0) > 0):
        raise MetricError("parc: features have zero variance")
    x = features
    if dim is not None:
        if dim < 1:
            raise MetricError(f"parc: dim must be >= 1 or None, got {dim}")
        k = min(int(dim), d, n)
        x = PCA(
            n_components=k, svd_solver="randomized", random_state=1919, iterated_power=1
        ).fit_transform(x)
    sd = x.std(axis=0)
    x = (x - x.mean(axis=0)) / np.where(sd > 0, sd, 1.0)  # StandardScaler: constant -> 0
    feat = _dissimilarity_triangle(x)
    # 1 - corrcoef of one-hot rows, in closed form: 0 within a class, c/(c-1) across (the
    # correlation of two different one-hot rows is -1/(c-1)). np.corrcoef gives the same up to
    # rounding, but its 1e-16 noise would break the many exact ties of the Spearman ranks
    # arbitrarily.
    iu = np.triu_indices(n, k=1)
    lab = np.where(y[iu[0]] == y[iu[1]], 0.0, c / (c - 1.0))
    if not np.all(np.isfinite(feat)):
        raise MetricError("parc: a feature row is constant after standardisation")
    rho = stats.spearmanr(feat, lab).statistic
    if not np.isfinite(rho):
        raise MetricError("parc: Spearman correlation undefined (constant dissimilarities)")
    return float(100.0 * rho)
