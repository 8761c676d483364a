"""A real fault on README's one-machine set-up (issue 43): ``zoopick serve`` (SQLite, its local
worker, the file-system broker, one data folder) SIGKILLed mid-scoring with every process it
started, and started again on the same folder; the job must succeed within a bound, each
score row once.

Its local worker is killed too (a machine's end, an OOM killer taking them all): killed
alone, serve's worker follows it after a warm shutdown of ``ORPHAN_GRACE_SECONDS`` (2 s),
which may let the model in flight finish, so what is lost would be left to timing. Here the
task in flight is certainly lost, and the test checks that its model was started again.

The issue's probe saw the job stay ``scoring`` with every model scored for the 360 s it
watched: the selection step was lost with the killed process. The fault benchmark
(``benchmarks/faults/run.py``, ``serve-killed-scoring``) measures the recovery at the default
settings (about 120 s); here serve runs on **short recovery settings** (the rules are the
defaults', only their periods shrink), so it takes seconds. ``test_faults.py`` covers the
same kind of fault on the PostgreSQL + Redis deployment.

The bound, from the fault's end (the new serve answering ``/readyz``):

    ``BOUND = G + S + WORK``

* ``G = ZOOPICK_RECOVERY_GRACE_SECONDS``: how long a job may show no live lease and no
  progress before it counts as lost (its scoring lease is G long, renewed every G / 4);
* ``S = ZOOPICK_SWEEP_INTERVAL_SECONDS``: the wait for the API's next sweep;
* ``WORK``: the job's whole work again (every model's scoring, the selection, the new local
  worker's imports): an allowance for a loaded 2-core machine.

Scoring is made slow enough to be caught mid-way by a setting (``ZOOPICK_SCORE_BATCH_SIZE=1``:
a forward pass image by image), not by big data.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service import procs
from tests.service.faults import ENDED, ended_well, ready_dataset, submit_all, view, wait
from tests.service.test_serve_signals import alive, descendants, processes

ZOO = [("s-resnet-a", "test_resnet"), ("s-vit", "test_vit"), ("s-resnet-b", "test_resnet")]
METRICS = ["logme", "leep"]
GRACE = 30
"""Not shorter: a job counts as lost when no task of it holds a live lease for this long, and
a worker's pool may take that long to start its tasks on a loaded 2-core machine: a task the
local worker has taken from the file broker (which then no longer holds it) waits for its
pool, and a pool process imports torch and timm first. At 3 s a fresh-clone run (load 3-5)
saw the job re-sent twice and failed before the kill; at 10 s another (load 4-9) saw the
restarted serve's pool, still importing, leave the re-sent tasks unstarted for two graces."""
SWEEP = 1
WORK = 60.0
"""Seconds allowed for the job's whole work after the fault, the new local worker's imports
included, on a loaded 2-core machine (30.7 s seen at load 10). The bound stays well under a
recovery at the default periods (60 + 60 + the work)."""
IMAGES_PER_CLASS = 200
"""Of a 3-class 32 px dataset: at batch size 1, a few seconds a model (the window in which
the test catches one in flight; with the libraries preloaded no import widens it)."""
BOUND = GRACE + SWEEP + WORK


class Serve:
    """``zoopick serve`` on one data folder, started again as often as a test kills it; every
    process it ever had is remembered, so none outlives the test."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.data = folder / "data"
        self.env = {
            "ZOOPICK_DATA_DIR": str(self.data),
            "ZOOPICK_RECOVERY_GRACE_SECONDS": str(GRACE),
            "ZOOPICK_SWEEP_INTERVAL_SECONDS": str(SWEEP),
            "ZOOPICK_SCORE_BATCH_SIZE": "1",
            # each pool process imports torch and timm when it starts, not in its first
            # scoring task: in a fresh-clone run (load 4-9) the first two tasks, importing
            # side by side after taking their models' leases, renewed neither for the 10 s
            # grace, so the job was re-sent twice and failed before any model was scored
            "ZOOPICK_PRELOAD_SCORING": "1",
            "ZOOPICK_SHUTDOWN_GRACE_SECONDS": "2",  # the test's end: nothing to drain
            "OMP_NUM_THREADS": "1",
        }
        self.runs: list[procs.Proc] = []
        self.groups: set[int] = set()
        """The process groups of serve's current run (its own, its local workers')."""
        self.base = ""
        self._sessions: Any = None

    @property
    def proc(self) -> procs.Proc:
        return self.runs[-1]

    def start(self) -> None:
        logs = self.folder / f"run{len(self.runs)}"
        logs.mkdir()
        # at the API's CPU priority: a local worker starting beside the suite's other tests
        # is not taken for a stalled one
        serve, port = procs.start_serve(logs, "--worker-nice", "0", **self.env)
        self.runs.append(serve)
        self.base = f"http://127.0.0.1:{port}"
        procs.wait_http(serve, f"{self.base}/readyz", timeout=180)  # its workers beat
        self.groups = {serve.proc.pid}
        for pid in descendants(serve.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                self.groups.add(os.getpgid(pid))

    def session(self) -> Any:
        """A session on serve's SQLite database (one engine for the test: the poll that
        catches a model in flight must be quick)."""
        if self._sessions is None:
            from zoopick.service.db.session import make_engine, make_sessionmaker
            from zoopick.service.settings import Settings

            self._engine = make_engine(Settings(data_dir=self.data).database_url)
            self._sessions = make_sessionmaker(self._engine)
        return self._sessions()

    def kill(self) -> None:
        """SIGKILL to serve's process group and its local workers' (groups of their own),
        at once: nothing gets to hand anything back. (Their leaders run until this moment,
        so each group id is still theirs.)"""
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.proc.proc.wait()
        _, gone = wait(lambda: _members(self.groups), lambda left: not left, 10, 0.05)
        assert gone, "serve's processes outlived a SIGKILL"

    def _kill_groups(self) -> None:
        """What is left of serve's groups, at the test's end."""
        for group in self.groups:
            if _members({group}):  # still ours: a group id is not reused while it has members
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)

    def http(self) -> httpx.Client:
        from zoopick.service_cli import KEY_FILE

        key = (self.data / KEY_FILE).read_text().strip()
        return httpx.Client(base_url=self.base + "/api/v1", timeout=60,
                            headers={"Authorization": f"Bearer {key}"})  # fmt: skip

    def logs(self) -> str:
        return "\n".join(f"--- {p.log}\n{p.tail(40)}" for p in self.runs)

    def close(self) -> None:
        if self._sessions is not None:
            self._engine.dispose()
        self.proc.stop()
        self._kill_groups()  # whatever of its workers' groups a stop left


def _members(groups: set[int]) -> list[int]:
    """The live processes of ``groups`` (process group ids), from /proc."""
    return [pid for pid, fields in processes() if int(fields[2]) in groups and alive(pid)]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    pytest.importorskip("zoopick.selection.extract", reason="selection engine")
    running = Serve(tmp_path)
    try:
        running.start()
        yield running
    finally:
        running.close()


def _score_rows(serve: Serve, job_id: str) -> list[tuple[str, str]]:
    """The job's score rows, as (model, metric), one per row (a duplicate shows twice)."""
    from sqlalchemy import select

    from zoopick.service.db.models import Score

    with serve.session() as session:
        rows = session.execute(
            select(Score.model_id, Score.metric).where(Score.job_id == uuid.UUID(job_id))
        )
        return [tuple(r) for r in rows]


def _starts(serve: Serve, job_id: str) -> dict[str, int]:
    """How many times each model's scoring task of the job was started (its deliveries)."""
    from zoopick.service.db.models import TaskDelivery

    with serve.session() as session:
        rows = {m: session.get(TaskDelivery, f"score:{job_id}:{m}") for m, _ in ZOO}
        return {m: r.count for m, r in rows.items() if r is not None}


def _in_flight(serve: Serve, job_id: str) -> tuple[set[str], list[str]]:
    """(models scored, models started and not scored), read in one quick transaction: the
    kill follows at once, before a model caught in flight can finish."""
    from sqlalchemy import select

    from zoopick.service.db.models import Score, TaskDelivery

    keys = {f"score:{job_id}:{m}": m for m, _ in ZOO}
    with serve.session() as session:
        scored = set(
            session.scalars(select(Score.model_id).where(Score.job_id == uuid.UUID(job_id)))
        )
        started = session.scalars(select(TaskDelivery.key).where(TaskDelivery.key.in_(keys)))
        return scored, [keys[k] for k in started if keys[k] not in scored]


def _scoring_job(serve: Serve, http: httpx.Client) -> tuple[str, dict]:
    """A job of every zoo model on a fresh dataset, caught with a model scored and another
    being scored (its task started, no score yet)."""
    for mid, arch in ZOO:  # serve's local key is an admin's
        body = {"id": mid, "arch": arch, "weights": "none", "num_classes": 10,
                "input_size": [3, 32, 32]}  # fmt: skip
        resp = http.post("/zoo", json=body)
        assert resp.status_code == 201, resp.text
    job_id = submit_all(http, ready_dataset(http, IMAGES_PER_CLASS, seed=5), METRICS)

    def in_flight() -> dict:
        """The job, with the models in flight once one is scored."""
        job = view(http, job_id)
        if job["status"] != "scoring":
            return job
        scored, running = _in_flight(serve, job_id)
        return job | {"in_flight": running if scored else []}

    job, _ = wait(in_flight, lambda j: j["status"] in ENDED or j.get("in_flight"), 120, 0.02)
    return job_id, job


def test_serve_killed_mid_scoring_and_started_again_finishes_the_job(serve: Serve) -> None:
    with serve.http() as http:
        job_id, before = _scoring_job(serve, http)
    assert before.get("in_flight"), f"no model caught in flight: {before}\n{serve.logs()}"
    serve.kill()
    # exact now that nothing runs: the models whose task was started and died unscored
    scored, lost = _in_flight(serve, job_id)
    # (empty only when the model caught in flight finished in the moment before the kill:
    # then a queued model's message is what the new serve finds, and the end is still checked)
    serve.start()
    fault_end = time.monotonic()
    expected = {(m, k) for m, _ in ZOO for k in METRICS}
    with serve.http() as http:  # the fault ends when serve is back
        job = ended_well(
            http, job_id, fault_end, BOUND, expected,
            rows=lambda: _score_rows(serve, job_id), logs=serve.logs,
            said=f", {len(scored)}/{len(ZOO)} scored at the kill, {lost} lost",
        )  # fmt: skip
    if lost:
        # the killed tasks' messages went with their process (the file broker keeps no
        # unacknowledged copy): only the sweeper could have started their models again
        assert job["recoveries"] >= 1, job
        starts = _starts(serve, job_id)
        assert all(starts[m] >= 2 for m in lost), f"lost {lost}, started {starts}"
