"""DFS-style block sparsification on real gloo processes (the P = 3 launch shared with
tests/test_comm_hooks.py): block-aligned updates, plain reference, dynamic block size."""

from __future__ import annotations

import math

import pytest
import torch

from tests.comm_harness import launch_cached
from tests.test_comm_hooks import DENSITY, DFS_WORLD, suite
from zoopick.training.comm.dfs import topk_magnitude_estimate


@pytest.fixture(scope="module")
def run():
    return launch_cached(suite, DFS_WORLD)


def _bucket_flats(rec, key):
    split = rec["split"]
    return [torch.cat([rec[key][i] for i in members]) for members in split]


def test_first_iteration_matches_plain_block_selection(run):
    P = len(run)
    B = 16  # the initial block size
    recs = [res["raw"]["dfs"]["records"][0] for res in run]
    got = _bucket_flats(recs[0], "avg")
    grads = [_bucket_flats(r, "grads") for r in recs]  # residuals start at zero
    for b, avg in enumerate(got):
        n = avg.numel()
        k = math.ceil(DENSITY * n - 1e-9)
        nb = math.ceil(n / B)
        m = min(nb, math.ceil(k / B))
        expect = torch.zeros(nb * B, dtype=torch.float64)
        for g in grads:
            padded = torch.zeros(nb * B, dtype=torch.float64)
            padded[:n] = g[b].double()
            energy = padded.view(nb, B).pow(2).sum(1)
            for blk in torch.argsort(energy, descending=True)[:m].tolist():
                expect[blk * B : (blk + 1) * B] += padded[blk * B : (blk + 1) * B]
        torch.testing.assert_close(avg.double(), expect[:n] / P, rtol=0, atol=1e-6)
        # block aligned: each block of the update is entirely zero or entirely non-zero
        nz = torch.zeros(nb * B, dtype=torch.bool)
        nz[:n] = avg != 0
        per_block = nz.view(nb, B).sum(1)
        full = torch.tensor([min(B, n - j * B) for j in range(nb)])
        assert torch.all((per_block == 0) | (per_block == full))


def test_block_size_grows_on_clustered_and_shrinks_on_iid_gradients(run):
    sizes = [(res["dfs_adapt"]["clustered"], res["dfs_adapt"]["iid"]) for res in run]
    assert len(set(sizes)) == 1  # every rank agrees on the block size
    clustered, iid = sizes[0]
    assert clustered > 16 > iid


def test_topk_magnitude_estimate_is_close_on_a_large_vector():
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    exact = float(torch.topk(x.abs(), 2000).values.min())
    assert topk_magnitude_estimate(x, 2000) == pytest.approx(exact, rel=0.1)


def test_block_sizes_survive_a_checkpoint(tmp_path):
    from torch import nn

    import zoopick.training.comm as comm

    model = nn.Linear(4, 3)
    state, _ = comm.make_hook("dfs")
    state.sizes[tuple(id(p) for p in model.parameters()) + (15,)] = 64
    torch.save(state.state_dict(model), tmp_path / "s.pt")
    fresh = nn.Linear(4, 3)
    again, _ = comm.make_hook("dfs")
    again.load_state_dict(fresh, torch.load(tmp_path / "s.pt", weights_only=True))
    assert again.sizes == {tuple(id(p) for p in fresh.parameters()) + (15,): 64}
