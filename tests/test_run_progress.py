"""Live training progress without a service: the trainer's progress events (emitted at the
right steps, read from device sums), folded into a run's progress (phase, fraction, expected
time, bounded sub-epoch points), the run's bounded log, and the chart axes' ticks."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
import torch

from zoopick.app.dashboard.charts import nice_ticks
from zoopick.app.dashboard.pages import duration, sig
from zoopick.service import progress, run_log
from zoopick.training.config import RunEvent, parse_line
from zoopick.training.progress import Reporter

T0 = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def step(epoch: int, at: int, of: int = 10, **kw) -> RunEvent:
    return RunEvent(
        "progress", phase="training", epoch=epoch, epochs=4, step=at, steps=of,
        loss=1.0 / epoch, train_acc=0.1 * epoch, **kw,
    )  # fmt: skip


def test_progress_events_round_trip_through_the_wire_form():
    event = step(2, 5, host="node-1")
    assert parse_line(event.to_json()) == event
    assert parse_line('{"event": "progress", "phase": "loading data"}') == RunEvent(
        "progress", phase="loading data"
    )


def test_a_run_folds_events_into_phase_fraction_and_expected_time():
    state = progress.starting(None, host="w1")
    assert state["phase"] == "starting workers" and state["hosts"] == ["w1"]
    state = progress.apply(state, RunEvent("progress", phase="loading data", host="w2"), T0)
    assert state["hosts"] == ["w1", "w2"] and progress.fraction(state) is None
    # the pace is measured from the first training event: 1.5 epochs of 4 in 30 s after it
    state = progress.apply(state, step(1, 0), T0 + timedelta(seconds=10))
    state = progress.apply(state, step(2, 5), T0 + timedelta(seconds=40))
    assert progress.fraction(state) == pytest.approx(1.5 / 4)
    view = progress.run_view(state, T0, None, now=T0 + timedelta(seconds=40))
    assert view["phase"] == "training" and (view["epoch"], view["step"]) == (2, 5)
    assert view["elapsed_seconds"] == 40
    # plain arithmetic: 30 s for 1.5 epochs, 2.5 to go
    assert view["remaining_seconds"] == pytest.approx(30 / 1.5 * 2.5)
    assert view["points"] == [{"x": 1.5, "loss": 0.5, "train_accuracy": pytest.approx(0.2)}]
    state = progress.apply(state, RunEvent("progress", phase="evaluating", epoch=2, epochs=4))
    assert progress.fraction(state) == 0.5
    done = progress.run_view(state, T0, T0 + timedelta(seconds=90))
    assert done["phase"] == "finished" and done["remaining_seconds"] is None
    assert done["elapsed_seconds"] == 90


def test_sub_epoch_points_stay_bounded_and_a_resume_redraws_them():
    state: dict = {}
    for e in range(1, 5):
        for j in range(1, 300):
            state = progress.apply(state, step(e, j, of=300))
    points = state["points"]
    assert len(points) <= progress.MAX_POINTS
    assert [p[0] for p in points] == sorted(p[0] for p in points)  # still in order
    assert points[-1][0] == pytest.approx(3 + 299 / 300, abs=1e-4)
    state = progress.apply(state, step(2, 150, of=300))  # resumed from epoch 1's checkpoint
    assert max(p[0] for p in state["points"]) == pytest.approx(1.5)


def test_scoring_says_what_is_settled_and_what_was_never_scored():
    view = progress.scoring_view(["a", "b", "c", "d"], ["b"], {"c": "broken"}, finished=False)
    assert (view["done"], view["total"], view["fraction"], view["never_scored"]) == (
        2, 4, 0.5, [],
    )  # fmt: skip
    ended = progress.scoring_view(["a", "b", "c", "d"], ["b"], {"c": "broken"}, finished=True)
    assert ended["never_scored"] == ["a", "d"]


def test_the_reporter_reads_the_device_sums_only_at_its_steps(monkeypatch):
    events: list[RunEvent] = []
    clock = iter(range(0, 10_000, 1))
    monkeypatch.setattr("zoopick.training.progress.time.monotonic", lambda: next(clock))
    report = Reporter(events.append, active=True)
    loss, correct = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    due = []
    for j in range(0, 40):  # 40 steps in an epoch: every 4th is a point, never the last
        loss += 2.0 * 8
        correct += 3
        if report.due(j, 0, 40):
            due.append(j + 1)
            report.step(epoch=1, epochs=1, step=j + 1, steps=40, loss_sum=loss, correct=correct,
                        seen=(j + 1) * 8)  # fmt: skip
    assert due == [4, 8, 12, 16, 20, 24, 28, 32, 36]
    assert events[0].loss == pytest.approx(2.0) and events[0].train_acc == pytest.approx(3 / 8)
    silent = Reporter(events.append, active=False)  # ranks other than 0
    silent.phase("loading data")
    assert not silent.due(3, 0, 40) and len(events) == 9


def test_the_log_is_bounded_and_read_back_oldest_first(tmp_path):
    writer = run_log.LogWriter(tmp_path, max_bytes=1000)
    for i in range(200):
        writer.write("stdout", f"line {i:03d}")
    writer.close()
    files = run_log.log_files(tmp_path)
    assert [f.name for f in files] == ["train.log.1", "train.log"]
    assert sum(f.stat().st_size for f in files) <= 2 * 1000 + 100
    text = b"".join(run_log.chunks(tmp_path, size=7)).decode().splitlines()
    assert text[-1] == "[stdout] line 199" and text == sorted(text)
    assert run_log.tail(tmp_path, 3) == [f"[stdout] line {i}" for i in (197, 198, 199)]
    assert run_log.tail(tmp_path / "none") == []


def test_the_log_in_the_store_is_read_where_the_run_folder_is_not(tmp_path, monkeypatch):
    """A worker puts the run's log (both files, oldest first) in the store; an API on another
    machine (no run folder there) reads the store's copy, whole and as a tail; the machine
    that has the folder reads the folder. A store that fails costs the copy, not the run."""
    import uuid

    from zoopick.service.storage import LocalStore

    run = tmp_path / "run"
    writer = run_log.LogWriter(run, max_bytes=1000)
    for i in range(200):
        writer.write("stderr", f"line {i:03d}")
    writer.close()
    store = LocalStore(tmp_path / "store")
    tenant, job = uuid.uuid4(), uuid.uuid4()
    key = run_log.stored_key(tenant, job)
    assert key == f"tenants/{tenant}/jobs/{job}/train/train.log"
    pusher = run_log.Pusher(store, key, run, every=3600)
    pusher.maybe()  # not due yet
    assert store.size(key) is None
    pusher.final()
    whole = b"".join(run_log.chunks(run))
    assert b"".join(store.get(key)) == whole

    elsewhere = run_log.for_run(tmp_path / "not-on-this-machine", store, tenant, job)
    assert elsewhere.exists and not elsewhere.local
    assert b"".join(elsewhere.chunks()) == whole
    assert elsewhere.tail(3) == [f"[stderr] line {i}" for i in (197, 198, 199)]
    here = run_log.for_run(run, store, tenant, job)
    assert here.local and here.tail(2) == run_log.tail(run, 2)
    assert not run_log.for_run(tmp_path / "none", store, tenant, uuid.uuid4()).exists

    (tmp_path / "blocked").write_text("a file where the store's folder should be")
    assert run_log.push(LocalStore(tmp_path / "blocked"), key, run) is False  # logged only
    later = tmp_path / "store2"
    due = run_log.Pusher(LocalStore(later), key, run, every=3600)
    monkeypatch.setattr(run_log.time, "monotonic", lambda: 1e12)  # long after
    due.maybe()
    assert LocalStore(later).size(key) == len(whole)


@pytest.mark.parametrize(
    ("lo", "hi"), [(0, 1), (0, 2.31), (1, 5), (-1, 2.5), (0.1, 0.3), (0, 1.49e6), (3, 3), (0, 7e-5)]
)
def test_ticks_are_round_and_cover_the_range(lo, hi):
    ticks = nice_ticks(lo, hi, 5)
    assert ticks[0] <= lo and ticks[-1] >= hi and 2 <= len(ticks) <= 12
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len({round(s / min(steps), 6) for s in steps}) == 1  # evenly spaced
    mantissa = min(steps) / 10 ** math.floor(math.log10(min(steps)))
    assert round(mantissa, 6) in (1, 2, 5)


def test_numbers_keep_their_significant_digits():
    assert [sig(v) for v in (0.5, 1.25, -0.75, 12.0, 123456.0)] == [
        "0.5000", "1.250", "-0.7500", "12.00", "1.235e+05",
    ]  # fmt: skip
    assert sig(None) == "" and duration(4.25) == "4.2 s" and duration(185) == "3 min 05 s"
