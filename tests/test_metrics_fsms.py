"""Tests for selection/metrics/fsms.py: FSMS against a plain loop re-implementation of its
documented formulas (explicit SVD, inverses, OAS by the paper's equation, the half splits drawn
as documented), its noise floor at 10 samples a class (issue 20), its head-size invariance
(defect 4 of issue 11) and its behaviour on degenerate inputs."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest

import zoopick.selection as selection


def plain_oas(scatter: np.ndarray, dof: float) -> np.ndarray:
    """Chen et al. 2010, eq. 23."""
    m = scatter.shape[0]
    tr, tr2 = np.trace(scatter), np.trace(scatter @ scatter)
    rho = min(1.0, ((1 - 2 / m) * tr2 + tr**2) / ((dof + 1 - 2 / m) * (tr2 - tr**2 / m)))
    return (1 - rho) * scatter + rho * tr / m * np.eye(m)


def bound_score(dist: dict, sizes: dict) -> float:
    """-log of the class-size-weighted mean of exp(-D_ij) over pairs, floored at 0."""
    w = {(i, j): np.sqrt(sizes[i] * sizes[j]) for i, j in dist}
    total = sum(w[p] * np.exp(-d) for p, d in dist.items())
    return float(max(0.0, -np.log(total / sum(w.values()))))


def plain_plugin(labels: np.ndarray, x: np.ndarray) -> float:
    """The plug-in form (splits=0): full-sample means, noise term subtracted, q floored."""
    n, m = x.shape
    classes = np.unique(labels)
    stats, pooled = {}, np.zeros((m, m))
    for c in classes:
        xc = x[labels == c]
        mu = xc.mean(axis=0)
        sc = (xc - mu).T @ (xc - mu) / len(xc)
        stats[c] = (len(xc), mu, sc)
        pooled += len(xc) * sc / n
    pooled = plain_oas(pooled, n - len(classes))
    covs = {
        c: (nc * sc + m * pooled) / (nc - 1 + m) + 1e-6 * np.eye(m)
        for c, (nc, _, sc) in stats.items()
    }
    dist = {}
    for i, j in combinations(classes, 2):
        (ni, mi, _), (nj, mj, _) = stats[i], stats[j]
        inv = np.linalg.inv((covs[i] + covs[j]) / 2)
        q = (mi - mj) @ inv @ (mi - mj) - np.trace(inv @ (covs[i] / ni + covs[j] / nj))
        dist[i, j] = max(q, 0) / 8
    return bound_score(dist, {c: st[0] for c, st in stats.items()})


def plain_cross_fitted(labels: np.ndarray, x: np.ndarray, splits: int, seed: int) -> float:
    """The default form: per split, each class (>= 2 samples) in random halves, as fsms draws
    them (one uniform key per row, rows in class order; a class's n_c // 2 smallest keys make
    half A); covariances from the scatter within the halves; D_ij = mean over splits of
    (a_i - a_j)' Sbar^-1 (b_i - b_j) / 8, not floored."""
    m = x.shape[1]
    classes = [c for c in np.unique(labels) if np.sum(labels == c) >= 2]
    rows = {c: np.flatnonzero(labels == c) for c in classes}
    total = sum(r.size for r in rows.values())
    rng = np.random.default_rng((seed, 20))
    q = {pair: 0.0 for pair in combinations(classes, 2)}
    for _ in range(splits):
        keys, start, halves = rng.random(total), 0, {}
        for c in classes:
            r = rows[c]
            shuffled = r[np.argsort(keys[start : start + r.size])]
            start += r.size
            halves[c] = (x[shuffled[: r.size // 2]], x[shuffled[r.size // 2 :]])
        within = {
            c: sum((h - h.mean(axis=0)).T @ (h - h.mean(axis=0)) for h in halves[c])
            for c in classes
        }
        dof = total - 2 * len(classes)
        if dof > 0:
            pooled = plain_oas(sum(within.values()) / dof, dof)
        else:  # only 2-sample classes: the total's mean variance
            pooled = np.eye(m) * np.mean([x[r] @ x[r] for c in classes for r in rows[c]]) / m
        covs = {
            c: (within[c] + m * pooled) / (rows[c].size - 2 + m) + 1e-6 * np.eye(m) for c in classes
        }
        for i, j in q:
            inv = np.linalg.inv((covs[i] + covs[j]) / 2)
            da = halves[i][0].mean(axis=0) - halves[j][0].mean(axis=0)
            db = halves[i][1].mean(axis=0) - halves[j][1].mean(axis=0)
            q[i, j] += da @ inv @ db
    dist = {p: v / splits / 8 for p, v in q.items()}
    return bound_score(dist, {c: rows[c].size for c in classes})


def plain_fsms(
    labels: np.ndarray,
    features: np.ndarray,
    dim: int = 64,
    whiten: bool = False,
    splits: int = 8,
    seed: int = 0,
) -> float:
    n = len(labels)
    z = features - features.mean(axis=0)
    _, s, vt = np.linalg.svd(z, full_matrices=False)
    var = s**2 / n
    keep = [k for k in range(min(dim, len(var), n // 2)) if var[k] > var[0] * 1e-10]
    x = z @ vt[keep].T / np.sqrt(var[keep] if whiten else var[keep].mean())
    if splits == 0:
        return plain_plugin(labels, x)
    return plain_cross_fitted(labels, x, splits, seed)


def class_features(rng, labels, d, strength=0.6, extra_noise=0):
    f = rng.standard_normal((labels.max() + 1, d))[labels] * strength
    f = f + rng.standard_normal((labels.size, d))
    if extra_noise:
        f = np.hstack([f, rng.standard_normal((labels.size, extra_noise))])
    return f


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("splits", [8, 0])
@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize(
    ("sizes", "d", "dim"),
    [
        ([30, 30, 30, 30], 20, 64),
        ([5, 40, 1, 14], 100, 64),
        ([25, 25, 25], 300, 8),
        ([2] * 12, 20, 8),
    ],
)
def test_fsms_matches_plain_implementation(rng, sizes, d, dim, whiten, splits):
    labels = np.repeat(np.arange(len(sizes)), sizes)
    f = class_features(rng, labels, d) * rng.uniform(0.2, 3.0, size=d)  # an uneven spectrum
    kw = {"labels": labels, "features": f, "dim": dim, "whiten": whiten, "splits": splits}
    if splits and min(sizes) < 2:
        with pytest.warns(UserWarning, match="leaving out class"):
            got = selection.score("fsms", **kw)
    else:
        got = selection.score("fsms", **kw)
    assert got > 0.1  # the classes separate: the comparison is not of two zeros
    assert got == pytest.approx(plain_fsms(labels, f, dim, whiten, splits), rel=1e-6)


def test_fsms_null_is_zero_at_ten_a_class():
    """Issue 20: labels that carry no information about 64-dimensional features, 20 classes
    of 10. The plug-in form scored 0.2-0.7 here (its subtracted noise term, computed from the
    covariances it divides by, falls short of the noise), more for a steeper spectrum; the
    cross-fitted form scores ~0 for either spectrum."""
    for alpha in (0.0, 1.0):
        new, old = [], []
        for seed in range(4):
            rng = np.random.default_rng(seed)
            labels = rng.permutation(np.repeat(np.arange(20), 10))
            f = rng.standard_normal((200, 64)) * np.arange(1, 65) ** (-alpha / 2)
            new.append(selection.score("fsms", labels=labels, features=f))
            old.append(selection.score("fsms", labels=labels, features=f, splits=0))
        assert np.mean(new) < 0.04 and max(new) < 0.12
        assert np.mean(old) > 0.2  # the floor the fix removes


def separated(rng, labels, strength, alpha, d=64, k=8):
    """Features whose first k of d coordinates carry class means ``strength`` noise sd apart
    per coordinate, then scaled by a power-law spectrum j^(-alpha/2) (signal and noise
    alike, so the separation is the same for every alpha)."""
    f = rng.standard_normal((labels.size, d))
    f[:, :k] += rng.standard_normal((labels.max() + 1, k))[labels] * strength
    return f * np.arange(1, d + 1) ** (-alpha / 2)


def test_fsms_ranks_known_separations_at_ten_a_class():
    """Two feature sets, 20 classes of 10: A's class means 0.4 noise sd apart per signal
    coordinate (flat spectrum), B's 0.2 (steep spectrum, the signal in its top directions), so
    A separates better by any measure. The corrected form ranks A first on every draw; the
    plug-in form's floor, higher for B's spectrum, reverses some of them."""
    right, old_right = [], []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        labels = np.repeat(np.arange(20), 10)
        a, b = separated(rng, labels, 0.4, 0.0), separated(rng, labels, 0.2, 1.0)
        right.append(
            selection.score("fsms", labels=labels, features=a)
            > selection.score("fsms", labels=labels, features=b) + 0.1
        )
        old_right.append(
            selection.score("fsms", labels=labels, features=a, splits=0)
            > selection.score("fsms", labels=labels, features=b, splits=0)
        )
    assert all(right)
    assert not all(old_right)  # the confound the test guards against


def test_fsms_keeps_the_spectrum():
    """Issue 11, second round: the same class signal scores lower when it sits in directions
    with 1e-2 of the variance of pure-noise directions (a fresh linear head trained by
    gradient descent, and LogME's isotropic prior, barely use it); the whitened first-round
    form cannot tell the two apart."""
    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(4), 40)
    signal = class_features(rng, labels, 4, strength=1.0)
    noise = rng.standard_normal((160, 12))
    loud, quiet = np.hstack([signal, noise]), np.hstack([1e-2 * signal, noise])

    def score(f, **kw):
        return selection.score("fsms", labels=labels, features=f, **kw)

    assert score(loud) > 0.5
    assert score(quiet) < 0.5 * score(loud)
    assert score(quiet, whiten=True) == pytest.approx(score(loud, whiten=True), rel=1e-6)


def test_fsms_does_not_move_with_head_size(rng):
    """Defect 4: identical features, random heads of 4/10/25/100/1000 outputs. The shipped
    recommended metric must give one score; sms+ (which reads the head) does not."""
    labels = np.repeat(np.arange(6), 40)
    f = class_features(rng, labels, 48)
    fsms, smsp = set(), []
    for heads in (4, 10, 25, 100, 1000):
        logits = f @ rng.standard_normal((48, heads)) / np.sqrt(48)
        fsms.add(selection.score("fsms", labels=labels, features=f, logits=logits))
        smsp.append(selection.score("sms+", labels=labels, logits=logits))
    assert len(fsms) == 1
    assert max(smsp) - min(smsp) > 0.1 * max(smsp)  # the confound the test guards against


@pytest.mark.parametrize("whiten", [False, True])
def test_fsms_scale_rotation_and_noise(rng, whiten):
    """Noise appended to features of the common dimension (64) never raises the score."""
    labels = np.repeat(np.arange(5), 40)
    f = class_features(rng, labels, 64, strength=0.3)
    base = selection.score("fsms", labels=labels, features=f, whiten=whiten)
    assert base > 0.5
    q, _ = np.linalg.qr(rng.standard_normal((64, 64)))
    moved = selection.score("fsms", labels=labels, features=3.0 * f @ q + 5.0, whiten=whiten)
    assert moved == pytest.approx(base, rel=1e-8)
    padded = [
        selection.score(
            "fsms",
            labels=labels,
            features=np.hstack([f, rng.standard_normal((200, k))]),
            whiten=whiten,
        )
        for k in (48, 448, 1216)
    ]
    assert base >= padded[0] >= padded[1] >= padded[2]
    shuffled = selection.score("fsms", labels=rng.permutation(labels), features=f, whiten=whiten)
    assert shuffled < 0.2 * base


def test_fsms_degenerate_inputs(rng):
    labels = np.repeat(np.arange(3), 10)
    # a collapsed model (one feature vector for every image) is refused by the registry, for
    # every metric, rather than scored on rounding noise
    with pytest.raises(selection.MetricError, match="collapsed"):
        selection.score("fsms", labels=labels, features=np.ones((30, 7)))
    # mostly-constant features (990 of 1,000 columns constant): the informative ones decide
    f = class_features(rng, labels, 10)
    wide = np.hstack([f, np.full((30, 990), 2.0)])
    assert selection.score("fsms", labels=labels, features=wide) == pytest.approx(
        selection.score("fsms", labels=labels, features=f), rel=1e-8
    )


def test_fsms_registry_entry():
    assert "fsms" in selection.available()
    assert selection.needs("fsms") == frozenset({"features"})
    assert selection.metrics.get("fsms").options == ["dim", "seed", "whiten", "splits"]
    labels = np.repeat(np.arange(2), 5)
    with pytest.raises(selection.MetricError, match="whiten"):
        selection.score("fsms", labels=labels, features=np.eye(10), whiten=1)
    for bad in (-1, True, 1.5):
        with pytest.raises(selection.MetricError, match="splits"):
            selection.score("fsms", labels=labels, features=np.eye(10), splits=bad)
    with (
        pytest.warns(UserWarning, match="leaving out class"),
        pytest.raises(selection.MetricError, match="at least 2 classes with >= 2"),
    ):
        selection.score("fsms", labels=np.array([0, 1, 1]), features=np.eye(3))
