"""N-LEEP (Li et al., CVPR 2021, "Ranking Neural Checkpoints").

LEEP needs a source classifier head; N-LEEP replaces it by an unsupervised one fitted on the
target features themselves: reduce the features with PCA (keeping 80% of the variance), fit a
Gaussian mixture with ``components_per_class * C_t`` components, and use the mixture posteriors
``p(component | x)`` as the "source" distribution in LEEP. It thus scores any feature extractor,
with or without a classification head.

Cost: the mixture is the expensive part, O(n K d) per EM iteration with K = 5 C_t components in
d PCA dimensions (about 0.5 s of one core per iteration at n = 10,000, K = 500, d = 333, after
a k-means initialisation of similar cost). EM is therefore capped at ``max_iter`` = 50
iterations (sklearn's default is 100; fits at that size typically converge in 15-30); a fit that
has not converged by then is used as is, and sklearn's ConvergenceWarning is silenced on purpose.
The mixture covariance is diagonal by default (``covariance_type``); the SFDA authors' N-LEEP
code uses sklearn's default, "full", which costs O(d^2) more per component.
"""

from __future__ import annotations

import warnings

import numpy as np
from sklearn.decomposition import PCA
from sklearn.exceptions import ConvergenceWarning
from sklearn.mixture import GaussianMixture

from zoopick.selection.metrics.leep import leep_from_probs, target_labels
from zoopick.selection.metrics.registry import MetricError, register

_COVARIANCE_TYPES = ("full", "tied", "diag", "spherical")


def pca_solver(n: int, d: int) -> str:
    """``covariance_eigh`` (one D x D eigendecomposition) is much cheaper than a full SVD of the
    (n, D) matrix when n >= D and gives the same subspace; otherwise use the full SVD."""
    return "covariance_eigh" if n >= d else "full"


NULL_RTOL = 1e-10
"""A principal component whose variance is below this share of the largest is numerical
noise, not a direction of the features: what is left once the rank is used up (n samples
span at most n - 1 centred directions; 20-dimensional features in 128 columns span 20)."""


def signal_components(reduced: np.ndarray, variances: np.ndarray) -> np.ndarray:
    """The columns of a PCA's output that carry variance (:data:`NULL_RTOL`).

    Why: PARC standardises every component and NCTI's discriminant whitens them, so a null
    component of variance 1e-31 is blown up to weigh as much as a real one; its rounding noise
    then moved the score with a feature offset, the row order or float32 input."""
    keep = variances > NULL_RTOL * float(variances.max(initial=0.0))
    return reduced[:, keep]


@register("nleep", needs={"features"})
def nleep(
    *,
    labels: np.ndarray,
    features: np.ndarray,
    components_per_class: int = 5,
    covariance_type: str = "diag",
    max_iter: int = 50,
    seed: int = 0,
) -> float:
    """N-LEEP (Li et al. 2021): LEEP with Gaussian-mixture posteriors as the source head.

    PCA keeping 80% of the variance, a ``components_per_class * C_t``-component mixture
    (``covariance_type``, EM capped at ``max_iter``, initialised with ``seed``), then LEEP of
    its posteriors; higher is better."""
    y, c = target_labels(labels, "nleep")
    if covariance_type not in _COVARIANCE_TYPES:
        raise MetricError(f"nleep: covariance_type must be one of {_COVARIANCE_TYPES}")
    if components_per_class < 1 or max_iter < 1:
        raise MetricError("nleep: components_per_class and max_iter must be >= 1")
    n, d = features.shape
    if not np.any(features.var(axis=0) > 0):
        raise MetricError("nleep: features have zero variance")
    k = components_per_class * c
    if n < 2 * k:
        # A mixture needs a few points per component; keep at least two per component.
        k_new = max(c, n // 2)
        warnings.warn(
            f"nleep: {n} samples are too few for {k} mixture components; using {k_new}",
            RuntimeWarning,
            stacklevel=2,
        )
        k = k_new
    reduced = PCA(n_components=0.8, svd_solver=pca_solver(n, d)).fit_transform(features)
    gmm = GaussianMixture(
        n_components=k, covariance_type=covariance_type, max_iter=max_iter, random_state=seed
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        try:
            posteriors = gmm.fit(reduced).predict_proba(reduced)
        except ValueError as e:  # e.g. ill-defined covariance on degenerate data
            raise MetricError(f"nleep: Gaussian mixture fit failed: {e}") from e
    return leep_from_probs(posteriors, y, c)
