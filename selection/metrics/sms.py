"""SMS, I-SMS and SMS+: how well a model's soft labels separate the target classes.

``sms`` (Zhao et al., "SMS: An Efficient Source Model Selection Framework for Model Reuse")
turns each target sample into soft labels ``p = softmax(logits / T)``, fits one Gaussian per
target class (class mean, biased covariance + 1e-6 I) and asks, for every pair of classes, how
much more likely each class mean is under its own Gaussian than under the other one::

    r_i  = N(mu_i; mu_i, S_i) / (N(mu_i; mu_i, S_i) + N(mu_i; mu_j, S_j))
    S_ij = r_i + r_j - 1,              score = mean of S_ij over unordered pairs.

It is computed here exactly like that, but stably and fast: every density is a log density,
``r_i = sigmoid(log a - log b)``; each class covariance gets one Cholesky factor (its log
determinant read off the diagonal) and one triangular solve against *all* class means at once,
so the whole table of log N(mu_i; mu_j, S_j) costs O(C_t d^3 + C_t^2 d^2) with no matrix inverse
and no per-pair factorisation. Only one class covariance is held in memory at a time (at d=1000
and 100 classes, all of them would take 800 MB).

``isms`` (the paper's I-SMS) first maps the logits to ``dim`` (25) outputs by a fixed random
linear layer (weights and bias uniform in +-1/sqrt(C_s), PyTorch's ``nn.Linear`` default, as in
the authors' code) when the model has more outputs than that, then runs SMS on them. The map
is applied to the *logits*, before the softmax: the paper reduces the number of outputs of the
source model (as if a random linear layer were appended to its head), and the soft labels are
then the softmax of those 25 new outputs. The map depends only on ``(seed, C_s)``, so every
model with the same number of outputs is scored through the same map.

``sms+`` is our improvement: the same class Gaussians of soft labels and pairwise separation,
fitted in log-ratio coordinates, projected to ``dim`` principal directions, with shrinkage
covariances, scored as the log of a Bhattacharyya bound on pairwise confusion, so it neither
saturates at well-separated classes nor degenerates on classes smaller than the dimension. See
:func:`sms_plus` for the design and why.

All three share the helpers below (class grouping, scatter, Cholesky log-determinant, the
pairwise log-density table) and report failures as :class:`MetricError`, never a sentinel.
"""

from __future__ import annotations

import warnings

import numpy as np
from scipy import linalg
from scipy.special import expit, logsumexp, softmax

from zoopick.selection.metrics.registry import MetricError, register

SMS_RIDGE = 1e-6  # the reference implementation's covariance jitter
_BATCH_MAX_ELEMENTS = 8_000_000  # stacked class covariances up to 64 MB (float64)
SMS_PLUS_RIDGE = 1e-6  # floor on sms+ covariances, relative to the (whitened) total variance
_EXACT_PCA_MAX_OUTPUTS = 2048  # sms+: randomized SVD once both n and C_s exceed this
_PAIR_CHUNK = 4096  # pairs per batched solve in sms+ (bounds memory at many classes)
SMS_MAX_OUTPUTS = 4096
"""Most source outputs plain SMS fits full Gaussians over: each class covariance is C_s x C_s
(128 MB at this size, 3.8 GB at ImageNet-21k's 21,843) and its Cholesky factor O(C_s^3) per
class (minutes a class at 21,843). Larger heads are refused naming ``isms`` and ``sms+``,
which reduce the outputs first."""


# ---------------------------------------------------------------- shared helpers


def _soft_labels(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Row-wise ``softmax(logits / T)`` (scipy's is max-shifted, so it never overflows)."""
    t = _as_float(temperature, "temperature")
    if not (np.isfinite(t) and t > 0):
        raise MetricError(f"temperature must be a positive number, got {temperature!r}")
    return softmax(logits / t, axis=1)


def _class_groups(
    labels: np.ndarray, *, min_size: int, metric: str
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Classes with at least ``min_size`` samples and the row indices of each.

    Smaller classes are left out with a warning naming them; fewer than two usable classes
    leaves nothing to separate, which is a :class:`MetricError`.
    """
    classes, counts = np.unique(labels, return_counts=True)
    small = classes[counts < min_size]
    if small.size:
        warnings.warn(
            f"{metric}: leaving out class(es) {small.tolist()} with fewer than {min_size} "
            "samples (a class Gaussian needs them)",
            stacklevel=3,
        )
    keep = classes[counts >= min_size]
    if keep.size < 2:
        sizes = dict(zip(classes.tolist(), counts.tolist(), strict=True))
        raise MetricError(
            f"{metric} needs at least 2 classes with >= {min_size} samples each; "
            f"got {keep.size} (class sizes: {sizes})"
        )
    order = np.argsort(labels, kind="stable")
    starts = np.searchsorted(labels[order], keep)
    sizes = counts[counts >= min_size]
    return keep, [order[s : s + c] for s, c in zip(starts, sizes, strict=True)]


def _cholesky_logdet(cov: np.ndarray, what: str) -> tuple[np.ndarray, float]:
    """Lower Cholesky factor of ``cov`` and ``log det cov`` from its diagonal."""
    try:
        chol = linalg.cholesky(cov, lower=True, check_finite=False)
    except linalg.LinAlgError as e:
        raise MetricError(
            f"covariance of {what} is not positive definite (Cholesky failed: {e}); "
            "the inputs are numerically degenerate"
        ) from None
    return chol, 2.0 * float(np.sum(np.log(np.diag(chol))))


def _scatter(x: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """Biased (1/n) covariance of the rows of ``x`` about ``mean``."""
    xc = x - mean
    return (xc.T @ xc) / x.shape[0]


def _log_density_table(
    x: np.ndarray, classes: np.ndarray, groups: list[np.ndarray], ridge: float
) -> np.ndarray:
    """``table[i, j] = log N(mu_i; mu_j, Sigma_j)`` up to the shared ``-d/2 log 2 pi``.

    Sigma_j is class j's biased covariance plus ``ridge * I``. One Cholesky factor per class,
    one triangular solve per class over all means: O(C d^3 + C^2 d^2). The dropped constant
    cancels in every density ratio SMS takes.
    """
    means = np.stack([x[g].mean(axis=0) for g in groups])
    c, d = means.shape
    if c * d * d <= _BATCH_MAX_ELEMENTS:
        return _log_density_table_batched(x, classes, groups, means, ridge)
    table = np.empty((c, c))
    for j, g in enumerate(groups):
        cov = _scatter(x[g], means[j])
        cov[np.diag_indices(d)] += ridge
        chol, logdet = _cholesky_logdet(cov, f"class {classes[j]}")
        z = linalg.solve_triangular(chol, (means - means[j]).T, lower=True, check_finite=False)
        table[:, j] = -0.5 * logdet - 0.5 * np.einsum("ij,ij->j", z, z)
    return table


def _log_density_table_batched(
    x: np.ndarray, classes: np.ndarray, groups: list[np.ndarray], means: np.ndarray, ridge: float
) -> np.ndarray:
    """The same table with all class factorisations and solves stacked into single batched
    LAPACK calls. For small ``d`` (I-SMS's 25) a loop of C tiny BLAS calls costs far more in
    per-call and thread-start overhead than the arithmetic; stacking needs C d^2 memory, so
    large ``d`` keeps the loop (one covariance at a time)."""
    c, d = means.shape
    covs = np.stack([_scatter(x[g], means[j]) for j, g in enumerate(groups)])
    covs[:, np.arange(d), np.arange(d)] += ridge
    try:
        chol = np.linalg.cholesky(covs)
    except np.linalg.LinAlgError:
        for j in range(c):  # name the first class that fails, as the looped path does
            _cholesky_logdet(covs[j], f"class {classes[j]}")
        raise MetricError("class covariances are not positive definite") from None
    logdet = 2.0 * np.log(np.diagonal(chol, axis1=1, axis2=2)).sum(axis=1)
    # the right-hand sides are (c, d, c): 1.6 GB at 2,000 classes, so they are solved for a
    # chunk of classes j at a time (memory O(_BATCH_MAX_ELEMENTS + c^2), not O(c^2 d))
    maha = np.empty((c, c))
    step = max(1, _BATCH_MAX_ELEMENTS // (d * c))
    for a in range(0, c, step):
        b = min(c, a + step)
        # rhs[j] = (means - means[j]).T: every class mean relative to class j's mean
        rhs = (means[None, :, :] - means[a:b, None, :]).transpose(0, 2, 1)
        z = np.linalg.solve(chol[a:b], rhs)  # z[j] = L_j^{-1} (mu_i - mu_j) for all i
        maha[a:b] = np.einsum("jdi,jdi->ji", z, z)
    return (-0.5 * logdet[:, None] - 0.5 * maha).T


def _sms_from_table(table: np.ndarray) -> float:
    """Mean over unordered pairs of ``r_i + r_j - 1`` with ``r_i = sigmoid(log a_i - log b_ij)``."""
    r = expit(np.diag(table)[:, None] - table)  # r[i, j]: r_i within the pair (i, j)
    iu = np.triu_indices(table.shape[0], k=1)
    return float(np.mean(r[iu] + r.T[iu] - 1.0))


def _sms_core(labels: np.ndarray, logits: np.ndarray, temperature: float, metric: str) -> float:
    p = _soft_labels(logits, temperature)
    classes, groups = _class_groups(labels, min_size=2, metric=metric)
    return _sms_from_table(_log_density_table(p, classes, groups, SMS_RIDGE))


def _as_float(value: object, name: str) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise MetricError(f"{name} must be a number, got {value!r}") from None


def _check_dim(dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 1:
        raise MetricError(f"dim must be a positive integer, got {dim!r}")
    return int(dim)


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise MetricError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def isms_projection(n_outputs: int, dim: int = 25, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The random linear layer I-SMS appends to a model's head: weights ``(n_outputs, dim)`` and
    bias ``(dim,)``, so the new logits are ``logits @ W + b``.

    The authors' I-SMS (ZJU-DAILY/MMQ, ``I-MMQ_sample.py``) passes the logits through an
    untrained ``torch.nn.Linear(C_s, 25)``; PyTorch's default initialisation draws its weights
    and bias uniformly in ``+-1/sqrt(C_s)`` (Kaiming-uniform with a = sqrt(5) gives exactly that
    bound for the weights). This is the same distribution: the projected logits then have the
    scale of the original ones divided by about sqrt(3), whatever C_s, so the softmax
    temperature keeps its meaning. (A Gaussian map with variance 1/dim made them 3.5x too large
    at C_s = 100 and 11x at C_s = 1,000, and I-SMS saturated at 1.0.)

    One deliberate deviation: the authors draw a fresh layer per model; here the generator is
    seeded by ``(seed, n_outputs)`` alone, so every model with the same number of outputs is
    scored through the same map and the scores are reproducible and comparable.
    """
    dim, n_outputs = _check_dim(dim), int(n_outputs)
    rng = np.random.default_rng((_check_seed(seed), n_outputs))
    bound = 1.0 / np.sqrt(n_outputs)
    weight = rng.uniform(-bound, bound, size=(n_outputs, dim))
    bias = rng.uniform(-bound, bound, size=dim)
    return weight, bias


def stratified_subsample(labels: np.ndarray, fraction: float, seed: int = 0) -> np.ndarray:
    """Sorted row indices of a per-class random subsample of ``fraction`` of each class.

    Each class keeps ``ceil(fraction * n_c)`` rows but never fewer than ``min(2, n_c)``, so a
    class that could be scored stays scorable. The draw depends only on ``(seed, labels)``, so
    every model scored on the same dataset sees the same rows.
    """
    f = _as_float(fraction, "sample_fraction")
    if not (0.0 < f <= 1.0):
        raise MetricError(f"sample_fraction must be in (0, 1], got {fraction!r}")
    rng = np.random.default_rng((_check_seed(seed), labels.shape[0], 1))
    keep = []
    for c in np.unique(labels):
        rows = np.flatnonzero(labels == c)
        k = min(rows.size, max(min(2, rows.size), int(np.ceil(f * rows.size - 1e-9))))
        keep.append(rng.choice(rows, size=k, replace=False))
    return np.sort(np.concatenate(keep))


# ---------------------------------------------------------------- SMS and I-SMS


@register("sms", needs={"logits"})
def sms(*, labels: np.ndarray, logits: np.ndarray, temperature: float = 2.0) -> float:
    """SMS: pairwise Gaussian separation of the target classes' soft labels (Zhao et al.).

    Soft labels ``softmax(logits / temperature)``; one Gaussian per class (mean, biased
    covariance + 1e-6 I); score = mean over class pairs of ``r_i + r_j - 1`` (module docstring).
    In [-1, 1], higher = classes better separated. Classes with fewer than 2 samples are left out
    with a warning. Cost O(n d^2 + C_t d^3 + C_t^2 d^2) for d = C_s outputs, so a head of
    more than :data:`SMS_MAX_OUTPUTS` outputs is a :class:`MetricError`.
    """
    if logits.shape[1] > SMS_MAX_OUTPUTS:
        raise MetricError(
            f"sms fits a {logits.shape[1]:,} x {logits.shape[1]:,} covariance per class for "
            f"this head, over the {SMS_MAX_OUTPUTS:,} outputs it allows (memory and time grow "
            "with its square and cube); isms and sms+ reduce the outputs first"
        )
    return _sms_core(labels, logits, temperature, "sms")


@register("isms", needs={"logits"})
def isms(
    *,
    labels: np.ndarray,
    logits: np.ndarray,
    temperature: float = 2.0,
    dim: int = 25,
    seed: int = 0,
    sample_fraction: float = 1.0,
) -> float:
    """I-SMS: SMS on the logits mapped to ``dim`` outputs by a fixed random linear layer.

    With more than ``dim`` outputs the logits go through the random linear layer of
    :func:`isms_projection` (PyTorch's default ``nn.Linear`` initialisation, as the authors'
    code; seeded by ``(seed, C_s)``, the same for every model with C_s outputs) *before* the
    softmax,
    then scored exactly as :func:`sms`. ``sample_fraction < 1`` scores a stratified per-class
    subsample (:func:`stratified_subsample`, same rows for every model). With at most ``dim``
    outputs and ``sample_fraction=1`` this is identical to ``sms``. Cost O(n C_s dim + C_t dim^3).
    """
    dim = _check_dim(dim)
    seed = _check_seed(seed)
    if _as_float(sample_fraction, "sample_fraction") != 1.0:
        rows = stratified_subsample(labels, sample_fraction, seed)
        labels, logits = labels[rows], logits[rows]
    if logits.shape[1] > dim:
        weight, bias = isms_projection(logits.shape[1], dim, seed)
        logits = logits @ weight + bias
    return _sms_core(labels, logits, temperature, "isms")


# ---------------------------------------------------------------- SMS+


def _principal_whitened(z: np.ndarray, dim: int, seed: int, *, whiten: bool = True) -> np.ndarray:
    """Project the rows of ``z`` (already centred) on their top ``dim`` principal directions and
    scale each to unit variance (``whiten=False``: scale all of them by one factor, so that their
    mean variance is 1 and their spectrum is kept). Directions with (numerically) no variance
    are dropped, so the result may have fewer than ``dim`` columns, or none. At most ``n // 2``
    directions are kept:
    whitening every direction a small sample spans maps *any* sample onto the same regular
    simplex, which would erase the classes (every model would score the same).

    Exact: the top eigenpairs of the smaller Gram matrix (C_s x C_s, or n x n when there are fewer
    samples than outputs); a seeded randomized SVD when both sides exceed 2,048.
    """
    n, c_s = z.shape
    k = max(1, min(dim, c_s, n // 2))
    if min(n, c_s) <= _EXACT_PCA_MAX_OUTPUTS:
        small = min(n, c_s)
        gram = (z.T @ z if c_s <= n else z @ z.T) / n
        evals, vecs = linalg.eigh(gram, subset_by_index=[small - k, small - 1], check_finite=False)
        evals, vecs = evals[::-1], vecs[:, ::-1]
        # rows side: z v = sqrt(n lambda) u, so the whitened scores are sqrt(n) u
        scores = z @ vecs if c_s <= n else vecs * np.sqrt(n * np.clip(evals, 0.0, None))
    else:  # e.g. a 21k-class head on a large dataset: exact PCA would cost minutes
        from sklearn.utils.extmath import randomized_svd

        u, s, _ = randomized_svd(z, k, n_iter=5, random_state=seed)
        evals, scores = s**2 / n, u * s
    if evals.size == 0 or evals[0] <= 0:
        return np.zeros((n, 0))
    ok = evals > evals[0] * 1e-10
    return scores[:, ok] / np.sqrt(evals[ok] if whiten else np.mean(evals[ok]))


def _oas(scatter: np.ndarray, dof: float) -> np.ndarray:
    """Oracle-approximating shrinkage (Chen et al. 2010) of ``scatter`` toward a scaled identity,
    for a covariance estimated with ``dof`` degrees of freedom."""
    p = scatter.shape[0]
    tr = np.trace(scatter)
    tr2 = float(np.sum(scatter * scatter))
    mu = tr / p
    denom = (dof + 1.0 - 2.0 / p) * (tr2 - tr * tr / p)
    rho = 1.0 if denom <= 0 else min(1.0, ((1.0 - 2.0 / p) * tr2 + tr * tr) / denom)
    out = (1.0 - rho) * scatter
    out[np.diag_indices(p)] += rho * mu
    return out


def _pairwise_separation(
    means: np.ndarray, covs: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bhattacharyya distance of every pair of classes as linear read-out sees them, de-biased.
    Returns ``(i, j, D_ij)`` over unordered pairs.

    ``D = q / 8`` with ``q = (mu_i - mu_j)' Sbar^-1 (mu_i - mu_j)`` and ``Sbar = (S_i + S_j)/2``:
    the Bhattacharyya distance of two Gaussians sharing the pair's average covariance, for which
    the Bayes error of the pair is ``Phi(-sqrt(q)/2) <= exp(-D)``. (The full distance adds a
    covariance-shape term; a linear head cannot use shape differences, and with small classes
    the sampling noise of that term alone gave shuffled labels a sizable score.)

    Estimated means are noisy, which inflates q by ``tr(Sbar^-1 (S_i/n_i + S_j/n_j))``
    (about ``dim (1/n_i + 1/n_j)``) even when the classes coincide; that amount is subtracted and
    q floored at 0, so outputs carrying no class information score ~0 in any dimension. Pairs
    are solved in batches of ``_PAIR_CHUNK``.
    """
    ii, jj = np.triu_indices(means.shape[0], k=1)
    dist = np.empty(ii.size)
    for s in range(0, ii.size, _PAIR_CHUNK):
        i, j = ii[s : s + _PAIR_CHUNK], jj[s : s + _PAIR_CHUNK]
        sbar = 0.5 * (covs[i] + covs[j])
        delta = (means[i] - means[j])[:, :, None]
        noise = covs[i] / counts[i][:, None, None] + covs[j] / counts[j][:, None, None]
        try:
            sol = np.linalg.solve(sbar, np.concatenate([delta, noise], axis=2))
        except np.linalg.LinAlgError:
            raise MetricError(
                "sms+: an averaged class covariance is singular; the inputs are numerically "
                "degenerate"
            ) from None
        q = np.einsum("pk,pk->p", delta[:, :, 0], sol[:, :, 0])
        bias = np.trace(sol[:, :, 1:], axis1=1, axis2=2)
        dist[s : s + i.size] = np.maximum(q - bias, 0.0) / 8.0
    return ii, jj, dist


@register("sms+", needs={"logits"})
def sms_plus(*, labels: np.ndarray, logits: np.ndarray, dim: int = 25, seed: int = 0) -> float:
    """SMS+: log of a Bhattacharyya bound on how often class pairs are confused (ours).

    Same idea and cost as SMS (one Gaussian per target class over the model's soft labels, scored
    by how well class pairs separate), rebuilt so it neither saturates nor degenerates:

    1. *Coordinates.* Gaussians are a poor model of points on the probability simplex (soft labels
       pile up near its corners; their covariance is singular). We fit them in the simplex's
       log-ratio (CLR) coordinates ``log p - mean(log p)``: logistic-normal class models. For
       ``p = softmax(logits / T)`` these are the row-centred logits over T, so no softmax is
       computed and, as everything below is invariant to scale, T drops out.
    2. *Projection.* The centred outputs are projected on their top ``dim`` (at most n/2)
       principal directions and whitened (total covariance = I): exact PCA from the smaller Gram
       matrix up to 2,048, a seeded randomized SVD above. Every model is compared in the same
       number of dimensions, and the score ignores the logits' scale (calibration, temperature)
       and per-sample shifts (as softmax does), so models with different C_s are on one scale.
       Whitening also sets the shrinkage target of step 3 to the total covariance's shape; on
       the synthetic zoo below it ranked better than PCA without whitening with 4-8 samples per
       class (tau 0.63-0.82 against 0.35-0.72) and within 0.04 of it with 30.
    3. *Covariances.* The pooled within-class covariance is shrunk by OAS toward a scaled
       identity; each class covariance is its own scatter shrunk toward the pooled one with
       ``dim`` pseudo-samples (an inverse-Wishart posterior mean). Classes smaller than the
       dimension, even 1-sample classes, get well-conditioned Gaussians, where SMS's 1e-6 ridge
       makes it rate every model 1.0.
    4. *Separation.* Per pair, a Bhattacharyya distance D_ij, de-biased for the noise of the
       estimated means (:func:`_pairwise_separation`); exp(-D_ij) bounds the pair's Bayes error.
       With class frequencies pi, ``E = sum_ij w_ij exp(-D_ij)``, ``w_ij ~ sqrt(pi_i pi_j)``
       summing to 1, bounds the error of the mixture (union bound, normalised).
    5. *Score* = ``-log E`` in nats: >= 0, 0 = no evidence that any pair separates, finite
       (the 1e-6 covariance floor caps it). Monotone in the error bound, so it ranks like the
       bound, but where ``1 - E`` or SMS round to 1.0 it keeps ordering models whose classes are
       all far apart (computed with logsumexp, never underflows). Confusable pairs dominate, as
       they dominate the error of a classifier.

    On a synthetic zoo (class-structured ReLU features, random heads with 100 or 1000 outputs,
    logit scales 1 and 4, nuisance directions; truth = linear-probe accuracy; 5 settings from
    4 to 30 samples per class, 16 models each) its Kendall tau with the truth was 0.63-0.82,
    against 0.08-0.25 for SMS, -0.27-0.40 for I-SMS and 0.17-0.32 for this same pipeline fed
    the soft labels themselves instead of their log-ratios. Synthetic data favour Gaussian
    models; the real-model benchmark has the last word.

    Cost O(n C_s min(n, C_s) + min(n, C_s)^2 dim) for the projection, then O(n dim^2 +
    C_t^2 dim^3). ``seed`` only matters when both n and C_s exceed 2,048.
    """
    dim = _check_dim(dim)
    seed = _check_seed(seed)
    _, groups = _class_groups(labels, min_size=1, metric="sms+")
    z = logits - logits.mean(axis=1, keepdims=True)  # CLR of the soft labels, times T
    z -= z.mean(axis=0)
    x = _principal_whitened(z, dim, seed)
    if x.shape[1] == 0:
        return 0.0  # every sample has the same soft labels: nothing separates
    return separation_score(x, groups)


def separation_score(x: np.ndarray, groups: list[np.ndarray]) -> float:
    """Steps 3-5 of :func:`sms_plus` on whitened coordinates ``x`` (n, m) and class row groups:
    shrinkage class Gaussians, de-biased pairwise Bhattacharyya distances, ``-log`` of the
    weighted pairwise error bound. Shared by ``sms+`` (soft labels) and ``fsms`` (features)."""
    n, m = x.shape
    counts = np.array([g.size for g in groups], dtype=np.float64)
    means = np.stack([x[g].mean(axis=0) for g in groups])
    scatters = np.stack([_scatter(x[g], mu) for g, mu in zip(groups, means, strict=True)])
    pooled = _oas(np.tensordot(counts, scatters, axes=1) / n, dof=max(n - len(groups), 1))
    prior = float(m)  # pseudo-samples of the pooled covariance in each class covariance
    covs = counts[:, None, None] * scatters + prior * pooled
    covs /= (counts - 1.0 + prior)[:, None, None]
    covs[:, np.arange(m), np.arange(m)] += SMS_PLUS_RIDGE
    ii, jj, dist = _pairwise_separation(means, covs, counts)
    w = np.sqrt(counts[ii] * counts[jj])
    return max(0.0, -float(logsumexp(-dist, b=w / w.sum())))
