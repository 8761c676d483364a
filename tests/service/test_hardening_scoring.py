"""Scoring that kills its worker or runs past its time limit costs that model, not the job
(issue 10, items 2 and 11), with a real Celery worker (prefork, cpu and gpu queues), uvicorn,
PostgreSQL and Redis.

* A model whose scoring kills its worker each time (what the kernel's OOM killer does to a
  model too large for the machine; here the test SIGKILLs the pool process as soon as the
  task has counted its start) is delivered ``ZOOPICK_MAX_DELIVERIES`` times, then skipped with
  "worker died N times while scoring" in ``model_errors``; the job ranks the other models.
* When the worker dies outright with the message (Redis keeps it unacknowledged for hours),
  the lost-job sweeper re-queues the job, and the deliveries before count: the model is
  skipped just the same.
* A model that runs past ``ZOOPICK_SCORE_SOFT_TIME_LIMIT``, or past the hard limit where the
  soft one cannot stop it, is skipped the same way, and the dashboard lists it with the
  reason.

The zoo: ``good`` (timm's tiny ``test_resnet``, a fraction of a second) and ``slow`` (a
ResNet-50 at 384 x 384: several seconds even on an idle core, far past the 2 s limit). For the
time limit, the pool process imports the scoring libraries when it starts
(``ZOOPICK_PRELOAD_SCORING``), so the limit measures scoring alone; the kill test does not
preload, so a killed pool process restarts at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.service import procs
from tests.service.datafiles import npz_bytes
from tests.service.test_api import API
from tests.service.test_hardening_workers import pool_pids

KILLS = {"ZOOPICK_MAX_DELIVERIES": "2"}
LIMITS = {
    "ZOOPICK_SCORE_SOFT_TIME_LIMIT": "2",
    "ZOOPICK_SCORE_HARD_TIME_LIMIT": "4",
    "ZOOPICK_SCORE_BATCH_SIZE": "6",
    "ZOOPICK_PRELOAD_SCORING": "1",
}


@pytest.fixture(scope="module")
def service(isolated_settings):
    """The API, the database with the zoo, and a ``start(extra)`` for a worker of its own."""
    from zoopick.service.db.models import ZooModel
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope

    settings = isolated_settings("hardening-scoring")
    token = procs.create_token(settings, "sam")
    engine = make_engine(settings.database_url)
    factory = make_sessionmaker(engine)
    with session_scope(factory) as session:
        session.add(ZooModel(id="good", arch="test_resnet", weights="none", num_classes=10,
                             overrides={"input_size": [3, 32, 32]}))  # fmt: skip
        session.add(ZooModel(id="slow", arch="resnet50", weights="none", num_classes=10,
                             overrides={"input_size": [3, 384, 384]}))  # fmt: skip
    api, base = procs.start_api(settings, settings.data_dir)

    @contextlib.contextmanager
    def start(extra: dict[str, str]) -> Iterator[tuple[procs.Proc, str]]:
        """A worker with ``extra`` settings, and a dataset it validated."""
        worker = procs.start_worker(settings, "cpu,gpu", settings.data_dir, extra)
        try:
            procs.wait_worker_ready(worker)
            resp = http.post(f"{API}/datasets", files={"file": ("d.npz", npz_bytes(), "x")})
            ds = resp.json()["id"]
            procs.poll(lambda: http.get(f"{API}/datasets/{ds}").json()["status"],
                       lambda s: s == "ready", 60, what="dataset")  # fmt: skip
            yield worker, ds
        finally:
            worker.stop()

    try:
        with httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=60
        ) as http:
            yield http, factory, start, base, token, settings
    finally:
        api.stop()
        engine.dispose()


def submit(http: httpx.Client, ds: str, models: list[str]) -> str:
    body = {"dataset_id": ds, "models": models, "metrics": ["sms"], "select_by": "sms"}
    resp = http.post(f"{API}/jobs", json=body)
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def finished(http: httpx.Client, job_id: str, timeout: float = 120) -> dict:
    return procs.poll(
        lambda: http.get(f"{API}/jobs/{job_id}").json(),
        lambda j: j["status"] in ("succeeded", "failed", "cancelled"),
        timeout,
        what="the job",
    )


def test_a_model_whose_scoring_kills_its_worker_is_skipped_after_max_deliveries(service):
    http, factory, start, _, _, _ = service
    with start(KILLS) as (worker, ds):
        job_id = submit(http, ds, ["slow", "good"])
        key = f"score:{uuid.UUID(job_id)}:slow"
        kills = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if http.get(f"{API}/jobs/{job_id}").json()["status"] in ("succeeded", "failed"):
                break
            started = procs.deliveries(factory, key)
            if kills < started <= 2:  # this start of "slow" is scoring now: kill its worker
                for pid in pool_pids(worker):
                    os.kill(pid, signal.SIGKILL)
                kills += 1
            time.sleep(0.02)
        job = finished(http, job_id)
        alive = worker.alive()
    assert kills == 2, (kills, worker.tail())
    assert job["status"] == "succeeded", (job, worker.tail())
    assert job["chosen_model"] == "good"
    assert [r["model"] for r in job["ranking"]] == ["good"]
    assert set(job["model_errors"]) == {"slow"}
    assert "worker died 2 times while scoring" in job["model_errors"]["slow"]
    assert procs.deliveries(factory, key) == 3  # two deaths, then the start that gave up
    assert alive


def test_a_model_past_its_soft_or_hard_time_limit_is_skipped_and_the_dashboard_says_why(
    service,
):
    """Soft: ``slow`` runs into the 2 s limit. Hard: its pool process is stopped (SIGSTOP, as a
    process stuck in native code looks: the soft limit's exception cannot reach it), so Celery
    kills it at the 4 s limit. Either way the job ranks ``good`` and names ``slow``."""
    http, factory, start, base, token, _ = service
    with start(LIMITS) as (worker, ds):
        soft = finished(http, submit(http, ds, ["slow", "good"]))
        hard_id = submit(http, ds, ["slow", "good"])
        procs.poll(lambda: procs.deliveries(factory, f"score:{uuid.UUID(hard_id)}:slow"),
                   lambda n: n >= 1, 60, interval=0.02, what="slow to start")  # fmt: skip
        for pid in pool_pids(worker):
            os.kill(pid, signal.SIGSTOP)
        hard = finished(http, hard_id)
        log = worker.log.read_text(errors="replace")
    for job, why in (
        (soft, "exceeded the time limit of 2 s"),
        (hard, "exceeded the hard time limit of 4 s"),
    ):
        assert job["status"] == "succeeded", (job, log[-3000:])
        assert job["chosen_model"] == "good"
        assert [r["model"] for r in job["ranking"]] == ["good"]
        assert set(job["model_errors"]) == {"slow"}
        assert why in job["model_errors"]["slow"], job["model_errors"]
        assert job["progress"] == 1.0
    assert "exceeded its hard time limit" in log
    with procs.dashboard_client(base, token) as browser:
        page = browser.get(f"/jobs/{hard['id']}")
    assert page.status_code == 200
    assert 'data-model-error="slow"' in page.text
    assert "exceeded the hard time limit of 4 s" in page.text


def test_the_sweeper_requeues_a_job_whose_worker_died_scoring_and_the_deaths_still_count(
    service,
):
    """The whole worker is killed (main process too) while ``slow`` is scored: its message
    stays unacknowledged in Redis until the visibility timeout, so only the sweeper moves the
    job on. One pass (as the API's thread or ``zoopick sweep`` runs it, at a time past the
    stall timeout) re-queues it; the next start of ``slow`` is its second, and with
    ``ZOOPICK_MAX_DELIVERIES=1`` that is one death too many: skipped, and ``good`` wins."""
    from datetime import timedelta

    from zoopick.service.db.types import utcnow
    from zoopick.service.dispatch import Dispatcher
    from zoopick.service.recovery import sweep

    http, factory, start, _, _, settings = service
    once = {"ZOOPICK_MAX_DELIVERIES": "1"}
    with start(once) as (worker, ds):
        job_id = submit(http, ds, ["slow", "good"])
        key = f"score:{uuid.UUID(job_id)}:slow"
        procs.poll(lambda: procs.deliveries(factory, key), lambda n: n >= 1, 60, interval=0.02,
                   what="slow to start")  # fmt: skip
        os.killpg(worker.proc.pid, signal.SIGKILL)  # the main process and its pool
        worker.proc.wait()
    replacement = procs.start_worker(settings, "cpu,gpu", settings.data_dir, once)
    try:
        procs.wait_worker_ready(replacement)
        assert http.get(f"{API}/jobs/{job_id}").json()["status"] == "scoring"
        later = utcnow() + timedelta(seconds=settings.stall_timeout + 1)
        actions = sweep(factory, Dispatcher(settings), settings, now=later)
        assert [(str(a.job_id), a.action) for a in actions] == [(job_id, "requeued")]
        job = finished(http, job_id)
        log = replacement.tail()
    finally:
        replacement.stop()
    assert job["status"] == "succeeded", (job, log)
    assert job["chosen_model"] == "good"
    assert set(job["model_errors"]) == {"slow"}
    assert "worker died 1 times while scoring" in job["model_errors"]["slow"]
    assert procs.deliveries(factory, key) == 2
