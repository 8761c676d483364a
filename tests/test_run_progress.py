"""Live training progress without a service: the trainer's progress events (emitted at the
right steps, read from device sums), folded into a run's progress (phase, fraction, expected
time, bounded sub-epoch points), the run's bounded log, and the chart axes' ticks."""

from __future__ import annotations

import math
import shutil
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch

from zoopick.app.dashboard.charts import nice_ticks
from zoopick.app.dashboard.pages import duration, sig
from zoopick.service import progress, run_checkpoints, run_log
from zoopick.service.storage import LocalStore
from zoopick.training.config import CHECKPOINT, RunEvent, parse_line
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


class _HeldStore(LocalStore):
    """The folder store, its first put slowed down on purpose: it reads its source (the log as
    it is then) and waits for ``release`` before storing it, so the run's last lines are
    written and its final push asked while that older push is in flight."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.read, self.release = threading.Event(), threading.Event()
        self.puts = 0

    def put(self, key, source, **kw):
        self.puts += 1
        if self.puts > 1:
            return super().put(key, source, **kw)
        data = b"".join(source)
        self.read.set()
        assert self.release.wait(30)
        return super().put(key, [data], **kw)


def _held_push(
    tmp_path: Path, name: str, **kw
) -> tuple[Path, _HeldStore, run_log.Pusher, threading.Thread]:
    """A run's log with one line, pushed from a thread (the checkpoint uploader's) and held in
    the store; the run's last two lines written after that push read the log."""
    run = tmp_path / name
    writer = run_log.LogWriter(run)
    writer.write("stdout", "epoch 1")
    store = _HeldStore(tmp_path / f"{name}-store")
    pusher = run_log.Pusher(store, "t/train.log", run, every=0, **kw)  # each maybe() pushes
    early = threading.Thread(target=pusher.maybe, daemon=True)
    early.start()
    assert store.read.wait(30)
    writer.write("stdout", "epoch 2")
    writer.write("stderr", "done")
    writer.close()
    return run, store, pusher, early


def test_the_final_push_of_the_log_lands_after_one_in_flight(tmp_path):
    """An older push of the log still in flight when the run's final push is asked (the
    uploader's, after a checkpoint) never lands after it: the store ends with every line."""
    run, store, pusher, early = _held_push(tmp_path, "run")
    final = threading.Thread(target=pusher.final)
    final.start()
    deadline = time.monotonic() + 30  # until the final push is done or waits its turn
    while final.is_alive() and getattr(pusher, "_asked", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    store.release.set()
    final.join(30)
    early.join(30)  # the older push done too: whichever landed last, the store has it
    whole = b"".join(run_log.chunks(run))
    assert whole.endswith(b"[stderr] done\n")
    assert b"".join(store.get("t/train.log")) == whole
    puts = store.puts
    pusher.maybe()  # the run is over: nothing is pushed after its final push
    assert store.puts == puts

    # a store that holds the older push past the final's wait: the end of the run waits that
    # long only, and the thread in flight pushes the log again once its push is done
    run, store, pusher, early = _held_push(tmp_path, "slow", final_wait=0.2)
    began = time.monotonic()
    assert pusher.final() is False and time.monotonic() - began < 5
    store.release.set()
    early.join(30)
    assert store.puts == 2
    assert b"".join(store.get("t/train.log")) == b"".join(run_log.chunks(run))


def test_a_run_resumed_from_the_stores_checkpoint_keeps_both_logs_once(tmp_path):
    """This machine's run folder has a log of its own but no checkpoint (an attempt lost before
    its first checkpoint was stored, only its first lines pushed); the run went on on another
    machine from those lines and stored a checkpoint. Resumed here from that checkpoint, the
    folder's log is the store's history with this attempt's unpushed lines in their place,
    none twice; a folder whose lines were all pushed ends with the store's log exactly."""
    store = LocalStore(tmp_path / "store")
    tenant, job = uuid.uuid4(), uuid.uuid4()
    key, saved = run_log.stored_key(tenant, job), run_checkpoints.stored_key(tenant, job)
    here, there = tmp_path / "here", tmp_path / "there"
    writer = run_log.LogWriter(here)
    writer.write("stdout", "here 1")
    writer.write("stdout", "here 2")
    assert run_log.push(store, key, here)
    shutil.copytree(here, tmp_path / "pushed")  # a folder whose lines are all in the store
    writer.write("stderr", "here 3, never pushed")
    writer.close()

    assert run_log.restore(store, key, there)  # the other machine's folder: no log yet
    writer = run_log.LogWriter(there)
    writer.write("stdout", "there 1")
    writer.close()
    (there / CHECKPOINT).write_bytes(b"epoch 1")
    uploads = run_checkpoints.Uploader(
        store, saved, there, on_put=lambda _: run_log.push(store, key, there)
    )
    uploads._seen = None  # as if the trainer had just written it
    assert uploads.check()
    stored = b"".join(store.get(key)).decode().splitlines()
    assert stored == ["[stdout] here 1", "[stdout] here 2", "[stdout] there 1"]
    pushed = tmp_path / "pushed"
    assert run_checkpoints.fetch(store, saved, pushed, waits=())
    assert run_log.restore(store, key, pushed)
    assert b"".join(run_log.chunks(pushed)).decode().splitlines() == stored

    assert run_checkpoints.fetch(store, saved, here, waits=())
    assert run_log.restore(store, key, here)
    lines = b"".join(run_log.chunks(here)).decode().splitlines()
    assert lines == [
        "[stdout] here 1", "[stdout] here 2", "[stderr] here 3, never pushed", "[stdout] there 1",
    ]  # fmt: skip
    assert run_log.push(store, key, here)  # the next push keeps them all
    assert b"".join(store.get(key)).decode().splitlines() == lines


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
