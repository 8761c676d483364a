"""The fused Triton selection (``training/comm/triton_kernels.py``, issue 19) against plain
torch references.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; with one, on CUDA
compiled, and the hooks' steady state runs under ``torch.cuda.set_sync_debug_mode("error")``
as in ``test_comm_cuda.py`` (on the CPU the host-read guard of ``test_comm_nosync.py``
records what would be a sync instead). Triton runs in one mode per process, fixed when
``triton.language`` is first imported (its own library, ``tl.sum`` and the like, is jitted
then): so on a machine without CUDA, where compiled kernels cannot run anyway, this module
sets ``TRITON_INTERPRET=1`` for its process before anything imports triton, and the check
that the kernels compile for an H100 runs in a fresh process.

What is guaranteed, and checked here: exactly ``k`` pairs per block; the set is the ``k``
largest ``|x|`` (NaN above +inf, as ``torch.topk`` ranks it), and among elements equal to
the k-th largest the lowest positions, which an independent stable sort gives; positions
ascending; the wire values rounded as ``exchange.round_to`` rounds them and ``x`` left with
what they did not carry. ``torch.topk`` (the plain path) takes an unspecified subset of such
ties, so it is compared only where the k-th largest is untied. The interpreter is slow (each
Triton op is a few numpy calls): sizes are small, one tile per program except in the test
that checks the running counts across tiles and programs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import zoopick.training.comm as comm
from tests import comm_harness
from tests.host_sync_guard import no_host_reads
from zoopick.training.comm import select, spardl, triton_kernels
from zoopick.training.comm.exchange import round_to

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
if HAS_TRITON and not CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # this process's Triton mode (module docstring)
    import triton.language  # noqa: F401  (jits triton's library in that mode now)
INTERPRETED = HAS_TRITON and not CUDA and triton_kernels.interpreting()

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
    # the interpreter computes inf - inf and inf * 0 in numpy, as a GPU does, and numpy warns
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


@pytest.fixture
def device(monkeypatch) -> torch.device:
    """CUDA (compiled kernels) where present, else the CPU through the interpreter (one
    tile per program, for speed)."""
    if CUDA:
        return torch.device("cuda")
    if not INTERPRETED:
        pytest.skip("triton was imported in compiled mode before this module (no CUDA here)")
    monkeypatch.setattr(triton_kernels, "TILES", 1)
    return torch.device("cpu")


def stable_topk(x: torch.Tensor, starts, lengths, k: int) -> torch.Tensor:
    """Reference: per block the positions of the k largest ``|x|``, ties to the lowest
    positions (a stable descending sort), ascending; ``(blocks, k)``."""
    rows = []
    for s, n in zip(starts, lengths, strict=True):
        order = torch.sort(x[s : s + n].abs(), descending=True, stable=True).indices[:k]
        rows.append(torch.sort(order + s).values)
    return torch.stack(rows)


def take(device, x: torch.Tensor, starts, lengths, k: int, dtype=torch.float32, hist1=None):
    """``take_topk`` on a copy of the CPU tensor ``x`` on ``device``, results back on the
    CPU: (positions, payload, residual)."""
    dev_x = x.to(device, copy=True)
    where = triton_kernels.blocks(starts, lengths, device)
    pos, pay = triton_kernels.take_topk(dev_x, where, k, dtype, hist1)
    return pos.cpu(), pay.cpu(), dev_x.cpu()


def expected_residual(x: torch.Tensor, pos: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The plain path's residual: ``x`` with what the rounded payload carries taken out."""
    out = x.clone()
    flat = pos.flatten()
    _, seen = round_to(x[flat], dtype)
    return out.index_add_(0, flat, -seen)


@pytest.fixture(params=[True, False], ids=["bracket", "radix"])
def bracket(request, monkeypatch) -> bool:
    """Both ways to find the k-th largest key: the sample's bracket (the default, with the
    radix levels where it misses) and the radix levels alone."""
    monkeypatch.setattr(triton_kernels, "BRACKET", request.param)
    return request.param


def test_topk_takes_exactly_the_k_largest_of_every_block(device, bracket):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3600, generator=g)
    starts, lengths, k = (5, 1600, 2700), (1537, 1000, 777), 23  # odd, unequal, with gaps
    pos, pay, res = take(device, x, starts, lengths, k)
    assert pos.shape == (3, k)
    assert torch.equal(pos, stable_topk(x, starts, lengths, k))
    for row, s, n in zip(pos, starts, lengths, strict=True):  # untied data: torch.topk's set
        plain = torch.topk(x[s : s + n].abs(), k).indices + s
        assert set(row.tolist()) == set(plain.tolist())
    assert torch.equal(pay, x[pos])
    assert torch.equal(res, expected_residual(x, pos))


def test_ties_nan_inf_and_zeros(device, bracket):
    g = torch.Generator().manual_seed(2)
    zeros = torch.zeros(300)
    tied = torch.randint(-3, 4, (401,), generator=g).float()  # ties cut at the k-th
    odd = torch.randn(351, generator=g)
    odd[[3, 40, 41]] = float("nan")
    odd[[7, 100]] = float("inf")
    odd[[8, 200]] = float("-inf")
    odd[9] = -0.0
    x = torch.cat([zeros, tied, odd])
    starts, lengths, k = (0, 300, 701), (300, 401, 351), 40
    pos, pay, res = take(device, x, starts, lengths, k)
    assert torch.equal(pos, stable_topk(x, starts, lengths, k))
    assert torch.equal(pos[0], torch.arange(k))  # all zero: the first k positions
    assert {704, 741, 742, 708, 801, 709, 901} <= set(pos[2].tolist())  # NaN, then the infs
    torch.testing.assert_close(pay, x[pos], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(res, expected_residual(x, pos), rtol=0, atol=0, equal_nan=True)


def test_density_one_is_the_dense_exchange(device):
    x = torch.randn(999, generator=torch.Generator().manual_seed(3))
    pos, pay, res = take(device, x, (0,), (999,), 999)
    assert torch.equal(pos[0], torch.arange(999))
    assert torch.equal(pay[0], x)
    assert torch.equal(res, torch.zeros(999))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_wire_values_round_as_the_plain_path(device, dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(700, generator=g) * torch.logspace(-6, 6, 700)
    x[[10, 11]] = torch.tensor([7e4, -1e5])  # beyond float16's range: clamped there
    x[12] = float("nan")
    x[13] = 3.0e38  # rounds up to bfloat16's infinity
    pos, pay, res = take(device, x, (0,), (700,), 60, dtype)
    assert torch.equal(pos, stable_topk(x, (0,), (700,), 60))
    want, _ = round_to(x[pos], dtype)
    torch.testing.assert_close(pay, want, rtol=0, atol=0, equal_nan=True)
    want_res = expected_residual(x, pos, dtype)
    torch.testing.assert_close(res, want_res, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("sample", [32768, 48], ids=["whole", "sampled"])
def test_running_counts_across_tiles_and_programs(device, monkeypatch, bracket, sample):
    """Several programs of several tiles per block, ties spread over all of them: the
    cumulative counts that place each program's pairs and cut the ties (and, bracketed,
    the band's slots taken across programs; sampled, these ties overflow the band)."""
    if not bracket and sample != 32768:
        pytest.skip("the sample serves the bracket only")
    monkeypatch.setattr(triton_kernels, "TILE", 128)
    monkeypatch.setattr(triton_kernels, "TILES", 3)
    monkeypatch.setattr(triton_kernels, "SAMPLE", sample)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-4, 5, (1900,), generator=g).float()
    starts, lengths = (0, 1000), (1000, 900)  # 3 programs of 3 tiles each
    for k in (1, 250, 333):
        pos, _, res = take(device, x, starts, lengths, k)
        assert torch.equal(pos, stable_topk(x, starts, lengths, k)), k
        assert torch.equal(res, expected_residual(x, pos))


def test_error_feedback_pass_and_its_first_look(device, monkeypatch):
    """``acc += grad`` exactly, the gradient zeroed, and on the way the first radix level of
    every span (top-k blocks, radix levels only: the bracket needs none) or, without spans,
    the moments (GaussianK)."""
    g = torch.Generator().manual_seed(6)
    acc0, grad0 = torch.randn(3000, generator=g), torch.randn(3000, generator=g)
    acc, grad = acc0.to(device, copy=True), grad0.to(device, copy=True)
    plain = triton_kernels.accumulate(acc, grad, [(1500, 2900), (100, 1300)])
    total = acc0 + grad0
    assert torch.equal(acc.cpu(), total) and torch.equal(grad.cpu(), torch.zeros(3000))
    assert plain.hists == {} and plain.moments is None  # the bracketed top-k's pass
    monkeypatch.setattr(triton_kernels, "BRACKET", False)
    acc, grad = acc0.to(device, copy=True), grad0.to(device, copy=True)
    scan = triton_kernels.accumulate(acc, grad, [(1500, 2900), (100, 1300)])
    assert torch.equal(acc.cpu(), total)
    keys = (total.view(torch.int32) & 0x7FFFFFFF) >> 20
    assert set(scan.hists) == {(100, 1300), (1500, 2900)}  # nothing for the gaps
    for lo, hi in scan.hists:
        want = torch.bincount(keys[lo:hi], minlength=triton_kernels.BINS)
        assert torch.equal(scan.hists[(lo, hi)].cpu().long(), want)
    # the selection that starts from that histogram is the one that takes its own
    pos, _, _ = take(device, total, (100,), (1200,), 17, hist1=scan.histogram(100, 1300))
    assert torch.equal(pos, stable_topk(total, (100,), (1200,), 17))
    assert scan.histogram(100, 1300) is None  # used once

    acc, grad = acc0.to(device, copy=True), grad0.to(device, copy=True)
    parts = triton_kernels.accumulate(acc, grad, []).moments.cpu().double()
    assert torch.equal(acc.cpu(), total)
    n = parts[:, 0].sum()
    mean = (parts[:, 0] * parts[:, 1]).sum() / n
    m2 = (parts[:, 2] + parts[:, 0] * (parts[:, 1] - mean) ** 2).sum()
    assert n == 3000
    torch.testing.assert_close(mean, total.double().mean(), rtol=0, atol=1e-6)
    torch.testing.assert_close((m2 / (n - 1)).sqrt(), total.double().std(), rtol=1e-6, atol=0)
    held = triton_kernels.accumulate(acc, grad, [(0, 3000)], keep=False)
    assert held.hists == {} and held.moments is None


def layered(n_layers: int, size: int, seed: int) -> torch.Tensor:
    """A gradient-like vector: layers of different scales (1e-4 to 1, log-spaced, shuffled)
    and tails (Student-t, 3 degrees of freedom), concatenated as a bucket holds them."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-4, 0, n_layers)[torch.randperm(n_layers, generator=g)]
    t = torch.distributions.StudentT(3.0)
    torch.manual_seed(seed)
    return torch.cat([t.sample((size,)) * sc for sc in scales])


def bracketed(device, x: torch.Tensor, starts, lengths, k: int) -> torch.Tensor:
    """``_bracket``'s state rows for ``x`` (on the CPU): (prefix, ties, done, T, taken)."""
    dev_x = x.to(device, copy=True)
    where = triton_kernels.blocks(starts, lengths, device)
    state = torch.zeros(len(starts), triton_kernels.STATE, dtype=torch.int64, device=device)
    triton_kernels._bracket(dev_x, where, k, state)
    assert torch.equal(dev_x.cpu().view(torch.int32), x.view(torch.int32))  # unchanged
    return state.cpu()


def kth_key(x: torch.Tensor, s: int, n: int, k: int) -> tuple[int, int]:
    """Reference: the k-th largest key of ``x[s:s + n]`` and how many keys equal to it the
    k largest hold (a plain sort of ``|x|``'s bits)."""
    keys = (x[s : s + n].view(torch.int32) & 0x7FFFFFFF).long()
    t = int(torch.sort(keys, descending=True).values[k - 1])
    return t, k - int((keys > t).sum())


@pytest.mark.parametrize(
    ("k", "values"),
    [(1, "layered"), (40, "layered"), (333, "layered"), (1500, "layered"), (333, "quantized")],
)
def test_bracket_finds_the_kth_key_from_a_sample(device, monkeypatch, k, values):
    """Sampled (64 keys of blocks of 1,500 to 2,300), on a layered bucket: the bracket
    holds the k-th key in every block, so no radix level is needed, and ``T`` and the ties
    at it are the plain sort's; the whole selection is then the stable reference's.
    ``k = 1500``: the whole of the shortest block (density 1 there). Quantized: 200
    magnitudes, 11 to 21 keys tied at ``T``, which the band holds, counted 4 at a time
    (``TIE_STEP``)."""
    monkeypatch.setattr(triton_kernels, "SAMPLE", 64)
    x = layered(12, 500, seed=k)
    if values == "quantized":
        monkeypatch.setattr(triton_kernels, "TIE_STEP", 4)
        g = torch.Generator().manual_seed(13)
        x = torch.randint(1, 201, (6000,), generator=g) / 10.0 * x.sign()
    starts, lengths = (0, 1600, 3800), (1500, 2200, 2200)
    state = bracketed(device, x, starts, lengths, k)
    for row, s, n in zip(state, starts, lengths, strict=True):
        assert row[2] == 1, row  # done by the bracket
        assert (int(row[3]), int(row[1])) == kth_key(x, s, n, k)
    if values == "quantized":  # ties to take, counted over several steps of 4
        assert state[:, 1].tolist() == [1, 18, 3]  # of 11, 21 and 11 tied at T
        assert row[4] == k
    pos, pay, res = take(device, x, starts, lengths, k)
    assert torch.equal(pos, stable_topk(x, starts, lengths, k))
    assert torch.equal(res, expected_residual(x, pos))


def random_bucket(g: torch.Generator, n: int, kind: int) -> torch.Tensor:
    """One of the value shapes a bucket can take: Gaussian, heavy-tailed layers, coarse
    quantization (ties), mostly exact zeros, subnormals, NaN and infinities sprinkled."""
    x = torch.randn(n, generator=g)
    if kind == 1:
        x = x / torch.rand(n, generator=g).clamp_min(1e-3) ** 0.5  # heavy tails
        x *= torch.logspace(-4, 0, 8)[torch.randint(0, 8, (1,), generator=g)]
    elif kind == 2:
        x = torch.round(x * 4) / 4  # a few dozen magnitudes
    elif kind == 3:
        x[torch.rand(n, generator=g) < 0.97] = 0.0  # often fewer nonzeros than k
    elif kind == 4:
        x = x * 1e-42  # subnormal keys
    elif kind == 5:
        spots = torch.randint(0, n, (6,), generator=g)
        x[spots] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38])
    return x


@pytest.mark.parametrize("seed", range(12))
def test_bracket_against_the_reference_on_random_buckets(device, monkeypatch, seed):
    """A seeded sweep: 1 to 3 blocks of 40 to 2,500 keys, ``k`` anywhere from 1 to the
    shortest block, a sample of 16 or 64 keys (the bracket misses or overflows in some,
    so both ways run) or the whole block, six value shapes. The selection is always the
    stable reference's, exactly ``k`` a block, and the residual the plain path's."""
    g = torch.Generator().manual_seed(100 + seed)
    monkeypatch.setattr(triton_kernels, "SAMPLE", (16, 64, 32768)[seed % 3])
    count = int(torch.randint(1, 4, (1,), generator=g))
    lengths = [int(n) for n in torch.randint(40, 2500, (count,), generator=g)]
    starts = [sum(lengths[:i]) + 3 * i for i in range(count)]  # with gaps
    x = random_bucket(g, starts[-1] + lengths[-1] + 5, kind=seed % 6)
    k = int(torch.randint(1, min(lengths) + 1, (1,), generator=g))
    pos, pay, res = take(device, x, starts, lengths, k)
    assert pos.shape == (count, k)
    assert torch.equal(pos, stable_topk(x, starts, lengths, k))
    torch.testing.assert_close(pay, x[pos], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(res, expected_residual(x, pos), rtol=0, atol=0, equal_nan=True)


def test_bracket_counts_each_program_as_the_count_pass_would(device, monkeypatch):
    """The band pass and ``_tally`` leave, per program of a bracketed block, the keys above
    ``T`` and at it (what ``_emit``'s count pass would count: a plain count over each
    program's range here), and that pass then leaves those counts alone (no read)."""
    monkeypatch.setattr(triton_kernels, "TILE", 128)
    monkeypatch.setattr(triton_kernels, "SAMPLE", 64)
    g = torch.Generator().manual_seed(14)
    x = torch.randint(1, 60, (4200,), generator=g) / 7.0  # ties spread over programs
    starts, lengths, k = (0, 2100), (2000, 2100), 300
    dev_x = x.to(device)
    where = triton_kernels.blocks(starts, lengths, device)
    state = torch.zeros(2, triton_kernels.STATE, dtype=torch.int64, device=device)
    counts, _ = triton_kernels._bracket(dev_x, where, k, state)
    assert state[:, 0].tolist() == [triton_kernels.COUNTED] * 2  # both bracketed
    span = triton_kernels.TILE * triton_kernels.TILES
    keys = (x.view(torch.int32) & 0x7FFFFFFF).long()
    for b, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        t = int(state[b, 3])
        for p in range(where.programs()):
            part = keys[s + p * span : s + min(n, (p + 1) * span)]
            want = [int((part > t).sum()), int((part == t).sum())]
            assert counts[b, :, p].tolist() == want, (b, p)
    marked = torch.full_like(counts, -7)
    kern = triton_kernels._kernels()
    kern.emit[(where.programs(), 2)](
        dev_x, where.starts, where.lengths, where.bounds, state, marked, marked, dev_x, marked,
        k, WRITE=False, VALUE=0, PAD=False, TILE=triton_kernels.TILE, TILES=triton_kernels.TILES,
    )  # fmt: skip
    assert bool((marked == -7).all())  # skipped: bracketed blocks keep the band's counts


def test_a_misleading_sample_falls_back_to_the_radix_levels(device, monkeypatch):
    """Blocks whose sample lies: in block 0 the sampled positions hold zeros and the rest
    is large (the band sits below ``T``); in block 1 the sampled positions hold the only
    large values (the band sits above it); block 2 is all ties at one value (the band
    overflows). None is done by the bracket, and the radix levels then select each
    exactly as the reference does."""
    monkeypatch.setattr(triton_kernels, "SAMPLE", 32)
    n, k = 1000, 50
    starts, lengths = (0, 1000, 2000), (n, n, n)
    plan = triton_kernels.bracket_plan(lengths, k, torch.device("cpu"))
    present = torch.arange(plan.width) < plan.sampled[:, None]
    sampled = (plan.positions.long() + torch.tensor(starts)[:, None])[present]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3000, generator=g) + 10.0
    x[sampled[sampled < 1000]] = 0.0
    x[1000:2000] = torch.rand(1000, generator=g) * 1e-3
    x[sampled[(sampled >= 1000) & (sampled < 2000)]] = 5.0
    x[2000:] = -2.5
    state = bracketed(device, x, starts, lengths, k)
    assert not state.any()  # all left to the radix levels
    pos, _, res = take(device, x, starts, lengths, k)
    assert torch.equal(pos, stable_topk(x, starts, lengths, k))
    assert torch.equal(res, expected_residual(x, pos))


def test_the_tables_a_selection_reads_are_collected(device):
    """``holding`` yields every cached device table the kernels inside read (what a CUDA
    graph captured there must keep alive: the caches may evict them), and nothing
    outside it."""
    x = torch.randn(2000, generator=torch.Generator().manual_seed(12)).to(device)
    grad = torch.zeros_like(x)
    with triton_kernels.holding() as tables:
        triton_kernels.accumulate(x, grad, [(0, 2000)])
        where = triton_kernels.blocks((0,), (2000,), device)
        triton_kernels.take_topk(x, where, 20)
    # the plan is cached per device as the tensors name it ("cuda:0", not "cuda")
    plan = triton_kernels.bracket_plan((2000,), 20, x.device)
    assert any(t is where for t in tables) and any(t is plan for t in tables)
    assert all(isinstance(t, triton_kernels.Spans | triton_kernels.BracketPlan) for t in tables)
    triton_kernels.take_topk(x, where, 20)
    assert triton_kernels._held.tables is None


def test_bracket_plan_is_stratified_and_bounded():
    """The plan's sample: one position in each stratum of every block (its floor; inside the
    block, a shorter block sampled whole), the ranks bracketing ``c = k s / n``, and the
    band's capacity never more than the block."""
    lengths, k = (100_000, 5000, 1_000_000), 5000
    plan = triton_kernels.bracket_plan(lengths, k, torch.device("cpu"))
    s = triton_kernels.SAMPLE
    assert plan.positions.shape == (3, s)
    for row, have, n in zip(plan.positions, plan.sampled, lengths, strict=True):
        got = row[:have].long()
        width = min(s, n)
        assert got.numel() == width and bool((got >= 0).all()) and bool((got < n).all())
        strata = torch.arange(width + 1, dtype=torch.float64) * (n / width)
        assert bool((got >= strata[:-1].floor()).all()) and bool((got <= strata[1:]).all())
    c = k * s / lengths[2]
    assert 0 <= plan.upper[2] < c < plan.lower[2]  # both ends bounded
    assert plan.lower[1] == -1  # 5000 of 5000 wanted: the band reaches key 0
    few = triton_kernels.bracket_plan(lengths, 50, torch.device("cpu"))
    assert few.upper[2] == -1  # c = 1.6: no sampled key can be trusted to lie above T
    assert plan.capacity <= max(lengths)


def gaussiank(device, x: torch.Tensor, k: int, refine: int, dtype=torch.float32):
    """``take_gaussiank`` on a copy of the CPU tensor ``x`` on ``device``, results on the
    CPU: (positions, valid, payload, residual, (threshold, count, mean, std))."""
    dev_x = x.to(device, copy=True)
    cap = select.gaussiank_capacity(k)
    pos, valid, pay, stats = triton_kernels.take_gaussiank(dev_x, k, refine, cap, dtype)
    return pos.cpu(), valid.cpu(), pay.cpu(), dev_x.cpu(), stats.cpu()


@pytest.mark.parametrize("refine", [0, 3])
def test_gaussiank_threshold_and_selection(device, refine):
    x = torch.distributions.Laplace(0.1, 1.0).sample((3000,))  # heavy tails: refinement works
    k = 30
    pos, valid, pay, res, (thr, count, mean, std) = gaussiank(device, x, k, refine)
    ref_thr, ref_count = select.gaussian_threshold(x, k, refine)
    torch.testing.assert_close(thr, ref_thr, rtol=1e-5, atol=0)
    torch.testing.assert_close(mean, x.mean(), rtol=0, atol=1e-6)
    torch.testing.assert_close(std, x.std(), rtol=1e-5, atol=0)
    assert count == torch.count_nonzero(x.abs() >= thr)  # exact at the chosen threshold
    cap = select.gaussiank_capacity(k)
    want, want_valid, _ = select.capped_indices(x, thr, cap)
    taken = pos[valid]
    assert set(taken.tolist()) == set(want[want_valid].tolist())
    m = int(valid.sum())
    assert torch.equal(valid, torch.arange(cap) < m)  # valid first, then padding
    assert torch.equal(taken, torch.sort(taken).values)
    assert not pos[m:].any() and not pay[m:].any()
    assert torch.equal(pay[:m], x[taken])
    assert torch.equal(res, expected_residual(x, taken))


def test_gaussiank_over_capacity_takes_the_largest_lowest_first(device):
    """A bimodal bucket that the Gaussian model misjudges: 300 of 3000 at +-1, the rest 0.
    Every refinement leaves 300 passing, over the capacity of 40: the 40 largest are taken,
    all tied, so the lowest positions."""
    x = torch.zeros(3000)
    ones = torch.randperm(3000, generator=torch.Generator().manual_seed(8))[:300]
    x[ones] = torch.where(ones % 2 == 0, 1.0, -1.0)
    pos, valid, pay, res, (thr, count, _, _) = gaussiank(device, x, 30, 3, torch.float16)
    ref_thr, ref_count = select.gaussian_threshold(x, 30, 3)
    torch.testing.assert_close(thr, ref_thr, rtol=1e-5, atol=0)
    assert count == ref_count == 300
    assert bool(valid.all())
    assert torch.equal(pos, torch.sort(ones).values[:40])
    assert torch.equal(pay, x[pos].half())
    assert torch.equal(res, expected_residual(x, pos))


@pytest.mark.parametrize("case", ["zeros", "nan", "inf"])
def test_gaussiank_degenerate_buckets_select_what_the_plain_path_selects(device, case):
    x = torch.zeros(500)
    if case != "zeros":
        x = torch.randn(500, generator=torch.Generator().manual_seed(9))
        x[17] = float(case)
    pos, valid, pay, res, _ = gaussiank(device, x, 5, 3)
    thr, _ = select.gaussian_threshold(x, 5, 3)
    _, want_valid, _ = select.capped_indices(x, thr, select.gaussiank_capacity(5))
    assert int(valid.sum()) == int(want_valid.sum()) == 0
    assert not pos.any() and not pay.any()
    torch.testing.assert_close(res, x, rtol=0, atol=0, equal_nan=True)


def test_gaussiank_walk_places_each_programs_count(device, monkeypatch):
    """When everything passing fits, the walk hands the write its per-program counts at
    the chosen threshold (those of the threshold counting pass, whose programs read what
    the write's do) and marks the block counted (prefix -1), so the count pass reads
    nothing; the counts are the plain ones of each program's range."""
    monkeypatch.setattr(triton_kernels, "TILE", 128)
    monkeypatch.setattr(triton_kernels, "TILES", 3)  # steps of 128 (gcd with 256)
    seen = {}
    original = triton_kernels._take

    def spy(x, where, bounds, state, k, value_dtype, hist1, valid, counts=None):
        seen.update(state=state.clone().cpu(), counts=counts.clone().cpu())
        return original(x, where, bounds, state, k, value_dtype, hist1, valid, counts)

    monkeypatch.setattr(triton_kernels, "_take", spy)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(15))  # as modelled
    pos, valid, _, _, (thr, count, _, _) = gaussiank(device, x, 30, 3)
    assert seen["state"][0, 0] == triton_kernels.COUNTED and seen["state"][0, 2] == 1
    span = 128 * 3
    for p in range(seen["counts"].shape[2]):
        part = x[p * span : (p + 1) * span].abs()
        assert seen["counts"][0, :, p].tolist() == [int((part >= thr).sum()), 0], p
    assert int(valid.sum()) == int(count)


def test_gaussiank_capacity_never_exceeds_the_bucket(device):
    """``ceil(4k / 3)`` pairs may outnumber a small bucket: as ``capped_indices``, the
    capacity is the bucket's size then."""
    x = torch.randn(10, generator=torch.Generator().manual_seed(10))
    pos, valid, _, res, (thr, _, _, _) = gaussiank(device, x, 9, 3)
    want, want_valid, _ = select.capped_indices(x, thr, select.gaussiank_capacity(9))
    assert pos.shape == want.shape == (10,)
    assert set(pos[valid].tolist()) == set(want[want_valid].tolist())


# -- the hooks on the fused path ----------------------------------------------------------------

SHAPES = [(40, 25), (300,), (63,), (500,)]
HOOKS = {  # (name, options, whether the driver's fused pass runs: not with momentum)
    "spardl_bf16": ("spardl", {"pairs16": "bf16"}, True),
    "spardl_momentum": ("spardl", {"momentum": 0.9}, False),
    "gaussiank_fp16": ("gaussiank", {"fp16": True}, True),
    "gaussiank_momentum": ("gaussiank", {"momentum": 0.9}, False),
}


@pytest.fixture
def world_of_one(device):
    """A process group of one (gloo on the CPU, NCCL on CUDA) in this process."""
    yield from comm_harness.world_of_one(device.type == "cuda")


def run_hook(name, options, device, iters=3, guarded=1):
    """Apply ``iters`` iterations of two buckets (rebuilt after the first, as DDP does);
    the last ``guarded`` under the device's sync check. Returns (per iteration the bucket
    outputs, per parameter the summed outputs, the summed gradients and the residual, the
    host reads found)."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.zeros(s, device=device) for s in SHAPES]
    state, hook = comm.make_hook(name, density=0.05, **options)
    outs, found = [], []
    applied = [torch.zeros(s).flatten() for s in SHAPES]
    grad_sum = [torch.zeros(s).flatten() for s in SHAPES]
    for it in range(iters):
        split = [[0, 1], [2, 3]] if it == 0 else [[3, 0], [1, 2]]
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        buckets = [
            comm.SimpleBucket(
                [params[i] for i in m], [grads[i].to(device) for i in m], index=b, is_last=b == 1
            )
            for b, m in enumerate(split)
        ]
        if it < iters - guarded:
            got = [hook(state, bucket).wait().cpu() for bucket in buckets]
        elif device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = [hook(state, bucket).wait() for bucket in buckets]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            got = [o.cpu() for o in got]
        else:
            with no_host_reads() as reads:
                got = [hook(state, bucket).wait().clone() for bucket in buckets]
            found += reads
        outs.append(got)
        for members, out in zip(split, got, strict=True):
            off = 0
            for i in members:
                n = applied[i].numel()
                applied[i] += out[off : off + n]
                grad_sum[i] += grads[i].flatten()
                off += n
    residuals = [state.residuals.get(p).cpu().flatten() for p in params]
    return outs, (applied, grad_sum, residuals), found


@pytest.mark.parametrize("key", list(HOOKS))
def test_hooks_on_the_fused_path(device, world_of_one, monkeypatch, bracket, key):
    """The same applied updates and residuals as the plain device path (CPU shortcuts
    off; on CUDA GaussianK's moments differ from torch's in the last bits, so there
    nothing lost is checked instead), nothing read on the host in the steady state, and
    the fused kernels did run (spardl's whole bucket is a scan span here, so without the
    bracket its first radix level comes from the error-feedback pass)."""
    name, options, fused_pass = HOOKS[key]
    if name != "spardl" and not bracket:
        pytest.skip("the bracket is spardl's (top-k) only")
    monkeypatch.setattr(select, "CPU_SHORTCUTS", False)
    monkeypatch.setattr(spardl, "SAMPLED_MIN_NUMEL", 0)
    plain = run_hook(name, options, device)
    calls: list[str] = []
    for fn in ("accumulate", "take_topk", "take_gaussiank"):
        original = getattr(triton_kernels, fn)

        def counted(*args, _fn=fn, _original=original, **kwargs):
            calls.append(_fn)
            if _fn == "take_topk":
                calls.append("hist1" if args[4] is not None else "own")
            return _original(*args, **kwargs)

        monkeypatch.setattr(triton_kernels, fn, counted)
    monkeypatch.setattr(select, "CUDA_TRITON", True)
    outs, (applied, grad_sum, residuals), found = run_hook(name, options, device)
    expected = "take_topk" if name == "spardl" else "take_gaussiank"
    assert calls.count(expected) == 6
    assert calls.count("accumulate") == (6 if fused_pass else 0)
    if name == "spardl":
        levels_first = 0 if triton_kernels.BRACKET else calls.count("accumulate")
        assert calls.count("hist1") == levels_first
    assert found == []
    if device.type == "cpu" or name == "spardl":
        for a, b in zip(plain[0], outs, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(plain[1][2], residuals, strict=True))
    if not options.get("momentum"):  # nothing lost: applied + residual = summed gradients
        for a, g, r in zip(applied, grad_sum, residuals, strict=True):
            torch.testing.assert_close(a + r, g, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["spardl", "gaussiank"])
def test_a_held_out_parameter_on_the_fused_path(device, world_of_one, monkeypatch, name):
    """A parameter this rank did not use (``grad`` None) is held out of the exchange after
    the fused error-feedback pass: the pass's first look is dropped (``Scan.changed``; it
    was missing, an AttributeError on CUDA), the update and the residuals are the plain
    path's, and the unused parameter keeps its residual."""
    monkeypatch.setattr(select, "CPU_SHORTCUTS", False)
    monkeypatch.setattr(spardl, "SAMPLED_MIN_NUMEL", 0)

    def once(fused: bool):
        monkeypatch.setattr(select, "CUDA_TRITON", fused)
        gen = torch.Generator().manual_seed(4)
        params = [torch.zeros(s, device=device, requires_grad=True) for s in SHAPES]
        state, hook = comm.make_hook(name, density=0.05)
        outs = []
        for _ in range(3):
            grads = [torch.randn(s, generator=gen).to(device) for s in SHAPES]
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                p.grad = None if i == 1 else g
            bucket = comm.SimpleBucket(params, grads)
            outs.append(hook(state, bucket).wait().cpu())
        return outs, [state.residuals.get(p).cpu() for p in params]

    plain_outs, plain_res = once(False)
    outs, res = once(True)
    assert torch.count_nonzero(res[1]) > 0  # the unused parameter's residual is kept
    for a, b in zip(plain_outs, outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0 if name == "spardl" else 1e-6)
    for a, b in zip(plain_res, res, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0 if name == "spardl" else 1e-6)


COMPILE = "from zoopick.training.comm import triton_kernels as t; print(len(t.compile_variants()))"


@pytest.mark.skipif(CUDA, reason="the CUDA tests above compile and run every kernel")
def test_kernels_compile_for_an_h100(tmp_path):
    """Every kernel variant the hooks launch compiles to a cubin for sm_90 (an H100) without
    a GPU: compiled Triton is stricter than the interpreter the tests above run (only
    constexpr globals, fixed loop-carried types), so this is what shows before a GPU is
    lent that the kernels build for one. A fresh process (the module docstring)."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, and nothing under ~/.triton
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == sum(len(v) for _, v in triton_kernels.VARIANTS.values())


def test_the_fused_path_is_a_run_option_not_an_environment_variable(tmp_path):
    """The library reads no ``ZOOPICK_COMM_TRITON``: a process with it set still selects with
    ``torch.topk`` until a run's config says otherwise (``FinetuneConfig.comm_triton``, which
    ``tests/test_finetune.py`` checks the trainer applies). ``zoopick train`` takes the
    variable (or ``--comm-triton``) at its boundary and writes it into the run's config, and
    the service's settings hand it to every run a job starts (``Settings.comm_triton``)."""
    import json
    from pathlib import Path

    import numpy as np
    from typer.testing import CliRunner

    from tests.conftest import tiny_arrays
    from zoopick.cli import app

    code = "from zoopick.training.comm import select; print(select.cuda_triton())"
    env = os.environ | {"ZOOPICK_COMM_TRITON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr

    x, y, _ = tiny_arrays()
    np.savez(tmp_path / "d.npz", x=x, y=y)
    zoo = tmp_path / "zoo.yaml"
    zoo.write_text("models:\n- {id: tiny, arch: resnet10t, weights: none, num_classes: 3}\n")
    base = ["train", "--zoo", str(zoo), "--model", "tiny", "--data", str(tmp_path / "d.npz")]
    written = {}
    for value in ("1", "0", None, "flag"):
        args = [*base, "--out", str(tmp_path / f"run-{value}"), "--write-config"]
        if value == "flag":
            args.append("--comm-triton")
        extra = {} if value in (None, "flag") else {"ZOOPICK_COMM_TRITON": value}
        done = CliRunner().invoke(app, args, env=extra)
        assert done.exit_code == 0, done.output
        written[value] = json.loads(Path(done.output.strip()).read_text())["comm_triton"]
    assert written == {"1": True, "0": False, None: False, "flag": True}
