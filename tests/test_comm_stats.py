"""Per-iteration stats records, reset and sums; warm-up density schedule."""

from __future__ import annotations

import pytest
import torch

from zoopick.training.comm import CommStats, make_hook, sum_stats


def test_records_open_fill_and_close():
    stats = CommStats()
    stats.begin(0, torch.device("cpu"))
    stats.add(bytes_sent=10, bytes_recv=4, nnz=3)
    stats.begin(0, torch.device("cpu"))  # a second bucket of the same iteration
    stats.add(bytes_sent=5, buckets=1)
    with stats.timer("select_s"):
        sum(range(1000))
    stats.finish()
    assert len(stats) == 1 and stats.current is None
    rec = stats[0]
    assert (rec["iteration"], rec["bytes_sent"], rec["bytes_recv"], rec["nnz"]) == (0, 15, 4, 3)
    assert rec["select_s"] > 0 and rec["comm_s"] == 0.0
    stats.begin(1, torch.device("cpu"))
    stats.add(bytes_sent=1)
    stats.finish()
    total = stats.total()
    assert total["bytes_sent"] == 16 and total["iterations"] == 2
    assert stats.total(last=1)["bytes_sent"] == 1
    assert sum_stats(stats)["bytes_recv"] == 4
    stats.reset()
    assert len(stats) == 0 and stats.total()["iterations"] == 0


def test_records_are_bounded_and_the_cumulative_total_stays_exact():
    stats = CommStats(keep=5)
    for it in range(1000):
        stats.begin(it, torch.device("cpu"))
        stats.add(bytes_sent=2, nnz=1, buckets=1)
        stats.finish()
    assert len(stats) == 5 and [r["iteration"] for r in stats] == [995, 996, 997, 998, 999]
    assert stats.cumulative["bytes_sent"] == 2000 and stats.cumulative["iterations"] == 1000
    assert stats.total()["bytes_sent"] == 10
    state, _ = make_hook("topk")
    assert state.stats.keep == 1000 and state.stats.sync_cuda is False  # no device syncs


def test_add_outside_an_iteration_is_an_error():
    with pytest.raises(RuntimeError):
        CommStats().add(bytes_sent=1)


def test_exponential_warmup_schedule():
    state, _ = make_hook("topk", density=0.01, warmup=4)
    assert [state.density_at(t) for t in range(6)] == [0.25, 0.0625, 0.015625, 0.01, 0.01, 0.01]
    state, _ = make_hook("topk", density=0.1, warmup=2, warmup_mode="dense")
    assert [state.density_at(t) for t in range(3)] == [None, None, 0.1]


def test_tensor_amounts_are_read_late(monkeypatch):
    """A count only the device knows is kept as a deferred value: on a CPU it lands in its
    record at ``finish``; elsewhere (here the meta device stands for an accelerator) ``finish``
    reads only the values whose copies have landed (``Deferred.ready``), and ``resolve``
    waits for the rest, together with the cumulative total."""
    from zoopick.training.comm import hostread

    stats = CommStats()
    stats.begin(0, torch.device("cpu"))
    stats.add(nnz=torch.tensor(5), bytes_sent=3)
    stats.finish()
    assert (stats[0]["nnz"], stats.cumulative["nnz"]) == (5, 5)

    late = CommStats()
    monkeypatch.setattr(hostread.Deferred, "ready", lambda self: False)  # copies in flight
    late.begin(0, torch.device("meta"))
    late.add(nnz=torch.tensor(7), bytes_sent=3)
    late.finish()
    late.begin(1, torch.device("meta"))
    late.add(nnz=torch.tensor(2))
    assert (late[0]["nnz"], late.cumulative["nnz"]) == (0, 0)  # not read yet
    late.resolve()
    assert (late[0]["nnz"], late.cumulative["nnz"], late.current["nnz"]) == (7, 7, 2)
    monkeypatch.undo()  # the copy of iteration 1 has landed by its finish: read there
    late.finish()
    assert late[1]["nnz"] == 2 and not late._deferred
    assert late.cumulative["nnz"] == 9 and late.cumulative["bytes_sent"] == 3
