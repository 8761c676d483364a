"""Selection primitives against plain numpy / scipy versions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import norm

from zoopick.training.comm.select import (
    even_bounds,
    gaussian_threshold,
    gaussiank_indices,
    k_for,
    threshold_indices,
    topk_indices,
)


def test_k_for_rounds_up_without_float_noise():
    assert k_for(0.07, 100) == 7
    assert k_for(0.01, 1000) == 10
    assert k_for(0.011, 1000) == 11
    assert k_for(0.0001, 10) == 1  # at least one
    assert k_for(1.0, 10) == 10
    assert k_for(0.5, 0) == 0


def test_topk_indices_are_the_largest_magnitudes():
    x = torch.tensor([0.1, -5.0, 3.0, -0.2, 4.0, 0.0])
    assert sorted(topk_indices(x, 3).tolist()) == [1, 2, 4]
    assert topk_indices(x, 10).tolist() == list(range(6))
    assert topk_indices(x, 0).numel() == 0


def test_threshold_indices_skip_zeros():
    x = torch.tensor([0.0, 0.5, -0.5, 0.2, 0.0])
    assert threshold_indices(x, 0.5).tolist() == [1, 2]
    assert threshold_indices(x, 0.0).tolist() == [1, 2, 3]


def _plain_gaussian(a: np.ndarray, k: int) -> tuple[float, int]:
    thr = abs(a.mean()) + a.std(ddof=1) * norm.ppf(1 - k / a.size / 2)
    count = int((np.abs(a) >= thr).sum())
    for _ in range(3):
        if count < 2 * k / 3:
            thr /= 2
        elif count > 4 * k / 3:
            thr *= 1.5
        else:
            break
        count = int((np.abs(a) >= thr).sum())
    return thr, count


@pytest.mark.parametrize("scale", [1.0, 1e-3])
@pytest.mark.parametrize("dist", ["normal", "laplace", "heavy"])
def test_gaussian_threshold_matches_plain_numpy(dist, scale):
    rng = np.random.default_rng(0)
    a = {
        "normal": rng.standard_normal(20_000),
        "laplace": rng.laplace(size=20_000),
        "heavy": rng.standard_t(2, size=20_000),
    }[dist] * scale
    k = 200
    thr, count = gaussian_threshold(torch.from_numpy(a).float(), k)
    ref_thr, ref_count = _plain_gaussian(a.astype(np.float32).astype(np.float64), k)
    assert float(thr) == pytest.approx(ref_thr, rel=1e-4)
    assert abs(count - ref_count) <= 2
    idx = gaussiank_indices(torch.from_numpy(a).float(), k)
    assert idx.numel() == count


def test_gaussian_threshold_is_within_the_refinement_band_on_normal_data():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    _, count = gaussian_threshold(x, 1000)
    assert 2000 / 3 <= count <= 4000 / 3


def test_gaussiank_density_one_selects_everything():
    x = torch.randn(50)
    assert gaussiank_indices(x, 50).tolist() == list(range(50))


def test_even_bounds():
    assert even_bounds(10, 3) == [0, 3, 6, 10]
    assert even_bounds(2, 4) == [0, 0, 1, 1, 2]


def test_sparse_positions_equal_torch_nonzero():
    """The word-wise scan gives torch.nonzero's positions in its order: masks whose length
    is not a multiple of 8 (a tail), a True in the tail only, an unaligned slice, an empty
    and a full mask (the fallback), a single element."""
    from zoopick.training.comm.select import sparse_positions

    gen = torch.Generator().manual_seed(5)
    masks = [
        torch.rand(n, generator=gen) < p
        for n in (1, 7, 8, 9, 1003, 100_001)
        for p in (0.0, 0.01, 0.3, 0.9)
    ]
    tail_only = torch.zeros(1005, dtype=torch.bool)
    tail_only[1001] = True
    masks += [
        tail_only,
        torch.rand(10_000, generator=gen)[3:] < 0.02,
        torch.ones(64, dtype=torch.bool),
    ]
    for mask in masks:
        got = sparse_positions(mask)
        assert got.dtype == torch.int64
        assert torch.equal(got, torch.nonzero(mask).flatten()), mask.numel()
    unaligned = (torch.rand(4099, generator=gen) < 0.05)[3:]
    assert unaligned.data_ptr() % 8
    assert torch.equal(sparse_positions(unaligned), torch.nonzero(unaligned).flatten())


def test_block_topk_is_each_blocks_own_top_k():
    """One batched topk over blocks of uneven length (even_bounds cuts, some one longer)
    picks exactly each block's own top-k; the padding of the shorter blocks is never chosen,
    even when every real value is zero there; k above the shortest block is refused."""
    from zoopick.training.comm.select import Blocks, block_topk_indices, even_bounds

    gen = torch.Generator().manual_seed(9)
    for n, parts, picks in [(1003, 4, (0, 2, 3)), (64, 8, (7, 0, 1)), (10, 3, (0, 1, 2))]:
        x = torch.randn(n, generator=gen)
        bounds = even_bounds(n, parts)
        lengths = [bounds[j + 1] - bounds[j] for j in picks]
        blocks = Blocks.of([bounds[j] for j in picks], lengths, x.device)
        for k in {1, min(lengths)}:
            got = block_topk_indices(x, blocks, k)
            assert got.shape == (len(picks), k)
            for row, j in zip(got, picks, strict=True):
                lo, hi = bounds[j], bounds[j + 1]
                assert set(row.tolist()) == set(
                    (torch.topk(x[lo:hi].abs(), k).indices + lo).tolist()
                )
        with pytest.raises(ValueError, match="shortest"):
            block_topk_indices(x, blocks, min(lengths) + 1)
    zeros = torch.zeros(9)  # blocks [0, 4) and [4, 9): the short one is all zeros
    blocks = Blocks.of([0, 4], [4, 5], zeros.device)
    got = block_topk_indices(zeros, blocks, 4)
    assert set(got[0].tolist()) <= {0, 1, 2, 3} and set(got[1].tolist()) <= set(range(4, 9))
    with pytest.raises(ValueError, match="more than one"):
        Blocks.of([0, 3], [3, 6], zeros.device)


def test_sampled_topk_is_the_exact_top_k():
    """The CPU path for large inputs (sampled threshold + exact trim) returns exactly the
    set torch.topk returns, also where the sample misses (fallback) and on heavy tails."""
    from zoopick.training.comm.select import sampled_topk_indices, topk_indices

    gen = torch.Generator().manual_seed(3)
    cases = [
        torch.randn(200_000, generator=gen),
        torch.randn(200_000, generator=gen) * torch.randn(200_000, generator=gen).exp() * 5,
    ]
    spiky = torch.zeros(200_000)
    spiky[torch.randperm(200_000, generator=gen)[:3000]] = 1.0 + torch.rand(3000, generator=gen)
    spiky[::97] = 0.0  # the sample sees only zeros: the threshold passes everything
    cases.append(spiky)
    lopsided = torch.randn(200_000, generator=gen) * 0.01  # the sample holds the only large
    lopsided[::97] = 100.0 + torch.rand(lopsided[::97].numel(), generator=gen)  # ones: fallback
    cases.append(lopsided)
    for x in cases:
        for k in (1, 2000, 20_000):
            expect = set(torch.topk(x.abs(), k).indices.tolist())
            got = sampled_topk_indices(x, k)
            assert got.numel() == k and len(set(got.tolist())) == k
            if x is spiky:  # ties at zero: compare magnitudes, not positions
                kth = float(torch.topk(x.abs(), k).values.min())
                assert float(x.abs()[got].min()) >= kth
            else:
                assert set(got.tolist()) == expect
            assert set(topk_indices(x, k).tolist()) == set(got.tolist()) or x is spiky


@pytest.mark.parametrize("cap", [5, 60, 400])
def test_capped_indices_device_path_matches_the_cpu_shortcut(monkeypatch, cap):
    """The fixed-capacity selection gives the same positions with and without the CPU
    shortcut (the device path is the one an accelerator runs), checked against a plain
    sort: all positions passing the threshold when they fit, else the ``cap`` largest."""
    from zoopick.training.comm import select

    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    x[::7] = 0.0
    thr = 1.5
    a = x.abs().numpy()
    passing = np.flatnonzero((a >= thr) & (a > 0))
    expect = set(passing[np.argsort(-a[passing])][:cap].tolist())
    for shortcut in (True, False):
        monkeypatch.setattr(select, "CPU_SHORTCUTS", shortcut)
        idx, valid, count = select.capped_indices(x, thr, cap)
        assert idx.numel() == valid.numel() == cap
        assert set(idx[valid].tolist()) == expect and int(count) == passing.size
        assert torch.all(idx[~valid] == 0)
        heavy = torch.from_numpy(np.random.default_rng(0).standard_t(1.0, 5000)).float()
        thr_t, n_t = select.gaussian_threshold(heavy, 50)  # Cauchy: refined 3 times
        assert (float(thr_t), int(n_t)) == pytest.approx(
            _plain_gaussian(heavy.numpy().astype(np.float64), 50), rel=1e-5
        )


def _grouped_cases(gen: torch.Generator) -> list[torch.Tensor]:
    """Inputs for the grouped scan: heavy tails, large values in runs (as in a real gradient),
    exact zeros and negative zeros, NaN and infinities, lengths that leave a tail after the
    groups, and inputs shorter than one group."""
    heavy = torch.randn(100_003, generator=gen) * torch.randn(100_003, generator=gen).exp()
    runs = torch.randn(80_000, generator=gen) * 0.01
    for start in (0, 12_345, 79_000):
        runs[start : start + 600] += torch.randn(600, generator=gen)
    odd = torch.randn(70_001, generator=gen)
    odd[::3] = 0.0
    odd[1::5] = -0.0
    odd[[7, 8_750, 70_000]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    return [heavy, runs, odd, torch.randn(5, generator=gen), torch.zeros(0)]


def test_grouped_positions_equal_the_plain_scan():
    """The grouped scan lists exactly the positions (same order) of the plain scan it
    replaces, ``sparse_positions(|x| >= t)``, for thresholds passing a few, many, all
    non-zeros (the least subnormal) and none; NaN never passes, infinities do."""
    from zoopick.training.comm.select import TINY, grouped_positions, sparse_positions

    gen = torch.Generator().manual_seed(11)
    for x in _grouped_cases(gen):
        for t in (2.5, 0.3, TINY, 1e30):
            for thr in (t, torch.tensor(t)):
                expect = sparse_positions(x.abs() >= thr)
                got = grouped_positions(x, thr)
                assert got.dtype == torch.int64
                assert torch.equal(got, expect), (x.numel(), t)


def test_grouped_sampled_topk_is_bit_identical_to_the_plain_path(monkeypatch):
    """``topk_indices`` on the CPU's sampled path returns the very same tensor with the
    grouped scan as with the plain one (so every hook's update is unchanged): heavy tails,
    runs, ties at zero (the sample sees only zeros), the fallback (the sample holds the only
    large values), and a threshold of NaN (a NaN in the sample)."""
    from zoopick.training.comm import select

    gen = torch.Generator().manual_seed(12)
    cases = _grouped_cases(gen)[:2]
    spiky = torch.zeros(200_000)
    spiky[torch.randperm(200_000, generator=gen)[:3000]] = 1.0 + torch.rand(3000, generator=gen)
    spiky[::97] = 0.0
    lopsided = torch.randn(200_000, generator=gen) * 0.01
    lopsided[::97] = 100.0 + torch.rand(lopsided[::97].numel(), generator=gen)
    nan_sample = torch.randn(200_000, generator=gen)
    nan_sample[97 * 5] = float("nan")
    cases += [spiky, lopsided, nan_sample]
    for x in cases:
        for k in (1, 1000, x.numel() // 8):
            got = {}
            for grouped in (False, True):
                monkeypatch.setattr(select, "CPU_GROUPED", grouped)
                got[grouped] = (
                    select.topk_indices(x, k, scratch=torch.empty(x.numel())),
                    select.sampled_topk_indices(x, k),
                )
            assert torch.equal(got[True][0], got[False][0]), (x.numel(), k)
            assert torch.equal(got[True][1], got[False][1]), (x.numel(), k)
            assert got[True][0].numel() == k


def test_sparse_average_writes_the_full_division(monkeypatch):
    """``PairSum.write(out, P)`` divides only the positions its pairs touch and gives the
    bucket a full ``div_`` gives, bit for bit: P = 3 (an inexact quotient), pieces that
    overlap and repeat a position (padding at 0), empty pieces; many pairs take the full
    pass."""
    from zoopick.training.comm import exchange

    gen = torch.Generator().manual_seed(13)
    n = 50_000
    pieces = [
        (torch.randperm(n, generator=gen)[:900], torch.randn(900, generator=gen)) for _ in range(3)
    ]
    pieces.append((torch.zeros(40, dtype=torch.int32), torch.zeros(40)))  # padding pairs
    pieces.append((torch.empty(0, dtype=torch.int64), torch.empty(0)))
    for P in (2, 3, 7):
        for pairs in (pieces, pieces * 8):  # 8x: above a sixteenth of out, the full pass
            expect = exchange.PairSum(pairs).write(torch.randn(n, generator=gen)).div_(P)
            for sparse in (True, False):
                monkeypatch.setattr(exchange, "SPARSE_AVERAGE", sparse)
                out = torch.randn(n, generator=gen)  # stale content: overwritten
                got = exchange.PairSum(pairs).write(out, P)
                assert got is out
                assert torch.equal(got, expect), (P, sparse, len(pairs))
                assert torch.equal(torch.signbit(got), torch.signbit(expect))


def test_prescan_sums_zeroes_and_keeps_the_scan_exact():
    """``prescan.accumulate`` gives ``acc + grad`` bit for bit, zeroes ``grad``, and keeps
    each span's column maxima; with them the grouped scan lists the plain scan's positions,
    also after values shrank (a stale maximum) and after values grew at touched positions.
    Without the touch the scan misses the grown values (so the check can fail)."""
    from zoopick.training.comm import prescan
    from zoopick.training.comm.select import grouped_positions, sparse_positions

    gen = torch.Generator().manual_seed(14)
    n = 3 * prescan.CHUNK_COLUMNS * 8 + 12_345  # several chunks, a tail, gaps between spans
    res = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen) * torch.randn(n, generator=gen).exp()
    spans = [(1_001, 150_000), (150_000, n - 77)]
    expect = res + grad
    acc = res.clone()
    scan = prescan.accumulate(acc, grad, spans)
    assert torch.equal(acc, expect) and not torch.count_nonzero(grad)
    assert scan.peaks(0, n) is None
    thr = 2.5
    for lo, hi in spans:
        x = acc[lo:hi]
        assert torch.equal(
            grouped_positions(x, thr, scan.peaks(lo, hi)), sparse_positions(x.abs() >= thr)
        )
    lo, hi = spans[1]
    shrunk = torch.randperm(hi - lo, generator=gen)[:500] + lo
    acc[shrunk] = 0.0  # taken out of the residual: maxima too high, still exact
    grown = torch.randperm(hi - lo, generator=gen)[:300] + lo
    acc[grown] = 100.0  # received pairs: larger than any stored maximum
    x = acc[lo:hi]
    stale = grouped_positions(x, thr, scan.peaks(lo, hi).clone())
    scan.touch(grown.int())
    got = grouped_positions(x, thr, scan.peaks(lo, hi))
    plain = sparse_positions(x.abs() >= thr)
    assert torch.equal(got, plain)
    assert not torch.equal(stale, plain)
