"""ExDyna: partition balancing and threshold interpolation (pure), and real gloo runs
(the per-P launch shared with tests/test_comm_hooks.py)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.comm_harness import launch_cached
from tests.test_comm_hooks import ITERS, SHAPES, suite
from zoopick.training.comm.exdyna import PROBES, next_threshold, paper_threshold, rebalance


def test_rebalance_moves_one_block_toward_the_lighter_neighbour():
    counts = [5, 5, 5, 5, 30, 30, 0, 0]  # 8 blocks
    edges = [0, 4, 8]  # partition 0: 20, partition 1: 60
    assert rebalance(edges, counts, max_shift=1) == [0, 5, 8]
    assert rebalance(edges, counts, max_shift=3) == [0, 5, 8]  # a second move would overshoot
    # balanced already: nothing moves
    assert rebalance([0, 4, 8], [1] * 8, max_shift=2) == [0, 4, 8]


def test_rebalance_walks_through_empty_blocks_and_keeps_one_block():
    counts = [0, 0, 0, 0, 0, 0, 0, 9]
    assert rebalance([0, 4, 8], counts, max_shift=2) == [0, 6, 8]
    assert rebalance([0, 7, 8], counts, max_shift=5) == [0, 7, 8]  # partition 1 keeps a block
    counts = [9, 0, 0, 0, 0, 0, 0, 0]
    assert rebalance([0, 4, 8], counts, max_shift=10) == [0, 1, 8]


def test_rebalance_three_partitions_left_to_right():
    # partitions 20 | 20 | 0: boundary 1 stays, boundary 2 hands block 3 to the empty one
    assert rebalance([0, 2, 4, 6], [10, 10, 10, 10, 0, 0], max_shift=1) == [0, 2, 3, 6]
    # 20 | 10 | 0: moving block 1 (10) would only flip the 10-difference, so boundary 1 stays;
    # block 3 is empty and walks to the right
    assert rebalance([0, 2, 4, 6], [10, 10, 10, 0, 0, 0], max_shift=1) == [0, 2, 3, 6]


def test_paper_threshold_steps():
    """The paper's rule, by hand: x1.005 above 1.1 k, x0.995 at or below k / 1.1, else
    x1.00125."""
    assert paper_threshold(2.0, 111, 100) == 2.0 * 1.005
    assert paper_threshold(2.0, 110, 100) == 2.0 * 1.00125
    assert paper_threshold(2.0, 91, 100) == 2.0 * 1.00125
    assert paper_threshold(2.0, 90, 100) == 2.0 * 0.995
    assert paper_threshold(2.0, 0, 100) == 2.0 * 0.995


def test_next_threshold_interpolates_in_log_space():
    thr = 2.0
    levels = [thr * s for s in PROBES]
    counts = [1000, 600, 300, 150, 100, 50, 20, 5, 1]
    # exactly on a probe
    assert next_threshold(thr, counts, 100) == pytest.approx(levels[4])
    # between probes 4 (100) and 5 (50): log-linear
    got = next_threshold(thr, counts, 70)
    frac = (math.log(100) - math.log(70)) / (math.log(100) - math.log(50))
    expect = math.exp(math.log(levels[4]) + frac * (math.log(levels[5]) - math.log(levels[4])))
    assert got == pytest.approx(expect)
    # outside the probed range: clamp to the extreme probe
    assert next_threshold(thr, counts, 5000) == pytest.approx(levels[0])
    assert next_threshold(thr, counts, 0.5) == pytest.approx(levels[-1])


# --------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module", params=[2, 3, 5], ids=lambda p: f"P{p}")
def run(request):
    return launch_cached(suite, request.param)


def test_selections_are_exclusive_and_fully_summed(run):
    P = len(run)
    for it in range(ITERS):
        recs = [res["raw"]["exdyna"]["records"][it] for res in run]
        support_total = 0
        for i in range(len(SHAPES)):
            avg = recs[0]["avg"][i]
            support = avg != 0
            support_total += int(support.sum())
            acc_sum = sum(r["grads"][i] + r["before"][i] for r in recs)
            # where anything was applied, every worker contributed its whole accumulated value
            torch.testing.assert_close(avg[support], acc_sum[support] / P, rtol=0, atol=1e-5)
            for r in recs:
                assert torch.all(r["after"][i][support] == 0)
                assert torch.equal(
                    r["after"][i][~support], (r["grads"][i] + r["before"][i])[~support]
                )
        # no index was selected by two workers: exchanged pairs == distinct applied positions
        assert run[0]["raw"]["exdyna"]["stats"][it]["nnz"] == support_total


def test_online_threshold_keeps_the_density(run):
    densities = run[0]["exdyna_density"]
    for res in run[1:]:
        assert res["exdyna_density"] == densities
    tail = densities[-30:]
    assert 0.0075 < sum(tail) / len(tail) < 0.013  # target 0.01


def test_partitions_and_thresholds_survive_a_checkpoint(tmp_path):
    """ExDyna's per-bucket state goes into the checkpoint keyed by parameter names and comes
    back under the ids of a rebuilt model (through a weights-only load, as the trainer does)."""
    from torch import nn

    import zoopick.training.comm as comm
    from zoopick.training.comm.exdyna import _Partitioning

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    state, _ = comm.make_hook("exdyna", controller="paper")
    key = tuple(id(p) for p in model.parameters()) + (29,)
    state.partitions[key] = _Partitioning([0, 10, 20, 29], [0, 2, 3], 0.125, 1.5)
    torch.save(state.state_dict(model), tmp_path / "s.pt")
    fresh = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    again, _ = comm.make_hook("exdyna", controller="paper")
    again.load_state_dict(fresh, torch.load(tmp_path / "s.pt", weights_only=True))
    part = again.partitions[tuple(id(p) for p in fresh.parameters()) + (29,)]
    assert (part.block_edges, part.part_edges) == ([0, 10, 20, 29], [0, 2, 3])
    assert (part.threshold, part.target_ratio) == (0.125, 1.5)
