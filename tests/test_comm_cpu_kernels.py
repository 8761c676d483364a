"""The compiled single pass (``training/comm/cpu_kernels.py``) against plain torch and numpy.

The pass must give ``residual + gradient`` bit for bit, zero the gradient and list exactly
the positions above its pre-threshold; a selection on its candidates must return the very
tensor the plain path (``select.CPU_GROUPED = False``: ``|x|``, a full mask, ``topk``) returns,
also after ``acc`` changed between the pass and the selection, and when it has to fall back.
The hooks on two gloo workers are compared in tests/test_comm_hooks.py
(``test_cpu_paths_change_no_bit``).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

import zoopick.training.comm as comm
from zoopick.training.comm import select

cpu_kernels = pytest.importorskip("zoopick.training.comm.cpu_kernels")


def _plain_topk(monkeypatch, x: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: the sampled selection with the plain scan."""
    with monkeypatch.context() as m:
        m.setattr(select, "CPU_GROUPED", False)
        return select.topk_indices(x, k)


def _same_set(got: torch.Tensor, expect: torch.Tensor) -> bool:
    """The same positions, in any order (the hooks sum pairs by position)."""
    return torch.equal(got.sort().values, expect.sort().values)


def _pass(res: torch.Tensor, grad: torch.Tensor, spans, density: float):
    """``cpu_kernels.accumulate`` on copies: (acc, spent gradient, scan)."""
    acc, spent = res.clone(), grad.clone()
    return acc, spent, cpu_kernels.accumulate(acc, spent, spans, density)


def _cases(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Residuals for the selection: heavy tails, large values in runs, exact and negative
    zeros with NaN and infinities (an odd length), ties at zero (the sample sees only
    zeros), a sample holding the only large values (fewer than k pass: the fallback), a NaN
    in the sample (a NaN threshold) and all zeros."""
    n = 100_003
    heavy = torch.randn(n, generator=gen) * torch.randn(n, generator=gen).exp()
    runs = torch.randn(80_000, generator=gen) * 0.01
    for start in (0, 12_345, 79_000):
        runs[start : start + 600] += torch.randn(600, generator=gen)
    odd = torch.randn(70_001, generator=gen)
    odd[::3] = 0.0
    odd[1::5] = -0.0
    odd[[7, 8_750, 70_000]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    spiky = torch.zeros(200_000)
    spiky[torch.randperm(200_000, generator=gen)[:3000]] = 1.0 + torch.rand(3000, generator=gen)
    spiky[::97] = 0.0
    lopsided = torch.randn(200_000, generator=gen) * 0.01
    lopsided[::97] = 100.0 + torch.rand(lopsided[::97].numel(), generator=gen)
    nan_sample = torch.randn(200_000, generator=gen)
    nan_sample[97 * 5] = float("nan")
    return {
        "heavy": heavy,
        "runs": runs,
        "odd": odd,
        "spiky": spiky,
        "lopsided": lopsided,
        "nan_sample": nan_sample,
        "zeros": torch.zeros(65_536),
    }


def _expected_pre_threshold(values: torch.Tensor, k: int) -> float:
    """The pre-threshold by numpy: the ``rank``-th largest of the sparse sample's ``|x|``
    (no NaN in it), raised to the least positive float32."""
    sample = np.abs(values.numpy()[:: cpu_kernels.pre_stride(values.numel())])
    rank = min(
        sample.size, max(1, math.ceil(cpu_kernels.PRE_MARGIN * k * sample.size / values.numel()))
    )
    return max(float(np.sort(sample)[::-1][rank - 1]), float(select.TINY))


def test_pass_sums_zeroes_and_lists_the_candidates():
    """Several spans with gaps, odd lengths (tails after the 64-element words), NaN and
    infinities, density 1.0: ``acc`` is ``residual + gradient`` (NaN where torch gives NaN,
    same sign of zero), the gradient is all zeros, each span lists exactly the positions
    where ``|acc| >= its pre-threshold`` (numpy's) with their ``|acc|``, and keeps the exact
    threshold's sample (``|acc|`` at every 97th position)."""
    gen = torch.Generator().manual_seed(21)
    n = 3 * 64 * 1000 + 12_345
    res = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen) * torch.randn(n, generator=gen).exp()
    grad[[1_006, 150_003, n - 1]] = torch.tensor([float("nan"), float("inf"), float("nan")])
    res[[2_000, 160_001]] = torch.tensor([-float("inf"), -0.0])
    grad[[2_000, 160_001]] = torch.tensor([float("inf"), -0.0])  # inf - inf: NaN; -0 + -0
    spans = [(1_001, 150_000), (150_000, n - 77)]
    expect = res + grad
    for density in (0.01, 1.0):
        acc, spent, scan = _pass(res, grad, spans, density)
        torch.testing.assert_close(acc, expect, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(torch.signbit(acc), torch.signbit(expect))
        assert not torch.count_nonzero(spent)
        assert scan.peaks(0, n) is None
        for lo, hi in spans:
            block = scan.peaks(lo, hi)
            k = select.k_for(density, hi - lo)
            assert float(block.threshold) == _expected_pre_threshold(expect[lo:hi], k)
            passing = torch.nonzero(acc[lo:hi].abs() >= float(block.threshold)).flatten()
            assert torch.equal(block.positions, passing)
            assert torch.equal(block.magnitudes, acc[lo:hi].abs()[passing])
            assert passing.numel() > (k if density < 1 else 0)
            sample = acc[lo:hi][:: select.SAMPLE_STRIDE].abs()  # the exact threshold's
            torch.testing.assert_close(block.sample, sample, rtol=0, atol=0, equal_nan=True)


def test_selection_is_the_plain_paths(monkeypatch):
    """``topk_indices`` on the pass's candidates returns the plain path's positions for
    k = 1, 1000 and n / 8 on every case of ``_cases``: the same set (ascending) where it is
    unique, the very tensor where ties or too few candidates leave the choice to
    ``torch.topk`` (a tie at the k-th value among values of a few levels)."""
    gen = torch.Generator().manual_seed(22)
    before = dict(cpu_kernels.COUNTS)
    for name, res in _cases(gen).items():
        grad = torch.randn(res.numel(), generator=gen) * 1e-3
        n = res.numel()
        for k in (1, 1000, n // 8):
            acc, _, scan = _pass(res, grad, [(0, n)], k / n)
            got = select.topk_indices(acc, k, scratch=torch.empty(n), peaks=scan.peaks(0, n))
            assert _same_set(got, _plain_topk(monkeypatch, acc, k)), (name, k)
            assert got.numel() == k
    # most selections took the candidates; the all-zero input overflows the buffer
    assert cpu_kernels.COUNTS["kernel"] - before.get("kernel", 0) >= 15
    assert cpu_kernels.COUNTS["fallback"] > before.get("fallback", 0)
    levels = torch.randint(1, 200, (100_000,), generator=gen).float()  # ties everywhere
    acc, _, scan = _pass(levels, torch.zeros(100_000), [(0, 100_000)], 0.01)
    tied = cpu_kernels.COUNTS["tied"]
    got = select.topk_indices(acc, 1000, peaks=scan.peaks(0, 100_000))
    assert torch.equal(got, _plain_topk(monkeypatch, acc, 1000))
    acc, _, scan = _pass(levels, torch.zeros(100_000), [(0, 100_000)], 0.01)
    moved = torch.randperm(100_000, generator=gen)[:3000]
    acc[moved] = 199.0  # touched, tied with the largest level: sorted back for torch.topk
    scan.touch(torch.cat([moved, moved[:100]]))
    got = select.topk_indices(acc, 1000, peaks=scan.peaks(0, 100_000))
    assert torch.equal(got, _plain_topk(monkeypatch, acc, 1000))
    assert cpu_kernels.COUNTS["tied"] == tied + 2


def test_changes_between_pass_and_selection(monkeypatch):
    """Between the pass and a block's selection ``acc`` may change at touched positions
    (received pairs: values grown, shrunk or cancelled, sample elements among them; they are
    read anew) or in ranges reported by ``changed`` (a held-out parameter: the block takes
    the torch path); a change reported neither way is missed (so the check can fail). A
    threshold that fell below the pre-threshold, a second selection of the same block and a
    mostly-zero input (the candidates overflow their buffer) take the torch fallback too.
    Every result equals the plain path's."""
    gen = torch.Generator().manual_seed(23)
    n, k = 200_000, 2000
    res = torch.randn(n, generator=gen) * torch.randn(n, generator=gen).exp()
    grad = torch.randn(n, generator=gen) * 0.1
    top = torch.topk((res + grad).abs(), 1200).indices  # candidates of the pass
    grown = torch.randperm(n, generator=gen)[:300]
    samples = torch.arange(0, 97 * 400, 97)  # elements of the exact threshold's sample
    moved = torch.cat([top[::2], top[1::4], grown, samples])

    def receive(report: bool) -> tuple[torch.Tensor, torch.Tensor]:
        acc, _, scan = _pass(res, grad, [(0, n)], k / n)
        acc[top[::2]] = 0.0  # cancelled
        acc[top[1::4]] *= 0.5  # shrunk
        acc[grown] += 100.0 * torch.sign(acc[grown])  # grown past every candidate
        acc[samples] += 30.0  # the sample's values change: so does the exact threshold
        if report:  # two pieces, as pairs arrive
            scan.touch(moved[:700].int())
            scan.touch(moved[700:])
        return acc, select.topk_indices(acc, k, peaks=scan.peaks(0, n))

    before = dict(cpu_kernels.COUNTS)
    acc, got = receive(report=True)
    assert _same_set(got, _plain_topk(monkeypatch, acc, k))
    acc, missed = receive(report=False)
    assert not _same_set(missed, _plain_topk(monkeypatch, acc, k))
    assert cpu_kernels.COUNTS["kernel"] == before.get("kernel", 0) + 2

    acc, _, scan = _pass(res, grad, [(0, n)], k / n)
    acc[1000:1500] = 0.0  # an unused parameter held out
    scan.changed(1000, 1500)
    got = select.topk_indices(acc, k, peaks=scan.peaks(0, n))
    assert _same_set(got, _plain_topk(monkeypatch, acc, k))
    acc[got] = 0.0  # taken out; selected again: read anew
    again = select.topk_indices(acc, k, peaks=scan.peaks(0, n))
    assert _same_set(again, _plain_topk(monkeypatch, acc, k))
    acc, _, scan = _pass(res, grad, [(0, n)], k / n)
    acc[: n // 2] = 0.0  # half the sample is zero now: the exact threshold falls
    scan.touch(torch.arange(n // 2))
    got = select.topk_indices(acc, k, peaks=scan.peaks(0, n))
    assert _same_set(got, _plain_topk(monkeypatch, acc, k))
    sparse = torch.zeros(n)
    sparse[torch.randperm(n, generator=gen)[:20_000]] = torch.randn(20_000, generator=gen)
    sparse[::97] = 0.0  # both samples see only zeros: the thresholds are the least subnormal
    acc, _, scan = _pass(sparse, torch.zeros(n), [(0, n)], 100 / n)
    assert scan.peaks(0, n).positions is None  # the non-zeros overflow the buffer
    got = select.topk_indices(acc, 100, peaks=scan.peaks(0, n))
    assert _same_set(got, _plain_topk(monkeypatch, acc, 100))
    assert cpu_kernels.COUNTS["fallback"] == before.get("fallback", 0) + 4


def test_without_numba_the_torch_path_runs(monkeypatch):
    """numba missing: one warning, no kernels, and the selection is still the plain one."""
    monkeypatch.setitem(sys.modules, "numba", None)  # ``import numba`` raises ImportError
    monkeypatch.delitem(sys.modules, "zoopick.training.comm.cpu_kernels")
    monkeypatch.delattr(comm, "cpu_kernels")
    select._load_cpu_kernels.cache_clear()
    try:
        x = torch.randn(100_000, generator=torch.Generator().manual_seed(24))
        with pytest.warns(RuntimeWarning, match="compiled CPU selection is off"):
            assert select.cpu_kernels(x) is None
        assert select.cpu_kernels(x) is None  # remembered: no second warning, no retry
        assert torch.equal(select.topk_indices(x, 500), _plain_topk(monkeypatch, x, 500))
    finally:
        select._load_cpu_kernels.cache_clear()


def test_compiled_sparse_average_is_the_torch_one(monkeypatch):
    """``PairSum.write`` on the compiled loop gives the torch path's bucket bit for bit (and
    the full division's): P = 2, 3, 7 (inexact quotients), pieces that overlap and repeat a
    position, padding pairs at 0, an empty piece, int32 positions and float16 values."""
    from zoopick.training.comm import exchange

    gen = torch.Generator().manual_seed(25)
    n = 4 * select.SAMPLED_MIN_NUMEL + 3  # pairs under a sixteenth of it: the sparse path
    pieces = [
        (torch.randperm(n, generator=gen)[:3000], torch.randn(3000, generator=gen))
        for _ in range(3)
    ]
    pieces.append((pieces[0][0][:500].int(), torch.randn(500, generator=gen).half()))
    pieces.append((torch.zeros(40, dtype=torch.int32), torch.zeros(40)))  # padding pairs
    pieces.append((torch.empty(0, dtype=torch.int64), torch.empty(0)))
    pairs = sum(i.numel() for i, _ in pieces)
    for P in (2, 3, 7):
        expect = exchange.PairSum(pieces).write(torch.zeros(n)).div_(P)
        for compiled in (True, False):
            monkeypatch.setattr(select, "CPU_KERNEL", compiled)
            out = torch.randn(n, generator=gen)  # stale content: overwritten
            assert exchange.PairSum._compiled(out, P, pairs) is compiled
            got = exchange.PairSum(pieces).write(out, P)
            assert got is out
            assert torch.equal(got, expect), (P, compiled)
            assert torch.equal(torch.signbit(got), torch.signbit(expect))


def test_kth_largest_is_torch_topks_threshold():
    """The compiled threshold is ``torch.topk(values, rank).values.min()``'s value: ranks 1,
    some and all, ties, infinities, zeros, and NaN (torch ranks it highest: the threshold is
    NaN)."""
    gen = torch.Generator().manual_seed(26)
    plain = torch.randn(10_001, generator=gen).abs()
    tied = torch.randint(0, 5, (4000,), generator=gen).float()
    odd = torch.randn(3000, generator=gen).abs()
    odd[[3, 70]] = float("inf")
    odd[100:400] = 0.0
    nan = torch.randn(3000, generator=gen).abs()
    nan[1234] = float("nan")
    for values in (plain, tied, odd, nan):
        for rank in (1, 2, 37, values.numel() // 3, values.numel()):
            expect = torch.topk(values, rank, sorted=False).values.min()
            got = cpu_kernels._kth_largest(values.numpy(), rank)
            torch.testing.assert_close(torch.tensor(got), expect, rtol=0, atol=0, equal_nan=True)


def test_compiled_take_is_the_torch_one():
    """``cpu_kernels.take`` (spardl's float32 take on the CPU) gives the values and the
    residual of ``round_to(x.index_select(0, idx))`` and ``x.index_add_(0, idx, -seen)`` bit
    for bit: finite values leave 0 (+0.0, as ``v + -v`` does), infinities and NaN leave NaN;
    unlisted positions are untouched."""
    from zoopick.training.comm.exchange import round_to

    gen = torch.Generator().manual_seed(26)
    scale = 10.0 ** torch.randint(-30, 30, (50_000,), generator=gen)
    x = torch.randn(50_000, generator=gen) * scale
    x[[3, 7, 11, 13]] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0])
    idx = torch.cat([torch.tensor([3, 7, 11, 13]), torch.randperm(50_000, generator=gen)[:900]])
    idx = idx.unique()[torch.randperm(idx.unique().numel(), generator=gen)]  # distinct, unsorted
    ref = x.clone()
    payload, seen_ref = round_to(ref.index_select(0, idx), torch.float32)
    ref.index_add_(0, idx, -seen_ref)
    got = x.clone()
    seen = cpu_kernels.take(got, idx)
    assert torch.equal(seen.view(torch.int32), payload.view(torch.int32))  # bit for bit
    assert torch.equal(got.view(torch.int32)[~got.isnan()], ref.view(torch.int32)[~ref.isnan()])
    assert torch.equal(got.isnan(), ref.isnan()) and got.isnan()[[3, 7, 11]].all()
    assert int((got[idx] == 0).sum()) == idx.numel() - 3
