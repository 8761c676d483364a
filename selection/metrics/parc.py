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
from zoopick.selection.metrics.nleep import signal_components
from zoopick.selection.metrics.registry import MetricError, register
from zoopick.selection.metrics.sms import stratified_subsample


def _dissimilarity_triangle(x: np.ndarray, iu: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Upper triangle ``iu`` (i < j) of ``1 - corrcoef(rows of x)``; the n x n matrix is
    dropped as soon as its triangle is taken (memory: n^2/2 pairs are the bulk of PARC's)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.corrcoef(x)
    tri = r[iu]
    del r
    np.subtract(1.0, tri, out=tri)
    return tri


def _spearman_with_binary(values: np.ndarray, flag: np.ndarray) -> float:
    """Spearman's rho of ``values`` against a two-valued variable (here the label
    dissimilarity: 0 within a class, c/(c-1) across, i.e. ``flag``), as ``scipy.stats.
    spearmanr`` computes it, in a fraction of its memory (n^2/2 pairs): the average ranks of
    a two-valued variable are an affine, increasing function of its flag, so rho is the Pearson
    correlation of the ranks of ``values`` with the flag, a difference of group means."""
    ranks = stats.rankdata(values)
    m, k = ranks.size, int(np.count_nonzero(flag))
    if k in (0, m) or not ranks.std() > 0:
        return float("nan")
    p = k / m
    mean_flagged = float(np.dot(ranks, flag)) / k
    return (mean_flagged - (m + 1) / 2) * np.sqrt(p / (1 - p)) / float(ranks.std())


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
    if d < 2 or (dim is not None and dim == 1):
        # its dissimilarity is 1 - the correlation of two samples' feature vectors, which is
        # undefined for vectors of one value
        raise MetricError("parc needs at least 2 feature dimensions (after its PCA)")
    if n > max_samples:
        if max_samples < 2 * c:  # only a subsample needs room for 2 images a class
            raise MetricError(
                f"parc: a subsample of max_samples={max_samples} cannot keep 2 images of "
                f"each of {c:,} classes; raise max_samples to at least {2 * c}"
            )
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
        pca = PCA(n_components=k, svd_solver="randomized", random_state=1919, iterated_power=1)
        x = signal_components(pca.fit_transform(x), pca.explained_variance_)
        if x.shape[1] < 2:
            raise MetricError(
                "parc needs features that vary in at least 2 directions; these vary in "
                f"{x.shape[1]}"
            )
    sd = x.std(axis=0)
    x = (x - x.mean(axis=0)) / np.where(sd > 0, sd, 1.0)  # StandardScaler: constant -> 0
    iu = np.triu_indices(n, k=1)  # built once: two int64 arrays of n^2/2
    feat = _dissimilarity_triangle(x, iu)
    # 1 - corrcoef of one-hot rows, in closed form: 0 within a class, c/(c-1) across (the
    # correlation of two different one-hot rows is -1/(c-1)). np.corrcoef gives the same up to
    # rounding, but its 1e-16 noise would break the many exact ties of the Spearman ranks
    # arbitrarily.
    across = y[iu[0]] != y[iu[1]]
    del iu
    if not np.all(np.isfinite(feat)):
        raise MetricError("parc: a feature row is constant after standardisation")
    rho = _spearman_with_binary(feat, across)
    if not np.isfinite(rho):
        raise MetricError("parc: Spearman correlation undefined (constant dissimilarities)")
    return float(100.0 * rho)
