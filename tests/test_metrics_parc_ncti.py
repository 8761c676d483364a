"""Tests for the PARC and NCTI baselines: each against a plain re-computation of the authors'
published procedure (loops, explicit SVDs, scipy's Pearson on ranks) and hand cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats
from sklearn.decomposition import PCA
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

import zoopick.selection as selection
from zoopick.selection.metrics import registry
from zoopick.selection.metrics.ncti import combine, ncti_components
from zoopick.selection.metrics.registry import MetricError
from zoopick.selection.rank import ModelResult, combine_zoo


def blobs(n_per=20, c=4, d=40, sep=0.6, seed=0):
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(c), n_per)
    return rng.standard_normal((c, d))[y] * sep + rng.standard_normal((y.size, d)), y


# ---------------------------------------------------------------- PARC


def plain_parc(f, y, dim):
    """PARC by its definition, pair by pair: PCA, standardise, 1 - Pearson between samples for
    features and one-hot labels, Spearman (Pearson of ranks) of the two pair lists, x100."""
    if dim is not None:  # the authors' PCA settings
        pca = PCA(n_components=dim, svd_solver="randomized", random_state=1919, iterated_power=1)
        f = pca.fit_transform(f)
    x = f
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    onehot = np.eye(y.max() + 1)[y]
    feat, lab = [], []
    for i, j in itertools.combinations(range(len(y)), 2):
        feat.append(1 - stats.pearsonr(x[i], x[j]).statistic)
        lab.append(1 - stats.pearsonr(onehot[i], onehot[j]).statistic)
    return 100 * stats.pearsonr(stats.rankdata(feat), stats.rankdata(lab)).statistic


@pytest.mark.parametrize("dim", [20, 8, None])
def test_parc_matches_pairwise_definition(dim):
    f, y = blobs(n_per=9, c=3, d=40)
    got = selection.score("parc", labels=y, features=f, dim=dim)
    assert got == pytest.approx(plain_parc(f, y, dim), rel=1e-8)


def test_parc_orders_signal_over_noise_and_subsamples():
    f, y = blobs(n_per=30, c=4, d=50, sep=1.0)
    noise = np.random.default_rng(1).standard_normal(f.shape)
    good = selection.score("parc", labels=y, features=f)
    bad = selection.score("parc", labels=y, features=noise)
    assert good > 10 and abs(bad) < 5 and good > bad
    sub = selection.score("parc", labels=y, features=f, max_samples=60)  # 60 of 120 rows
    assert sub != good and sub > 10
    assert selection.score("parc", labels=y, features=f, max_samples=60) == sub  # seeded
    with pytest.raises(MetricError):
        selection.score("parc", labels=y, features=np.ones_like(f))


def _variants(f, y, seed=3):
    """The same data, edited in ways neither score's definition sees: a constant added to
    every feature, the rows in another order (labels with them), float32."""
    order = np.random.default_rng(seed).permutation(len(y))
    return [(f, y), (f + 10.0, y), (f[order], y[order]), (f.astype(np.float32), y)]


@pytest.mark.parametrize("case", ["few images", "low rank"])
def test_parc_and_ncti_ignore_directions_the_features_do_not_span(case):
    """Fewer images than the PCA keeps (30 for PARC's 32, 50 for NCTI's 64) or features of
    rank 20 in 128 columns: the PCA's last components are rounding noise (variance 1e-31),
    which PARC's standardisation and NCTI's whitening had blown up into the score; it moved
    with a feature offset, the row order and float32 input (PARC -3.2 to -1.2 and -5.3)."""
    rng = np.random.default_rng(0)
    if case == "few images":
        (fp, yp), (fn, yn) = blobs(n_per=10, c=3, d=128), blobs(n_per=5, c=10, d=128)
    else:
        basis = np.linalg.qr(rng.standard_normal((128, 20)))[0].T  # 20 orthonormal rows
        f, y = blobs(n_per=50, c=4, d=20, sep=1.0)
        (fp, yp), (fn, yn) = (f @ basis, y), (f @ basis, y)
    parcs = [selection.score("parc", labels=b, features=a) for a, b in _variants(fp, yp)]
    assert parcs == pytest.approx([parcs[0]] * 4, rel=1e-5, abs=1e-6), parcs
    parts = np.array(
        [registry.score_parts("ncti", labels=b, features=a) for a, b in _variants(fn, yn)]
    )
    np.testing.assert_allclose(parts, np.repeat(parts[:1], 4, axis=0), rtol=1e-5)


def test_parc_needs_features_that_vary_in_two_directions():
    f, y = blobs(n_per=10, c=3, d=1)
    line = f @ np.ones((1, 16))  # 16 columns, one direction
    with pytest.raises(MetricError, match="vary in at least 2 directions"):
        selection.score("parc", labels=y, features=line)


# ---------------------------------------------------------------- NCTI


def plain_ncti_components(f, y):
    """The authors' NCTI_Score steps, written out: PCA 64, shrinkage from the top-32 PCA
    variances, LDA, nuclear norms as sums of singular values, the NCC term as a loop."""
    c = y.max() + 1
    pca = PCA(n_components=min(64, *f.shape)).fit(f)
    x = pca.transform(f)
    shrink = max(np.exp(-np.sum(np.sort(pca.explained_variance_)[::-1][:32])), 1e-10)
    lda = (
        LinearDiscriminantAnalysis(solver="svd")
        if shrink == 1e-10
        else LinearDiscriminantAnalysis(solver="eigen", shrinkage=shrink)
    ).fit(x, y)
    low = lda.transform(x)
    low = low - low.mean(axis=0)
    seli = np.linalg.svd(low, compute_uv=False).sum()
    prob = lda.predict_proba(x)
    ncc = sum(prob[i, y[i]] for i in range(len(y))) / len(y)
    vc = np.log(sum(np.linalg.svd(prob[y == k], compute_uv=False).sum() for k in range(c)))
    return seli, ncc, vc


@pytest.mark.parametrize("scale", [0.05, 1.0])  # shrinkage active / at its floor
def test_ncti_components_match_authors_steps(scale):
    f, y = blobs(n_per=25, c=4, d=80, sep=0.5)
    got = ncti_components(y, f * scale)
    want = plain_ncti_components(f * scale, y)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert selection.score("ncti", labels=y, features=f * scale) == pytest.approx(got[1])


def test_ncti_is_deterministic_with_many_features():
    """Above 500 features sklearn's default PCA solver is randomized and unseeded: the same
    features gave other NCTI terms from run to run (seen on the transfer benchmark). The
    exact solver gives the same terms every time, equal to a full SVD's."""
    f, y = blobs(n_per=40, c=4, d=700, sep=0.5)
    first = ncti_components(y, f)
    assert all(ncti_components(y, f) == first for _ in range(3))
    exact = PCA(n_components=64, svd_solver="full").fit(f)
    x = exact.transform(f)
    shrink = max(np.exp(-np.sum(exact.explained_variance_[:32])), 1e-10)
    lda = LinearDiscriminantAnalysis(solver="eigen", shrinkage=shrink).fit(x, y)
    ncc = float(np.mean(lda.predict_proba(x)[np.arange(len(y)), y]))
    assert first[1] == pytest.approx(ncc, rel=1e-6)


def test_ncti_combine_hand_case():
    parts = {"a": (10.0, 0.9, 2.0), "b": (20.0, 0.5, 3.0), "c": (15.0, 0.7, 2.5)}
    # a: seli 0, ncc 1, vc 0 -> 1;  b: 1 + 0 - 1 = 0;  c: 0.5 + 0.5 - 0.5 = 0.5
    assert combine(parts) == pytest.approx({"a": 1.0, "b": 0.0, "c": 0.5})
    # a component equal for every model contributes nothing
    flat = {"a": (1.0, 0.9, 2.0), "b": (1.0, 0.5, 2.0)}
    assert combine(flat) == pytest.approx({"a": 1.0, "b": 0.0})


def test_rank_zoo_combination_replaces_single_model_scores():
    f, y = blobs(n_per=25, c=4, d=60, sep=0.8)
    rng = np.random.default_rng(3)
    feats = {"good": f, "noisy": f + 3 * rng.standard_normal(f.shape), "noise": rng.random(f.shape)}
    models = []
    for mid, x in feats.items():
        m = ModelResult(mid)
        m.scores["ncti"] = selection.score("ncti", labels=y, features=x)
        m.parts["ncti"] = registry.score_parts("ncti", labels=y, features=x)
        models.append(m)
    combine_zoo(models, ["ncti"])
    want = combine({m.id: ncti_components(y, feats[m.id]) for m in models})
    assert {m.id: m.scores["ncti"] for m in models} == pytest.approx(want)
    assert models[0].scores["ncti"] > models[2].scores["ncti"]
    with pytest.raises(MetricError, match="no parts"):
        registry.score_parts("logme", labels=y, features=f)


def test_registry_entries():
    for name in ("parc", "ncti"):
        assert name in selection.available()
        assert selection.needs(name) == frozenset({"features"})
    assert selection.metrics.get("parc").options == ["dim", "max_samples", "seed"]
    assert selection.metrics.get("ncti").options == []
    assert selection.metrics.get("ncti").zoo_combine is combine
