"""The sparse all-gather exchange (``training/comm/sparse.py``) with fixed-capacity padding.

Issue 19, run D: GaussianK's padding pairs were all added at position 0, and on a GPU the
``index_add_`` atomics aimed at one address serialise (about 140 us a bucket on an H200).
They now go to distinct positions (their slot numbers), where adding 0 must change nothing.
"""

from __future__ import annotations

import pytest
import torch

from tests import comm_harness
from zoopick.training import comm
from zoopick.training.comm import sparse


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one (the padding logic is the same on every device)."""
    yield from comm_harness.world_of_one(False)


def test_padding_pairs_add_nothing_at_distinct_positions(world_of_one):
    state, _ = comm.make_hook("gaussiank", density=0.05)
    acc = torch.randn(200, generator=torch.Generator().manual_seed(3))
    acc[3] = float("inf")  # a padding slot's number: padding must not read it into the sum
    before = acc.clone()
    state.stats.begin(0, acc.device)
    real = [5, 17]
    idx = torch.tensor([*real, 0, 0, 0, 0])  # capped_indices pads at position 0
    valid = torch.tensor([True, True, False, False, False, False])

    total, residual, _ = sparse.allgather_exchange(state, acc, idx, valid)

    ((pos, val),) = total.pieces
    pads = pos[~valid]
    assert len(set(pads.tolist())) == pads.numel()  # no address repeated by the padding
    assert not val[~valid].any()
    out = total.write(torch.full((200,), 7.0))
    expect = torch.zeros(200)
    expect[real] = before[real]
    assert torch.equal(out, expect)
    expect_residual = before.clone()
    expect_residual[real] = 0.0
    assert torch.equal(residual, expect_residual)  # inf at slot 3 stays inf, not NaN
