"""Tests for selection/metrics/fsms.py: FSMS against a plain loop re-implementation of its
documented formulas (explicit SVD, inverses, OAS by the paper's equation), its head-size
invariance (defect 4 of issue 11) and its behaviour on degenerate inputs."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest

import zoopick.selection as selection


def plain_fsms(
    labels: np.ndarray, features: np.ndarray, dim: int = 64, whiten: bool = False
) -> float:
    n = len(labels)
    z = features - features.mean(axis=0)
    _, s, vt = np.linalg.svd(z, full_matrices=False)
    var = s**2 / n
    keep = [k for k in range(min(dim, len(var), n // 2)) if var[k] > var[0] * 1e-10]
    x = z @ vt[keep].T / np.sqrt(var[keep] if whiten else var[keep].mean())
    m = x.shape[1]
    classes = np.unique(labels)
    stats, pooled = {}, np.zeros((m, m))
    for c in classes:
        xc = x[labels == c]
        mu = xc.mean(axis=0)
        sc = (xc - mu).T @ (xc - mu) / len(xc)
        stats[c] = (len(xc), mu, sc)
        pooled += len(xc) * sc / n
    dof = n - len(classes)  # OAS, Chen et al. 2010 eq. 23
    tr, tr2 = np.trace(pooled), np.trace(pooled @ pooled)
    rho = min(1.0, ((1 - 2 / m) * tr2 + tr**2) / ((dof + 1 - 2 / m) * (tr2 - tr**2 / m)))
    pooled = (1 - rho) * pooled + rho * tr / m * np.eye(m)
    covs = {
        c: (nc * sc + m * pooled) / (nc - 1 + m) + 1e-6 * np.eye(m)
        for c, (nc, _, sc) in stats.items()
    }
    total = weights = 0.0
    for i, j in combinations(classes, 2):
        (ni, mi, _), (nj, mj, _) = stats[i], stats[j]
        inv = np.linalg.inv((covs[i] + covs[j]) / 2)
        q = (mi - mj) @ inv @ (mi - mj) - np.trace(inv @ (covs[i] / ni + covs[j] / nj))
        w = np.sqrt(ni * nj)
        total += w * np.exp(-max(q, 0) / 8)
        weights += w
    return float(max(0.0, -np.log(total / weights)))


def class_features(rng, labels, d, strength=0.6, extra_noise=0):
    f = rng.standard_normal((labels.max() + 1, d))[labels] * strength
    f = f + rng.standard_normal((labels.size, d))
    if extra_noise:
        f = np.hstack([f, rng.standard_normal((labels.size, extra_noise))])
    return f


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize(
    ("sizes", "d", "dim"),
    [([30, 30, 30, 30], 20, 64), ([5, 40, 1, 14], 100, 64), ([25, 25, 25], 300, 8)],
)
def test_fsms_matches_plain_implementation(rng, sizes, d, dim, whiten):
    labels = np.repeat(np.arange(len(sizes)), sizes)
    f = class_features(rng, labels, d) * rng.uniform(0.2, 3.0, size=d)  # an uneven spectrum
    got = selection.score("fsms", labels=labels, features=f, dim=dim, whiten=whiten)
    assert got == pytest.approx(plain_fsms(labels, f, dim, whiten), rel=1e-6)


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
    assert selection.score("fsms", labels=labels, features=np.ones((30, 7))) == 0.0
    # mostly-constant features (990 of 1,000 columns constant): the informative ones decide
    f = class_features(rng, labels, 10)
    wide = np.hstack([f, np.full((30, 990), 2.0)])
    assert selection.score("fsms", labels=labels, features=wide) == pytest.approx(
        selection.score("fsms", labels=labels, features=f), rel=1e-8
    )


def test_fsms_registry_entry():
    assert "fsms" in selection.available()
    assert selection.needs("fsms") == frozenset({"features"})
    assert selection.metrics.get("fsms").options == ["dim", "seed", "whiten"]
    with pytest.raises(selection.MetricError, match="whiten"):
        selection.score("fsms", labels=np.repeat(np.arange(2), 5), features=np.eye(10), whiten=1)
