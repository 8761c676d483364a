"""Baseline transferability metrics: each against a hand-worked case or an independent plain
computation, plus shared properties (class structure beats shuffled labels; errors raise)."""

import itertools
import math
import warnings

import numpy as np
import pytest
from scipy import optimize, stats
from sklearn.covariance import LedoitWolf
from sklearn.decomposition import PCA
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.mixture import GaussianMixture

import zoopick.selection as selection
from zoopick.selection.metrics import MetricError
from zoopick.selection.metrics.gbc import pca_project
from zoopick.selection.metrics.hscore import ledoit_wolf
from zoopick.selection.metrics.knn import nearest_neighbours
from zoopick.selection.metrics.logme import fit_evidence, log_evidence
from zoopick.selection.metrics.sfda import largest_eigenvalue

BASELINES = [
    "leep",
    "nce",
    "logme",
    "hscore",
    "hscore_shrink",
    "nleep",
    "gbc",
    "sfda",
    "transrate",
    "knn",
    "parc",
    "ncti",
]


def clusters(n=120, c=4, d=12, sep=3.0, seed=0):
    """Gaussian classes with distinct means: features, labels, and logits of an 8-class source
    head whose classes refine the target classes (source class 2y or 2y+1)."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % c
    rng.shuffle(y)
    means = rng.standard_normal((c, d)) * sep
    features = means[y] + rng.standard_normal((n, d))
    z = 2 * y + rng.integers(0, 2, n)
    logits = 3.0 * np.eye(2 * c)[z] + rng.standard_normal((n, 2 * c))
    return features, logits, y


def plain_leep(theta, y):
    """LEEP by the paper's definitions, with explicit loops."""
    n, k = theta.shape
    classes = sorted(set(y.tolist()))
    joint = {
        (a, z): sum(theta[i, z] for i in range(n) if y[i] == a) / n
        for a in classes
        for z in range(k)
    }
    pz = [sum(joint[(a, z)] for a in classes) for z in range(k)]
    total = 0.0
    for i in range(n):
        total += math.log(sum(joint[(y[i], z)] / pz[z] * theta[i, z] for z in range(k)))
    return total / n


# ---------------------------------------------------------------- LEEP, NCE


def test_leep_hand_case():
    theta = np.array([[0.8, 0.2], [0.6, 0.4], [0.2, 0.8], [0.4, 0.6]])
    labels = np.array([3, 3, 7, 7])  # any non-negative ints: remapped to 0, 1
    # P(y, z) = 1/4 sum_i theta_i(z) [y_i = y]:
    #   y=3: ((0.8 + 0.6) / 4, (0.2 + 0.4) / 4) = (0.35, 0.15)
    #   y=7: ((0.2 + 0.4) / 4, (0.8 + 0.6) / 4) = (0.15, 0.35)
    # P(z) = (0.5, 0.5), so P(3|z) = (0.7, 0.3) and P(7|z) = (0.3, 0.7).
    # sum_z P(y_i|z) theta_i(z): 0.7*0.8 + 0.3*0.2 = 0.62, 0.7*0.6 + 0.3*0.4 = 0.54,
    #                            0.3*0.2 + 0.7*0.8 = 0.62, 0.3*0.4 + 0.7*0.6 = 0.54
    expected = (2 * math.log(0.62) + 2 * math.log(0.54)) / 4
    got = selection.score("leep", labels=labels, logits=np.log(theta))  # softmax(log p) = p
    assert got == pytest.approx(expected, rel=1e-12)
    # Softmax is shift-invariant per row: the raw logits need not be log-probabilities.
    shifted = np.log(theta) + np.array([[5.0], [-2.0], [0.3], [100.0]])
    assert selection.score("leep", labels=labels, logits=shifted) == pytest.approx(expected)


def test_leep_matches_plain_loop_on_random_logits():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((40, 6)) * 2
    y = rng.integers(0, 3, 40)
    theta = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert selection.score("leep", labels=y, logits=logits) == pytest.approx(
        plain_leep(theta, y), rel=1e-10
    )


def test_nce_hand_case():
    # argmax z = [0, 0, 1, 0]; labels y = [0, 0, 1, 1]
    logits = np.array([[2.0, 1.0], [5.0, 0.0], [0.0, 1.0], [3.0, -1.0]])
    labels = np.array([0, 0, 1, 1])
    # counts: (y0, z0) = 2, (y1, z1) = 1, (y1, z0) = 1;  p(z0) = 3/4, p(z1) = 1/4
    # -H(Y|Z) = sum p(y,z) log p(y|z) = 2/4 log(2/3) + 1/4 log(1/3) + 1/4 log(1/1)
    expected = 0.5 * math.log(2 / 3) + 0.25 * math.log(1 / 3)
    assert selection.score("nce", labels=labels, logits=logits) == pytest.approx(expected)
    # Source labels that determine the target labels: zero conditional entropy, the maximum.
    aligned = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    assert selection.score("nce", labels=labels, logits=aligned) == 0.0


# ---------------------------------------------------------------- LogME


def test_log_evidence_is_the_gaussian_marginal_likelihood():
    rng = np.random.default_rng(0)
    F = rng.standard_normal((25, 6))
    y = (rng.random(25) < 0.4).astype(float)
    for alpha, beta in [(0.7, 2.3), (5.0, 0.1), (1e-2, 30.0)]:
        # Marginal of y = F w + noise, w ~ N(0, I/alpha), noise ~ N(0, I/beta)
        cov = F @ F.T / alpha + np.eye(25) / beta
        direct = stats.multivariate_normal(mean=np.zeros(25), cov=cov).logpdf(y)
        assert log_evidence(F, y, alpha, beta) == pytest.approx(direct, rel=1e-10)


@pytest.mark.parametrize("n,d", [(80, 10), (25, 40)])  # n > D and n < D
def test_logme_fixed_point_is_the_evidence_maximum(n, d):
    rng = np.random.default_rng(n)
    # Rank 8 < n: targets are not exactly representable, so the maximum is at finite beta
    # (with n < D and full-rank F the supremum is at beta -> infinity, see logme.py).
    F = rng.standard_normal((n, 8)) @ rng.standard_normal((8, d)) + 0.5
    y = (rng.random(n) < 0.3).astype(float)
    y[0], y[1] = 1.0, 0.0
    F[y == 1] += 0.8  # some signal so alpha stays finite
    (alpha,), (beta,), (ev,) = fit_evidence(F, y)
    best = log_evidence(F, y, alpha, beta)
    assert ev == pytest.approx(best, rel=1e-9)
    for fa, fb in itertools.product([0.98, 1.0, 1.02], repeat=2):
        assert log_evidence(F, y, alpha * fa, beta * fb) <= best + 1e-9
    # An independent optimiser over (log alpha, log beta) finds no higher evidence.
    res = optimize.minimize(
        lambda p: -log_evidence(F, y, math.exp(p[0]), math.exp(p[1])),
        x0=[0.0, 0.0],
        method="Nelder-Mead",
        options={"xatol": 1e-8, "fatol": 1e-10, "maxiter": 4000},
    )
    assert -res.fun <= best + 1e-6
    assert -res.fun == pytest.approx(best, abs=1e-4)


@pytest.mark.parametrize("n,d", [(90, 8), (20, 30)])
def test_logme_score_is_mean_per_sample_evidence_of_one_hot_targets(n, d):
    rng = np.random.default_rng(d)
    labels = np.arange(n) % 3 * 2 + 1  # labels 1, 3, 5
    F = rng.standard_normal((n, d)) + np.eye(3, d)[labels // 2] * 2
    per_class = []
    for cls in (1, 3, 5):
        yc = (labels == cls).astype(float)
        (alpha,), (beta,), _ = fit_evidence(F, yc)
        per_class.append(log_evidence(F, yc, alpha, beta) / n)
    got = selection.score("logme", labels=labels, features=F)
    assert got == pytest.approx(np.mean(per_class), rel=1e-8)


# ---------------------------------------------------------------- H-score


def plain_hscore(f, y, rcond):
    f = f - f.mean(axis=0)
    g = np.zeros_like(f)
    for cls in np.unique(y):
        g[y == cls] = f[y == cls].mean(axis=0)
    return np.trace(np.linalg.pinv(np.cov(f, rowvar=False), rcond=rcond) @ np.cov(g, rowvar=False))


def test_hscore_matches_direct_formula():
    f, _, y = clusters(n=100, c=5, d=10, sep=1.0)
    f = f * np.linspace(0.5, 3.0, 10)  # non-isotropic
    got = selection.score("hscore", labels=y, features=f)
    assert got == pytest.approx(plain_hscore(f, y, 1e-12), rel=1e-9)


def test_hscore_pseudo_inverse_when_features_are_rank_deficient():
    f, _, y = clusters(n=100, c=5, d=6, sep=1.0)
    f = np.hstack([f, f[:, :2] + f[:, 2:4]])  # 8 columns of rank 6
    got = selection.score("hscore", labels=y, features=f)
    assert got == pytest.approx(plain_hscore(f, y, 1e-10), rel=1e-7)


@pytest.mark.parametrize("n,d", [(200, 10), (30, 50)])
def test_ledoit_wolf_matches_sklearn(n, d):
    rng = np.random.default_rng(n)
    f = rng.standard_normal((n, d)) @ rng.standard_normal((d, d))
    f -= f.mean(axis=0)
    cov, a = ledoit_wolf(f)
    ref = LedoitWolf(assume_centered=True).fit(f)
    assert a == pytest.approx(ref.shrinkage_, rel=1e-10)
    np.testing.assert_allclose(cov, ref.covariance_, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n,d", [(60, 40), (30, 50)])  # D near or above n: where it matters
def test_hscore_shrink_matches_ibrahim_formula(n, d):
    f, _, y = clusters(n=n, c=4, d=d, sep=1.0)
    fc = f - f.mean(axis=0)
    lw = LedoitWolf(assume_centered=False).fit(fc)
    g = np.zeros_like(fc)
    for cls in np.unique(y):
        g[y == cls] = fc[y == cls].mean(axis=0)
    expected = np.trace(
        np.linalg.inv(lw.covariance_) @ ((1 - lw.shrinkage_) * np.cov(g, rowvar=False))
    )
    got = selection.score("hscore_shrink", labels=y, features=f)
    assert got == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------- GBC


def plain_gbc(f, y, dim, spherical):
    """GBC as the reference code computes it: sklearn PCA, per-class np.var floored at 1e-4,
    spherical = mean variance (a scalar), the log-variance term summed over what is stored
    (once for a scalar), exp(-D_B) summed over ordered pairs, negated."""
    z = PCA(n_components=dim).fit_transform(f)
    stats_ = {}
    for cls in np.unique(y):
        zc = z[y == cls]
        var = np.maximum(zc.var(axis=0), 1e-4)
        stats_[cls] = (zc.mean(axis=0), var.mean() if spherical else var)
    total = 0.0
    for i, j in itertools.permutations(sorted(stats_), 2):
        (mi, vi), (mj, vj) = stats_[i], stats_[j]
        avg = (vi + vj) / 2
        first = np.sum((mi - mj) ** 2 / avg) / 8
        second = np.sum(np.log(avg)) - 0.5 * np.sum(np.log(vi)) - 0.5 * np.sum(np.log(vj))
        total += math.exp(-(first + 0.5 * second))
    return -total


def exact_bhattacharyya(mi, si, mj, sj):
    """The textbook distance of two Gaussians with full covariances, by scipy-free linear
    algebra (for the diagonal case the reference's log term is exactly this)."""
    s = (si + sj) / 2
    diff = mi - mj
    return diff @ np.linalg.inv(s) @ diff / 8 + 0.5 * math.log(
        np.linalg.det(s) / math.sqrt(np.linalg.det(si) * np.linalg.det(sj))
    )


@pytest.mark.parametrize("covariance", ["diagonal", "spherical"])
def test_gbc_matches_reference_computation(covariance):
    f, _, y = clusters(n=150, c=5, d=12, sep=0.8)
    got = selection.score("gbc", labels=y, features=f, dim=6, covariance=covariance)
    assert got == pytest.approx(plain_gbc(f, y, 6, covariance == "spherical"), rel=1e-8)


def test_gbc_default_is_spherical_pca64_and_diagonal_is_exact():
    f, _, y = clusters(n=200, c=4, d=80, sep=0.3)
    assert selection.score("gbc", labels=y, features=f) == pytest.approx(
        plain_gbc(f, y, 64, spherical=True), rel=1e-8
    )
    # diagonal: the reference's distance is the exact one of diagonal Gaussians
    z = PCA(n_components=5).fit_transform(f)
    st = {c: (z[y == c].mean(0), np.diag(np.maximum(z[y == c].var(0), 1e-4))) for c in range(4)}
    want = -sum(
        math.exp(-exact_bhattacharyya(*st[i], *st[j])) for i, j in itertools.permutations(st, 2)
    )
    got = selection.score("gbc", labels=y, features=f, dim=5, covariance="diagonal")
    assert got == pytest.approx(want, rel=1e-8)


def test_gbc_spherical_log_term_once():
    """Hand case, one pair in d = 4 with equal means: class variances 1 and 4 (spherical).
    D_B = 1/2 (ln 2.5 - 0.5 ln 1 - 0.5 ln 4) = 1/2 ln(1.25): the term once, not 4 times."""
    from zoopick.selection.metrics.gbc import bhattacharyya_coefficients

    bc = bhattacharyya_coefficients(np.zeros((2, 4)), np.array([[1.0], [4.0]]))
    assert bc[0, 1] == pytest.approx(math.exp(-0.5 * math.log(1.25)), rel=1e-12)


@pytest.mark.parametrize("n,d,k", [(300, 40, 6), (30, 50, 6), (100, 12, 10)])
def test_pca_project_matches_sklearn_up_to_sign(n, d, k):
    rng = np.random.default_rng(d)
    x = rng.standard_normal((n, d)) * np.linspace(3, 0.1, d) + 1.0
    ours = pca_project(x, k)
    ref = PCA(n_components=k).fit_transform(x)
    np.testing.assert_allclose(np.abs(ours), np.abs(ref), rtol=1e-6, atol=1e-8)


def test_gbc_spans_zero_to_minus_pairs():
    f, _, y = clusters(n=120, c=4, d=8, sep=50.0)
    assert selection.score("gbc", labels=y, features=f) == pytest.approx(0.0, abs=1e-6)
    rng = np.random.default_rng(1)
    noise = rng.standard_normal((4000, 8))
    y2 = np.arange(4000) % 4
    assert selection.score("gbc", labels=y2, features=noise) == pytest.approx(-12.0, rel=0.02)


# ---------------------------------------------------------------- TransRate


def released_transrate(z, y, eps):
    """The authors' released TransRate: slogdet of I + Z^T Z / (n eps), class rates averaged
    with equal weights, on centred features (z given already normalised/projected)."""
    z = z - z.mean(axis=0)

    def rate(zz):
        m, d = zz.shape
        return 0.5 * np.linalg.slogdet(np.eye(d) + 1 / (m * eps) * zz.T @ zz)[1]

    classes = np.unique(y)
    return rate(z) - sum(rate(z[y == c]) for c in classes) / len(classes)


def _rownorm(f):
    return f / np.linalg.norm(f, axis=1, keepdims=True)


@pytest.mark.parametrize("eps", [1e-4, 0.5])
def test_transrate_unprojected_matches_released_code(eps):
    # Classes of 4 rows (< d = 8) and 40 rows (> d): both Gram-matrix branches.
    f, _, _ = clusters(n=88, c=4, d=8, sep=1.0)
    y = np.array([0] * 4 + [1] * 4 + [2] * 40 + [3] * 40)
    got = selection.score("transrate", labels=y, features=f * 7.0, eps=eps, project=False)
    assert got == pytest.approx(released_transrate(_rownorm(f), y, eps), rel=1e-9)


def test_transrate_projected_is_cross_fitted_released_code():
    """project=True: basis of the class means of one half (SVD via numpy), released TransRate
    of the other half in that basis, both ways, averaged."""
    from zoopick.selection.metrics.transrate import _halves

    f, _, y = clusters(n=120, c=4, d=10, sep=1.0)
    z = _rownorm(f)
    z = z - z.mean(axis=0)
    half = _halves(y, 4, 0)
    assert abs(int(half.sum()) - 60) <= 4
    want = []
    for fit in (half, ~half):
        means = np.stack([z[fit & (y == c)].mean(axis=0) for c in range(4)])
        w = np.bincount(y[fit], minlength=4) / fit.sum()
        _, _, vt = np.linalg.svd(means - w @ means)
        basis = vt[:3].T  # 4 centred means span 3 directions
        want.append(released_transrate(z[~fit] @ basis, y[~fit], 1e-4))
    got = selection.score("transrate", labels=y, features=f)
    assert got == pytest.approx(np.mean(want), rel=1e-8)


def test_transrate_noise_padding_does_not_raise_score():
    """Defect 2: a fixed 16-d class signal padded with pure noise to 64 and 512 dims."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(5), 40)
    signal = rng.standard_normal((5, 16))[y] + rng.standard_normal((200, 16))
    scores = [
        selection.score(
            "transrate", labels=y, features=np.hstack([signal, rng.standard_normal((200, d))])
        )
        for d in (0, 48, 496)
    ]
    assert scores[0] >= scores[1] >= scores[2]
    assert scores[2] < scores[0]
    # scale of the features does not matter
    assert selection.score("transrate", labels=y, features=signal * 100) == pytest.approx(
        scores[0], rel=1e-9
    )


# ---------------------------------------------------------------- k-NN


def brute_knn(f, y, k):
    n = len(y)
    u = [row / np.linalg.norm(row) for row in f]
    correct = 0
    for i in range(n):
        sims = sorted(((float(u[i] @ u[j]), j) for j in range(n) if j != i), reverse=True)[:k]
        votes, simsum = {}, {}
        for s, j in sims:
            votes[y[j]] = votes.get(y[j], 0) + 1
            simsum[y[j]] = simsum.get(y[j], 0.0) + s
        pred = min(votes, key=lambda c: (-votes[c], -simsum[c], c))
        correct += pred == y[i]
    return correct / n


@pytest.mark.parametrize("k", [1, 3, 5])
def test_knn_matches_brute_force(k):
    f, _, y = clusters(n=90, c=3, d=6, sep=0.7, seed=k)
    assert selection.score("knn", labels=y, features=f, k=k) == pytest.approx(brute_knn(f, y, k))


def test_nearest_neighbours_across_blocks():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((53, 5)).astype(np.float32)
    idx, sim = nearest_neighbours(x, 4, block=7)  # many blocks, a ragged last one
    full = x.astype(np.float64) @ x.T.astype(np.float64)
    np.fill_diagonal(full, -np.inf)
    for i in range(53):
        expected = set(np.argsort(-full[i])[:4].tolist())
        assert set(idx[i].tolist()) == expected
        np.testing.assert_allclose(np.sort(sim[i]), np.sort(full[i, list(expected)]), rtol=1e-5)


def test_knn_vote_tie_goes_to_larger_summed_similarity():
    # Points on the unit circle (degrees); k = 2, so every vote with mixed classes is a tie.
    deg = np.radians([0.0, 10.0, -20.0, 180.0, 170.0, 200.0])
    f = np.stack([np.cos(deg), np.sin(deg)], axis=1)
    y = np.array([2, 2, 1, 0, 0, 1])
    # 0 (0 deg):    neighbours 1 (10 deg away, class 2), 2 (20, class 1): tie -> 2, right
    # 1 (10 deg):   neighbours 0 (10, class 2), 2 (30, class 1): tie -> 2, right
    # 2 (-20 deg):  neighbours 0, 1 (both class 2) -> 2, wrong
    # 3 (180 deg):  neighbours 4 (10, class 0), 5 (20, class 1): tie -> 0, right
    # 4 (170 deg):  neighbours 3 (10, class 0), 5 (30, class 1): tie -> 0, right
    # 5 (200 deg):  neighbours 3, 4 (both class 0) -> 0, wrong
    # (breaking ties by the smaller label instead would get 0 and 1 wrong: 2/6)
    assert selection.score("knn", labels=y, features=f, k=2) == pytest.approx(4 / 6)
    assert brute_knn(f, y, 2) == pytest.approx(4 / 6)


# ---------------------------------------------------------------- N-LEEP


def test_nleep_is_leep_of_gmm_posteriors():
    f, _, y = clusters(n=200, c=4, d=10, sep=1.0)
    z = PCA(n_components=0.8).fit_transform(f)
    gmm = GaussianMixture(n_components=20, covariance_type="diag", max_iter=50, random_state=0).fit(
        z
    )
    expected = plain_leep(gmm.predict_proba(z), y)
    assert selection.score("nleep", labels=y, features=f) == pytest.approx(expected, rel=1e-6)


def test_nleep_reduces_components_for_small_n():
    # 5 * 3 = 15 components for 24 samples: capped at two samples per component, 12.
    f, _, y = clusters(n=24, c=3, d=6)
    with pytest.warns(RuntimeWarning, match="too few"):
        value = selection.score("nleep", labels=y, features=f)
    z = PCA(n_components=0.8).fit_transform(f)
    post = GaussianMixture(
        n_components=12, covariance_type="diag", max_iter=50, random_state=0
    ).fit(z)
    assert value == pytest.approx(plain_leep(post.predict_proba(z), y), rel=1e-6)


# ---------------------------------------------------------------- SFDA


def test_sfda_fisher_stage_is_shrinkage_lda():
    from zoopick.selection.metrics.sfda import fisher_logits

    f, _, y = clusters(n=150, c=4, d=10, sep=0.6)
    logits, _, lam = fisher_logits(f, y, 4, 0.3)
    prob = np.exp(logits - logits.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    lda = LinearDiscriminantAnalysis(solver="lsqr", shrinkage=0.3).fit(f, y)
    np.testing.assert_allclose(prob, lda.predict_proba(f), rtol=1e-7, atol=1e-10)
    assert lam == 0.3


def test_sfda_matches_plain_confmix_with_sklearn_lda():
    f, _, y = clusters(n=150, c=4, d=10, sep=0.6)
    lam = 0.2
    prob = LinearDiscriminantAnalysis(solver="lsqr", shrinkage=lam).fit(f, y).predict_proba(f)
    soft = np.exp(prob) / np.exp(prob).sum(axis=1, keepdims=True)
    means = np.array([f[y == c].mean(axis=0) for c in range(4)])
    mixed = f.copy()
    for i in range(len(y)):
        other = np.mean([means[c] for c in range(4) if c != y[i]], axis=0)
        w = soft[i, y[i]]
        mixed[i] = w * f[i] + (1 - w) * other
    prob2 = (
        LinearDiscriminantAnalysis(solver="lsqr", shrinkage=lam).fit(mixed, y).predict_proba(mixed)
    )
    expected = np.mean(prob2[np.arange(len(y)), y])
    assert selection.score("sfda", labels=y, features=f, shrinkage=lam) == pytest.approx(expected)
    expected_log = np.mean(np.log(prob2[np.arange(len(y)), y]))
    got_log = selection.score("sfda", labels=y, features=f, shrinkage=lam, log=True)
    assert got_log == pytest.approx(expected_log, rel=1e-7)


def test_sfda_adaptive_shrinkage_uses_largest_within_class_eigenvalue():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((12, 12))
    s = a @ a.T
    assert largest_eigenvalue(s) == pytest.approx(np.linalg.eigvalsh(s)[-1], rel=1e-6)
    f, _, y = clusters(n=150, c=4, d=10, sep=0.6)
    f = f * 0.05  # small scale so exp(-5 sigma_max) is not at its floor
    dev = f - np.array([f[y == c].mean(axis=0) for c in range(4)])[y]
    sw = dev.T @ dev / len(y)
    lam = math.exp(-5 * np.linalg.eigvalsh(sw)[-1])
    assert 0.01 < lam < 0.99
    assert selection.score("sfda", labels=y, features=f) == pytest.approx(
        selection.score("sfda", labels=y, features=f, shrinkage=lam), rel=1e-6
    )


# ---------------------------------------------------------------- degenerate D >= n: PCA option


def test_faithful_hscore_and_sfda_tie_when_d_exceeds_n_and_pca_option_separates():
    """Defect 5: with D above n, H-score is C - 1 exactly and SFDA ~1.0 for a good model and
    for pure noise alike; pca_dim gives them different scores."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(5), 20)
    good = rng.standard_normal((100, 200)) + 0.3 * rng.standard_normal((5, 200))[y]
    noise = rng.standard_normal((100, 200))
    for f in (good, noise):
        assert selection.score("hscore", labels=y, features=f) == pytest.approx(4.0, rel=1e-8)
        assert selection.score("sfda", labels=y, features=f) == pytest.approx(1.0, abs=1e-3)
    for name in ("hscore", "sfda"):
        g = selection.score(name, labels=y, features=good, pca_dim=16)
        b = selection.score(name, labels=y, features=noise, pca_dim=16)
        assert g > b, name


@pytest.mark.parametrize("name", ["hscore", "hscore_shrink", "sfda"])
def test_pca_dim_option_is_the_metric_on_sklearn_pca_scores(name):
    f, _, y = clusters(n=90, c=3, d=30, sep=0.7)
    reduced = PCA(n_components=8).fit_transform(f)  # signs may differ: the scores do not care
    assert selection.score(name, labels=y, features=f, pca_dim=8) == pytest.approx(
        selection.score(name, labels=y, features=reduced), rel=1e-7
    )
    # pca_dim at or above D is the faithful form itself
    assert selection.score(name, labels=y, features=f, pca_dim=30) == selection.score(
        name, labels=y, features=f
    )
    with pytest.raises(MetricError, match="pca_dim"):
        selection.score(name, labels=y, features=f, pca_dim=0)


# ---------------------------------------------------------------- shared properties


def _inputs(name, features, logits):
    return {"logits": logits} if name in ("leep", "nce") else {"features": features}


@pytest.mark.parametrize("name", BASELINES)
def test_class_structure_beats_shuffled_labels(name):
    f, logits, y = clusters(n=160, c=4, d=12, sep=1.5)
    shuffled = np.random.default_rng(7).permutation(y)
    good = selection.score(name, labels=y, **_inputs(name, f, logits))
    bad = selection.score(name, labels=shuffled, **_inputs(name, f, logits))
    assert good > bad


@pytest.mark.parametrize("name", BASELINES)
def test_label_values_do_not_matter(name):
    f, logits, y = clusters(n=80, c=3, d=6, sep=1.0)
    a = selection.score(name, labels=y, **_inputs(name, f, logits))
    b = selection.score(name, labels=y * 10 + 4, **_inputs(name, f, logits))
    assert a == pytest.approx(b, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("name", BASELINES)
def test_single_class_raises(name):
    f, logits, _ = clusters(n=40, c=2, d=5)
    with pytest.raises(MetricError, match="at least 2"):
        selection.score(name, labels=np.full(40, 3), **_inputs(name, f, logits))


@pytest.mark.parametrize("name", BASELINES)
def test_too_few_samples_raises(name):
    f, logits, _ = clusters(n=3, c=3, d=5)
    with pytest.raises(MetricError, match="more samples than"):
        selection.score(name, labels=np.array([0, 1, 2]), **_inputs(name, f, logits))


def test_knn_needs_more_samples_than_k():
    f, _, _ = clusters(n=5, c=2, d=3)
    with pytest.raises(MetricError, match="more than k"):
        selection.score("knn", labels=np.array([0, 0, 1, 1, 1]), features=f, k=5)


@pytest.mark.parametrize("name", ["hscore", "hscore_shrink", "nleep", "gbc", "sfda", "transrate"])
def test_constant_features_raise(name):
    with pytest.raises(MetricError):
        selection.score(name, labels=np.arange(20) % 2, features=np.ones((20, 4)))


def test_bad_options_raise():
    f, _, y = clusters(n=40, c=2, d=5)
    with pytest.raises(MetricError):
        selection.score("gbc", labels=y, features=f, covariance="full")
    with pytest.raises(MetricError):
        selection.score("nleep", labels=y, features=f, covariance_type="bogus")
    with pytest.raises(MetricError):
        selection.score("sfda", labels=y, features=f, shrinkage=1.5)
    with pytest.raises(MetricError):
        selection.score("transrate", labels=y, features=f, eps=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        selection.score("knn", labels=y, features=f, k=1)


def test_parc_spearman_against_a_binary_variable_equals_scipys():
    """PARC's memory-lean Spearman (ranks vs the two-valued label dissimilarity) is scipy's."""
    from scipy import stats

    from zoopick.selection.metrics.parc import _spearman_with_binary

    rng = np.random.default_rng(7)
    for frac in (0.05, 0.5, 0.9):
        values = np.round(rng.normal(size=2000), 1)  # many ties, as dissimilarities have
        flag = rng.random(2000) < frac
        want = stats.spearmanr(values, flag * 1.25).statistic
        assert _spearman_with_binary(values, flag) == pytest.approx(want, abs=1e-12)
    assert np.isnan(_spearman_with_binary(values, np.zeros(2000, dtype=bool)))
