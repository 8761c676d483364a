"""NCTI: Neural Collapse Transferability Index (Wang, Luo, Liu & Huang, ICCV 2023, "How Far
Pre-trained Models Are from Neural Collapse on the Target Dataset Informs their
Transferability").

A model transfers well when its target features are already close to neural collapse. Three
proxies, computed as in the authors' code:

1. features reduced by PCA to 64 dimensions; a linear discriminant (sklearn's
   ``LinearDiscriminantAnalysis``) fitted on them, with shrinkage
   ``max(exp(-sum of the 32 largest PCA variances), 1e-10)`` (``solver="eigen"``; at the
   floor, the unshrunk ``solver="svd"``);
2. ``seli``: the nuclear norm of the centred discriminant features (C - 1 columns): the
   feature geometry's distance to the simplex-encoded-label-interpolation optimum (higher is
   closer);
3. ``ncc``: the mean posterior of the true class under that classifier (nearest-centre
   classification in the whitened space);
4. ``vc``: ``log sum_c ||P_c||_*``, the nuclear norms of the classwise posterior matrices,
   within-class variability (lower is more collapsed).

The authors then min-max normalise each of the three *across the models of the zoo* and rank by
``seli' + ncc' - vc'``. That needs the whole zoo: :func:`combine` does it, and
``zoopick.selection.rank.rank_zoo`` applies it (via the registry's ``zoo_combine``), so a ranked
zoo gets the paper's scores. Scored alone (``zoopick.selection.score``, or one model at a time),
a model has nothing to be normalised against; its single-model value is the ``ncc`` term, a
documented stand-in. Deviations: exact PCA always (sklearn's default solver, as the authors
call it, turns randomized and unseeded above 500 features or samples, so the score varied
from run to run) and
PCA to ``min(64, D, n)`` when there are fewer than 64 features or samples, keeping only the
components that carry variance (``nleep.signal_components``: with n <= 64 samples, or features
of lower rank, the rest is rounding noise that the discriminant would whiten into a score).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from sklearn.decomposition import PCA
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

from zoopick.selection.metrics.leep import target_labels
from zoopick.selection.metrics.nleep import pca_solver, signal_components
from zoopick.selection.metrics.registry import MetricError, register

PCA_DIM = 64
SHRINK_COMPONENTS = 32


def ncti_components(labels: np.ndarray, features: np.ndarray) -> tuple[float, float, float]:
    """``(seli, ncc, vc)`` of one model, as the authors' ``NCTI_Score`` returns them."""
    y, c = target_labels(labels, "ncti")
    n, d = features.shape
    if not np.any(features.var(axis=0) > 0):
        raise MetricError("ncti: features have zero variance")
    pca = PCA(n_components=min(PCA_DIM, d, n), svd_solver=pca_solver(n, d))
    x = signal_components(pca.fit_transform(features), pca.explained_variance_)
    shrink = max(float(np.exp(-pca.explained_variance_[:SHRINK_COMPONENTS].sum())), 1e-10)
    if shrink == 1e-10:
        clf = LinearDiscriminantAnalysis(solver="svd")
    else:
        clf = LinearDiscriminantAnalysis(solver="eigen", shrinkage=shrink)
    try:
        low = clf.fit_transform(x, y)
        prob = clf.predict_proba(x)
    except (ValueError, np.linalg.LinAlgError) as e:
        raise MetricError(f"ncti: discriminant fit failed: {e}") from e
    low = low - low.mean(axis=0, keepdims=True)
    seli = float(np.linalg.norm(low, ord="nuc"))
    ncc = float(np.mean(prob[np.arange(n), y]))
    vc = float(np.log(sum(np.linalg.norm(prob[y == k], ord="nuc") for k in range(c))))
    return seli, ncc, vc


def combine(parts: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The authors' zoo-level NCTI: each of (seli, ncc, vc) min-max normalised over the models,
    score ``seli' + ncc' - vc'``. A component equal for every model contributes 0 (the
    authors' code would divide by zero)."""
    ids = list(parts)
    table = np.array([list(parts[i]) for i in ids], dtype=np.float64)  # (models, 3)
    lo, span = table.min(axis=0), np.ptp(table, axis=0)
    norm = np.where(span > 0, (table - lo) / np.where(span > 0, span, 1.0), 0.0)
    total = norm[:, 0] + norm[:, 1] - norm[:, 2]
    return {i: float(v) for i, v in zip(ids, total, strict=True)}


@register("ncti", needs={"features"}, zoo_combine=combine, parts=ncti_components)
def ncti(*, labels: np.ndarray, features: np.ndarray) -> float:
    """NCTI (Wang et al. 2023): neural-collapse proxies of LDA on PCA-64 features, over the zoo.

    SELI nuclear norm, NCC posterior and class variability, each min-max normalised over the
    models of the zoo.

    Ranked as a zoo (``rank_zoo``) it is the paper's ``seli' + ncc' - vc'``; scored alone it
    is the ``ncc`` term (nothing to normalise against). Higher is better."""
    return ncti_components(labels, features)[1]
