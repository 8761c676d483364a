"""Tests for selection/metrics/sms.py: SMS, I-SMS and SMS+.

SMS is checked against a plain per-pair computation with scipy's multivariate normal densities;
SMS+ against a plain loop re-implementation of its documented formulas; I-SMS against SMS on the
projected / subsampled inputs it documents.
"""

from __future__ import annotations

import warnings
from itertools import combinations

import numpy as np
import pytest
from scipy.stats import multivariate_normal

import zoopick.selection as selection
from zoopick.selection.metrics import sms as sms_mod
from zoopick.selection.metrics.registry import MetricError

# ---------------------------------------------------------------- plain reference versions


def plain_sms(labels: np.ndarray, logits: np.ndarray, temperature: float = 2.0) -> float:
    """SMS as the paper states it: densities, ratios, per pair, nothing clever."""
    e = np.exp(logits / temperature)
    p = e / e.sum(axis=1, keepdims=True)
    d = p.shape[1]
    gauss = {}
    for c in np.unique(labels):
        xc = p[labels == c]
        if len(xc) < 2:
            continue
        mu = xc.mean(axis=0)
        cov = (xc - mu).T @ (xc - mu) / len(xc) + 1e-6 * np.eye(d)
        gauss[c] = multivariate_normal(mu, cov)
    pair_scores = []
    for i, j in combinations(sorted(gauss), 2):
        gi, gj = gauss[i], gauss[j]
        r_i = gi.pdf(gi.mean) / (gi.pdf(gi.mean) + gj.pdf(gi.mean))
        r_j = gj.pdf(gj.mean) / (gj.pdf(gj.mean) + gi.pdf(gj.mean))
        pair_scores.append(r_i + r_j - 1)
    return float(np.mean(pair_scores))


def plain_sms_plus(labels: np.ndarray, logits: np.ndarray, dim: int = 25) -> float:
    """SMS+ from its docstring, with explicit loops, inverses and an SVD."""
    n = len(labels)
    z = logits - logits.mean(axis=1, keepdims=True)
    z = z - z.mean(axis=0)
    _, s, vt = np.linalg.svd(z, full_matrices=False)
    var = s**2 / n
    keep = [k for k in range(min(dim, len(var), n // 2)) if var[k] > var[0] * 1e-10]
    x = z @ vt[keep].T / np.sqrt(var[keep])
    m = x.shape[1]
    classes = np.unique(labels)
    stats = {}
    pooled = np.zeros((m, m))
    for c in classes:
        xc = x[labels == c]
        mu = xc.mean(axis=0)
        sc = (xc - mu).T @ (xc - mu) / len(xc)
        stats[c] = (len(xc), mu, sc)
        pooled += len(xc) * sc / n
    # OAS (Chen et al. 2010, eq. 23) with n - C degrees of freedom
    dof = n - len(classes)
    tr, tr2 = np.trace(pooled), np.trace(pooled @ pooled)
    rho = min(1.0, ((1 - 2 / m) * tr2 + tr**2) / ((dof + 1 - 2 / m) * (tr2 - tr**2 / m)))
    pooled = (1 - rho) * pooled + rho * tr / m * np.eye(m)
    covs = {
        c: (nc * sc + m * pooled) / (nc - 1 + m) + 1e-6 * np.eye(m)
        for c, (nc, _, sc) in stats.items()
    }
    total, weights = 0.0, 0.0
    for i, j in combinations(classes, 2):
        (ni, mi, _), (nj, mj, _) = stats[i], stats[j]
        sbar = (covs[i] + covs[j]) / 2
        inv = np.linalg.inv(sbar)
        q = (mi - mj) @ inv @ (mi - mj) - np.trace(inv @ (covs[i] / ni + covs[j] / nj))
        dist = max(q, 0) / 8
        w = np.sqrt(ni * nj)
        total += w * np.exp(-dist)
        weights += w
    return float(-np.log(total / weights))


# ---------------------------------------------------------------- data


def make_logits(rng, labels, n_out, strength=2.0, noise=1.0):
    """Logits with class structure: a random per-class offset plus isotropic noise."""
    centres = rng.standard_normal((labels.max() + 1, n_out)) * strength
    return centres[labels] + noise * rng.standard_normal((labels.size, n_out))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---------------------------------------------------------------- SMS


@pytest.mark.parametrize("sizes", [[15, 15, 15, 15], [5, 22, 9, 24]])
def test_sms_matches_plain_scipy_densities(rng, sizes):
    labels = np.repeat(np.arange(4), sizes)
    logits = make_logits(rng, labels, 5, strength=1.0)
    got = selection.score("sms", labels=labels, logits=logits)
    assert got == pytest.approx(plain_sms(labels, logits), rel=1e-6)
    assert got == sms_mod.sms(labels=labels, logits=logits)


def test_sms_temperature_option(rng):
    labels = np.repeat(np.arange(3), 12)
    logits = make_logits(rng, labels, 4, strength=1.0)
    got = selection.score("sms", labels=labels, logits=logits, temperature=0.7)
    assert got == pytest.approx(plain_sms(labels, logits, temperature=0.7), rel=1e-6)
    with pytest.raises(MetricError, match="temperature"):
        selection.score("sms", labels=labels, logits=logits, temperature=0.0)


def test_sms_hand_computed_two_classes():
    # 1 output -> every soft label is exactly 1: equal Gaussians, r = 1/2, S = 0.
    labels = np.array([0, 0, 1, 1])
    assert selection.score("sms", labels=labels, logits=np.arange(4.0)[:, None]) == 0.0


def test_sms_skips_singleton_classes_with_warning(rng):
    labels = np.array([0] * 10 + [1] * 10 + [2] + [3] * 10)
    logits = make_logits(rng, labels, 5)
    with pytest.warns(UserWarning, match=r"leaving out class\(es\) \[2\]"):
        got = selection.score("sms", labels=labels, logits=logits)
    keep = labels != 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = selection.score("sms", labels=labels[keep], logits=logits[keep])
    assert got == want
    assert got == pytest.approx(plain_sms(labels, logits), rel=1e-6)


def test_sms_bad_inputs(rng):
    labels = np.array([0] * 10 + [1])
    logits = make_logits(rng, labels, 5)
    with pytest.warns(UserWarning), pytest.raises(MetricError, match="at least 2 classes"):
        selection.score("sms", labels=labels, logits=logits)
    with pytest.raises(MetricError, match="at least 2 classes"):
        selection.score("isms", labels=np.zeros(8, dtype=int), logits=np.ones((8, 3)))
    bad = make_logits(rng, np.repeat([0, 1], 5), 3)
    bad[3, 1] = np.nan
    for name in ("sms", "isms", "sms+"):
        with pytest.raises(MetricError, match="NaN or infinite"):
            selection.score(name, labels=np.repeat([0, 1], 5), logits=bad)
    with pytest.raises(MetricError, match="needs logits"):
        selection.score("sms", labels=np.repeat([0, 1], 5))


def test_sms_cholesky_failure_is_a_metric_error():
    # With soft labels the 1e-6 jitter always rescues the covariance; without it, a class of
    # identical rows has an all-zero covariance, which Cholesky must reject by name.
    x = np.array([[0.2, 0.8], [0.2, 0.8], [0.0, 1.0], [1.0, 0.0]])
    groups = [np.array([0, 1]), np.array([2, 3])]
    with pytest.raises(MetricError, match="covariance of class 7 is not positive definite"):
        sms_mod._log_density_table(x, np.array([7, 9]), groups, ridge=0.0)


def test_registry_entries():
    for name in ("sms", "isms", "sms+"):
        assert name in selection.available()
        assert selection.needs(name) == frozenset({"logits"})
    spec = selection.metrics.get("isms")
    assert spec.options == ["temperature", "dim", "seed", "sample_fraction"]
    assert selection.metrics.get("sms+").options == ["dim", "seed"]
    assert selection.metrics.get("sms").options == ["temperature"]


# ---------------------------------------------------------------- I-SMS


@pytest.mark.parametrize("n_out", [5, 25])
def test_isms_equals_sms_up_to_25_outputs(rng, n_out):
    labels = np.repeat(np.arange(4), 40)
    logits = make_logits(rng, labels, n_out, strength=0.1)
    got = selection.score("isms", labels=labels, logits=logits)
    assert got == selection.score("sms", labels=labels, logits=logits)
    assert 0.0 < got < 0.99  # informative, not saturated


def test_isms_projection_same_map_per_output_count(rng):
    w1, b1 = sms_mod.isms_projection(40)
    assert w1.shape == (40, 25) and b1.shape == (25,)
    w_again, b_again = sms_mod.isms_projection(40, dim=25, seed=0)
    np.testing.assert_array_equal(w1, w_again)
    np.testing.assert_array_equal(b1, b_again)
    assert not np.allclose(w1, sms_mod.isms_projection(40, seed=1)[0])
    assert sms_mod.isms_projection(41)[0].shape == (41, 25)
    # two different models with 40 outputs are scored through that same layer
    labels = np.repeat(np.arange(4), 40)
    scores = []
    for _ in range(2):
        logits = make_logits(rng, labels, 40, strength=0.1)
        got = selection.score("isms", labels=labels, logits=logits)
        assert got == selection.score("isms", labels=labels, logits=logits)  # deterministic
        assert got == selection.score("sms", labels=labels, logits=logits @ w1 + b1)
        assert got != selection.score("sms", labels=labels, logits=logits)
        scores.append(got)
    assert scores[0] != scores[1] and max(scores) < 0.99
    ws, bs = sms_mod.isms_projection(40, dim=7, seed=3)
    assert selection.score("isms", labels=labels, logits=logits, dim=7, seed=3) == (
        selection.score("sms", labels=labels, logits=logits @ ws + bs)
    )


@pytest.mark.parametrize("n_out", [100, 1000])
def test_isms_projection_matches_torch_linear_default_init(n_out):
    """The authors append an untrained ``torch.nn.Linear(C_s, 25)``: compare the distribution
    of our map with torch's own default initialisation (independent draws), by range, moments
    and a two-sample Kolmogorov-Smirnov test, and the projected-logit scale they produce."""
    torch = pytest.importorskip("torch")
    from scipy.stats import ks_2samp

    torch.manual_seed(0)
    layer = torch.nn.Linear(n_out, 25)
    tw = layer.weight.detach().numpy().astype(np.float64).T
    tb = layer.bias.detach().numpy().astype(np.float64)
    w, b = sms_mod.isms_projection(n_out)
    bound = 1 / np.sqrt(n_out)
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    assert np.abs(tw).max() <= bound * (1 + 1e-6)
    assert np.std(w) == pytest.approx(np.std(tw), rel=0.05)
    assert np.std(w) == pytest.approx(bound / np.sqrt(3), rel=0.05)  # uniform(-a, a)
    assert ks_2samp(w.ravel(), tw.ravel()).pvalue > 1e-3
    assert ks_2samp(b, tb).pvalue > 1e-3
    # projected logits have the same scale through either layer (unit-variance logits in)
    z = np.random.default_rng(1).standard_normal((400, n_out))
    assert np.std(z @ w + b) == pytest.approx(np.std(z @ tw + tb), rel=0.1)
    assert np.std(z @ w + b) == pytest.approx(1 / np.sqrt(3), rel=0.1)


def test_isms_does_not_saturate_with_a_large_head(rng):
    """With the authors' layer scale, I-SMS of moderately informative 1,000-output logits stays
    below 1 (the old N(0, 1/dim) map made the logits 11x too large and I-SMS read 1.0)."""
    labels = np.repeat(np.arange(5), 30)
    logits = make_logits(rng, labels, 1000, strength=0.03, noise=1.0)
    got = selection.score("isms", labels=labels, logits=logits)
    assert 0.0 < got < 0.99
    w, _ = sms_mod.isms_projection(1000)
    old = rng.standard_normal(w.shape) / np.sqrt(25)  # the former map, for contrast
    assert selection.score("sms", labels=labels, logits=logits @ old) > got


def test_stratified_subsample(rng):
    labels = np.repeat(np.arange(4), [40, 10, 2, 1])
    rows = sms_mod.stratified_subsample(labels, 0.25, seed=0)
    counts = np.bincount(labels[rows], minlength=4)
    assert counts.tolist() == [10, 3, 2, 1]  # ceil(f n_c), but >= min(2, n_c)
    assert np.all(np.diff(rows) > 0)
    np.testing.assert_array_equal(rows, sms_mod.stratified_subsample(labels, 0.25, seed=0))
    assert not np.array_equal(rows, sms_mod.stratified_subsample(labels, 0.25, seed=1))
    np.testing.assert_array_equal(sms_mod.stratified_subsample(labels, 1.0), np.arange(53))
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(MetricError, match="sample_fraction"):
            sms_mod.stratified_subsample(labels, bad)


def test_isms_sample_fraction(rng):
    labels = np.repeat(np.arange(3), [30, 20, 12])
    logits = make_logits(rng, labels, 50, strength=0.2)
    opts = {"dim": 4, "seed": 2}
    got = selection.score("isms", labels=labels, logits=logits, sample_fraction=0.5, **opts)
    rows = sms_mod.stratified_subsample(labels, 0.5, seed=2)
    w, b = sms_mod.isms_projection(50, dim=4, seed=2)
    assert got == selection.score("sms", labels=labels[rows], logits=logits[rows] @ w + b)
    assert abs(got - selection.score("isms", labels=labels, logits=logits, **opts)) > 1e-6
    with pytest.raises(MetricError, match="sample_fraction"):
        selection.score("isms", labels=labels, logits=logits, sample_fraction=2.0)
    with pytest.raises(MetricError, match="dim"):
        selection.score("isms", labels=labels, logits=logits, dim=0)


# ---------------------------------------------------------------- SMS+


@pytest.mark.parametrize(
    ("sizes", "n_out", "dim"),
    [([15, 15, 15, 15], 5, 25), ([3, 22, 1, 9], 12, 25), ([20, 20, 20], 60, 6)],
)
def test_sms_plus_matches_plain_implementation(rng, sizes, n_out, dim):
    labels = np.repeat(np.arange(len(sizes)), sizes)
    logits = make_logits(rng, labels, n_out, strength=0.7)
    got = selection.score("sms+", labels=labels, logits=logits, dim=dim)
    assert got == pytest.approx(plain_sms_plus(labels, logits, dim=dim), rel=1e-6)


def test_sms_plus_does_not_saturate(rng):
    """(a) Perfectly separated soft labels: SMS ties both models at 1.0, SMS+ orders by margin."""
    labels = np.repeat(np.arange(4), 20)
    noise = rng.standard_normal((labels.size, 8))
    onehot = np.eye(8)[labels * 2]  # target class c -> source class 2c
    narrow, wide = 20 * onehot + noise, 40 * onehot + noise
    assert selection.score("sms", labels=labels, logits=narrow) == 1.0
    assert selection.score("sms", labels=labels, logits=wide) == 1.0
    s_narrow = selection.score("sms+", labels=labels, logits=narrow)
    s_wide = selection.score("sms+", labels=labels, logits=wide)
    assert s_wide > s_narrow + 1.0
    assert np.isfinite(s_wide)


def test_sms_plus_separable_beats_shuffled(rng):
    """(b) Labels the logits separate score far above the same logits with shuffled labels."""
    labels = np.repeat(np.arange(5), 16)
    logits = make_logits(rng, labels, 30, strength=0.6)
    good = selection.score("sms+", labels=labels, logits=logits)
    shuffled = [
        selection.score("sms+", labels=rng.permutation(labels), logits=logits) for _ in range(3)
    ]
    assert good > 1.0
    assert max(shuffled) < 0.2 * good


def test_sms_plus_small_classes(rng):
    """(c) Classes smaller than the soft-label dimension: SMS ties every model at 1.0, SMS+ tells
    a good model from a useless one."""
    labels = np.repeat(np.arange(5), 4)
    good = make_logits(rng, labels, 30, strength=1.0)
    useless = rng.standard_normal((labels.size, 30))
    assert selection.score("sms", labels=labels, logits=good) == 1.0
    assert selection.score("sms", labels=labels, logits=useless) == 1.0
    s_good = selection.score("sms+", labels=labels, logits=good)
    s_bad = selection.score("sms+", labels=labels, logits=useless)
    assert s_good > 1.0
    assert s_bad < 0.5
    assert s_good > 3 * s_bad


def test_sms_plus_invariances_and_singletons(rng):
    labels = np.array([0] * 12 + [1] * 9 + [2] + [3] * 7)
    logits = make_logits(rng, labels, 10, strength=0.8)
    base = selection.score("sms+", labels=labels, logits=logits)  # singleton kept, no warning
    # softmax ignores a per-row shift; SMS+ ignores the logits' scale (the temperature)
    shifted = logits + rng.standard_normal((labels.size, 1)) * 5
    assert selection.score("sms+", labels=labels, logits=shifted) == pytest.approx(base, rel=1e-8)
    assert selection.score("sms+", labels=labels, logits=7.5 * logits) == pytest.approx(
        base, rel=1e-8
    )
    # constant logits: nothing separates
    assert selection.score("sms+", labels=labels, logits=np.ones((labels.size, 4))) == 0.0
    with pytest.raises(MetricError, match="at least 2 classes"):
        selection.score("sms+", labels=np.zeros(5, dtype=int), logits=logits[:5])


def test_sms_plus_randomized_projection_close_to_exact(rng, monkeypatch):
    labels = np.repeat(np.arange(4), 25)
    basis = rng.standard_normal((6, 80))
    logits = make_logits(rng, labels, 6, strength=1.5) @ basis + 0.01 * rng.standard_normal(
        (100, 80)
    )
    exact = selection.score("sms+", labels=labels, logits=logits, dim=5)
    monkeypatch.setattr(sms_mod, "_EXACT_PCA_MAX_OUTPUTS", 10)
    randomized = selection.score("sms+", labels=labels, logits=logits, dim=5)
    assert randomized == pytest.approx(exact, rel=1e-4)


def test_batched_and_looped_density_tables_agree(monkeypatch):
    """Small d takes the stacked (batched LAPACK) path; large d loops one class at a time.
    Both must give the same table."""
    from zoopick.selection.metrics import sms as sms_module

    rng = np.random.default_rng(3)
    x = rng.random((240, 7))
    y = rng.integers(0, 5, 240)
    classes, groups = sms_module._class_groups(y, min_size=2, metric="test")
    batched = sms_module._log_density_table(x, classes, groups, 1e-6)
    monkeypatch.setattr(sms_module, "_BATCH_MAX_ELEMENTS", 0)
    looped = sms_module._log_density_table(x, classes, groups, 1e-6)
    np.testing.assert_allclose(batched, looped, rtol=1e-9, atol=1e-9)
