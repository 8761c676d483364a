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
