"""Tests for selection/metrics/fsms.py: FSMS against a plain loop re-implementation of its
documented formulas (explicit SVD, inverses, OAS by the paper's equation), its head-size
invariance (defect 4 of issue 11) and its behaviour on degenerate inputs."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest

import zoopick.selection as selection


def plain_fsms(labels: np.ndarray, features: np.ndarray, dim: int = 64) -> float:
    n = len(labels)
    z = features - features.mean(axis=0)
    _, s, vt = np.linalg.svd(z, full_matrices=False)
    var = s**2 / n
    keep = [k for k in range(min(dim, len(var), n // 2)) if var[k] > var[0] * 1e-10]
    x = z @ vt[keep].T / np.sqrt(var[keep])
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


@pytest.mark.parametrize(
    ("sizes", "d", "dim"),
    [([30, 30, 30, 30], 20, 64), ([5, 40, 1, 14], 100, 64), ([25, 25, 25], 300, 8)],
)
def test_fsms_matches_plain_implementation(rng, sizes, d, dim):
    labels = np.repeat(np.arange(len(sizes)), sizes)
    f = class_features(rng, labels, d)
    got = selection.score("fsms", labels=labels, features=f, dim=dim)
    assert got == pytest.approx(plain_fsms(labels, f, dim), rel=1e-6)


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


def test_fsms_scale_rotation_and_noise(rng):
    labels = np.repeat(np.arange(5), 40)
    f = class_features(rng, labels, 16)
    base = selection.score("fsms", labels=labels, features=f)
    assert base > 0.5
    q, _ = np.linalg.qr(rng.standard_normal((16, 16)))
    assert selection.score("fsms", labels=labels, features=3.0 * f @ q + 5.0) == pytest.approx(
        base, rel=1e-8
    )
    padded = [
        selection.score(
            "fsms", labels=labels, features=np.hstack([f, rng.standard_normal((200, k))])
        )
        for k in (48, 496)
    ]
    assert base >= padded[0] >= padded[1]  # noise padding never raises the score
    shuffled = selection.score("fsms", labels=rng.permutation(labels), features=f)
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
    assert selection.metrics.get("fsms").options == ["dim", "seed"]
