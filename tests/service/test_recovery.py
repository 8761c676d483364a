"""The sweeper for lost jobs (``zoopick.service.recovery``) on PostgreSQL with a real Redis broker:
which
jobs count as lost, what is re-queued (the messages really reach the broker's queues), failed
or cancelled, that concurrent sweepers act on a job once, and that the API process, a starting
worker and ``zoopick sweep`` all run it. Re-queued work being picked up and finished by a real
worker is in ``test_e2e.py``."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path

import pytest
import redis
from sqlalchemy import delete, select, update

from tests.service.procs import Proc, env_for, poll
from zoopick.service import recovery
from zoopick.service.db import migrate
from zoopick.service.db.models import Dataset, Job, ScoreLease, TrainingRun, WorkerHeartbeat
from zoopick.service.db.session import make_engine, make_sessionmaker
from zoopick.service.db.types import utcnow
from zoopick.service.dispatch import Dispatcher, job_task_ids
from zoopick.service.queue import broker_options, worker_argv
from zoopick.service.security import get_or_create_tenant
from zoopick.service.settings import EMBEDDED_BROKER

STALL = 3600


@pytest.fixture(scope="module")
def database(new_pg_database):
    url = new_pg_database()
    migrate.upgrade(url)
    engine = make_engine(url)
    yield url, make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def env(database, redis_url, tmp_path):
    """The module's database emptied of jobs (a sweep sees every job), and a Redis key space
    of this test's own that no worker listens on."""
    from zoopick.service.settings import Settings

    url, factory = database
    with factory.begin() as session:
        session.execute(delete(Job))
        tenant = get_or_create_tenant(session, "recovery").id
    broker, prefix = redis_url
    settings = Settings(
        data_dir=tmp_path,
        database_url=url,
        broker_url=broker,
        redis_key_prefix=f"{prefix}rec-{uuid.uuid4().hex[:6]}:",
        stall_seconds=STALL,
        recovery_attempts=2,
        sweep_interval_seconds=0,
        recovery_grace_seconds=100 * STALL,  # the stall alone, unless a test shortens it
    )
    return settings, factory, tenant


def add_job(factory, tenant, *, age: float = 0, finetune: bool = False, **values) -> uuid.UUID:
    """A job row as a worker would have left it, last touched ``age`` seconds ago."""
    stamp = utcnow() - timedelta(seconds=age)
    with factory.begin() as session:
        job = Job(
            tenant_id=tenant,
            request={},
            models=["m1", "m2"],
            metrics=["logme"],
            select_by="logme",
            finetune={"epochs": 1, "workers": 2} if finetune else None,
            **values,
        )
        session.add(job)
        session.flush()
        jid = job.id
        session.execute(update(Job).where(Job.id == jid).values(updated_at=stamp))
    return jid


def row(factory, jid) -> Job:
    with factory() as session:
        return session.get(Job, jid)


def queued_tasks(settings) -> list[tuple[str, str, str]]:
    """(queue, task name, task id) of every message waiting in the broker."""
    client = redis.Redis.from_url(settings.broker_url)
    out = []
    for queue in ("cpu", "gpu"):
        for raw in client.lrange(settings.redis_key_prefix + queue, 0, -1):
            headers = json.loads(raw)["headers"]
            out.append((queue, headers["task"], headers["id"]))
    return out


def test_lost_jobs_are_requeued_failed_or_cancelled(env):
    settings, factory, tenant = env
    now = utcnow()
    dead_lease = {"lease_owner": "gone:1:t", "lease_expires_at": now - timedelta(seconds=5)}
    live_lease = {"lease_owner": "alive:2:t", "lease_expires_at": now + timedelta(seconds=60)}
    training = {"status": "training", "chosen_model": "m1"}
    lease_lost = add_job(factory, tenant, finetune=True, **training, **dead_lease)
    stalled = add_job(factory, tenant, age=STALL + 60, status="scoring", task_ids=["old-score-0"])
    exhausted = add_job(factory, tenant, age=STALL + 60, status="queued", recoveries=2)
    cancelling = add_job(
        factory, tenant, age=STALL + 60, finetune=True, cancel_requested=True, **training
    )
    with factory.begin() as session:
        session.add(
            TrainingRun(job_id=cancelling, model_id="m1", config={}, world_size=2, output_dir="/x")
        )
    healthy = [
        # a live lease is proof of life, even after hours without a finished epoch
        add_job(factory, tenant, age=10 * STALL, finetune=True, **training, **live_lease),
        add_job(factory, tenant, age=STALL - 60, status="scoring"),
        add_job(factory, tenant, age=10 * STALL, status="succeeded"),
    ]

    actions = recovery.sweep(factory, Dispatcher(settings), settings)
    assert {a.job_id: a.action for a in actions} == {
        lease_lost: "requeued",
        stalled: "requeued",
        exhausted: "failed",
        cancelling: "cancelled",
    }

    # the lost training job: its dead lease is cleared and only its fine-tuning is sent again
    job = row(factory, lease_lost)
    assert job.status == "training" and job.recoveries == 1 and job.lease_owner is None
    assert job.task_ids == [f"{lease_lost}-r1-finetune"]
    # the stalled scoring job: its whole canvas again, under fresh ids (the old ones are kept
    # so a cancel still revokes them)
    job = row(factory, stalled)
    assert job.status == "scoring" and job.recoveries == 1
    fresh = [f"{stalled}-r1-score-0", f"{stalled}-r1-score-1", f"{stalled}-r1-select"]
    assert job.task_ids == ["old-score-0", *fresh]
    assert (utcnow() - job.updated_at).total_seconds() < 60  # the stall clock restarts
    sent = queued_tasks(settings)
    assert ("gpu", "zoopick.finetune", f"{lease_lost}-r1-finetune") in sent
    assert ("gpu", "zoopick.score_model", fresh[0]) in sent
    assert ("gpu", "zoopick.score_model", fresh[1]) in sent

    job = row(factory, exhausted)
    assert job.status == "failed" and job.finished_at is not None
    assert job.error.startswith("job lost: no progress while queued since")
    assert "re-queued 2 time(s) already" in job.error and f"longer than {STALL} s" in job.error

    assert row(factory, cancelling).status == "cancelled"
    with factory() as session:
        run = session.scalars(select(TrainingRun).where(TrainingRun.job_id == cancelling)).one()
        assert run.status == "cancelled" and run.finished_at is not None

    for jid in healthy:
        job = row(factory, jid)
        assert job.recoveries == 0 and job.error is None
    assert row(factory, healthy[0]).lease_owner == "alive:2:t"

    # a second pass finds nothing: re-queued jobs have a fresh clock, the rest are finished
    assert recovery.sweep(factory, Dispatcher(settings), settings) == []


def test_a_lease_lost_again_counts_towards_the_limit(env):
    settings, factory, tenant = env
    lease = {"lease_owner": "gone:1:t", "lease_expires_at": utcnow() - timedelta(seconds=1)}
    jid = add_job(
        factory, tenant, finetune=True, status="training", chosen_model="m1", recoveries=1, **lease
    )
    settings = settings.model_copy(update={"recovery_attempts": 1})
    (action,) = recovery.sweep(factory, Dispatcher(settings), settings)
    assert action.action == "failed"
    job = row(factory, jid)
    assert job.status == "failed" and "stopped renewing its lease" in job.error
    assert "gone:1:t" in job.error


def test_a_job_the_broker_cannot_take_is_left_for_the_next_sweep(env):
    settings, factory, tenant = env
    jid = add_job(factory, tenant, age=STALL + 60, status="scoring")
    before = row(factory, jid)
    down = settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})  # nothing there
    assert recovery.sweep(factory, Dispatcher(down), down) == []
    after = row(factory, jid)  # the attempt was rolled back, so the job is still seen as lost
    assert (after.recoveries, after.updated_at, after.status) == (0, before.updated_at, "scoring")
    (action,) = recovery.sweep(factory, Dispatcher(settings), settings)
    assert (action.job_id, action.action) == (jid, "requeued")


def test_concurrent_sweepers_act_on_each_job_once(env):
    settings, factory, tenant = env
    jobs = {add_job(factory, tenant, age=STALL + 1, status="queued") for _ in range(6)}
    results: list[list[recovery.Action]] = []
    start = threading.Barrier(3)

    def one() -> None:
        start.wait()
        results.append(recovery.sweep(factory, Dispatcher(settings), settings))

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    acted = [a.job_id for actions in results for a in actions]
    assert sorted(acted) == sorted(jobs)  # each job once, whichever sweeper got it
    assert all(row(factory, j).recoveries == 1 for j in jobs)
    sent = sorted(t for _, _, t in queued_tasks(settings))  # each job's canvas sent once
    assert sent == sorted(f"{j}-r1-score-{i}" for j in jobs for i in range(2))


def test_the_api_sweeps_at_start_and_periodically(env):
    from fastapi.testclient import TestClient

    from zoopick.app.main import create_app

    settings, factory, tenant = env
    settings = settings.model_copy(update={"sweep_interval_seconds": 1, "recovery_attempts": 0})
    first = add_job(factory, tenant, age=STALL + 1, status="scoring")
    app = create_app(settings)
    with TestClient(app):
        poll(lambda: row(factory, first).status, lambda s: s == "failed", 10, what="start sweep")
        later = add_job(factory, tenant, age=STALL + 1, status="queued")
        poll(lambda: row(factory, later).status, lambda s: s == "failed", 10, what="next sweep")
        assert app.state.sweeper.passes >= 2
    assert not app.state.sweeper._thread.is_alive()  # stopped with the app


def test_a_starting_worker_sweeps_once(env, tmp_path):
    settings, factory, tenant = env
    jid = add_job(factory, tenant, age=STALL + 1, status="scoring")
    proc_env = env_for(settings)
    proc_env.update(ZOOPICK_STALL_SECONDS=str(STALL), ZOOPICK_RECOVERY_ATTEMPTS="0")
    cmd = worker_argv("cpu", 1, "solo", "info") + ["--without-heartbeat"]
    worker = Proc("worker-sweep", cmd, proc_env, tmp_path)
    try:
        job = poll(lambda: row(factory, jid), lambda j: j.status != "scoring", 60, what="sweep")
    finally:
        worker.stop()
    assert job.status == "failed" and job.error.startswith("job lost: no progress while scoring")


def test_zoopick_sweep_command(env, monkeypatch):
    from typer.testing import CliRunner

    from zoopick.service.settings import get_settings
    from zoopick.service_cli import service_app

    settings, factory, tenant = env
    jid = add_job(factory, tenant, age=STALL + 1, status="queued")
    for name, value in {
        "ZOOPICK_DATA_DIR": str(settings.data_dir),
        "ZOOPICK_DATABASE_URL": settings.database_url,
        "ZOOPICK_BROKER_URL": settings.broker_url,
        "ZOOPICK_REDIS_KEY_PREFIX": settings.redis_key_prefix,
        "ZOOPICK_STALL_SECONDS": str(STALL),
    }.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    try:
        done = CliRunner().invoke(service_app, ["sweep"])
    finally:
        get_settings.cache_clear()
    assert done.exit_code == 0, done.output
    assert f"requeued  {jid}" in done.stdout and "no progress while queued" in done.stdout
    job = row(factory, jid)
    assert job.recoveries == 1 and job.status == "queued"


GRACE = 30


def beating(factory, queues: str) -> None:
    """A live worker on ``queues`` (its heartbeat row as the worker writes it), the only one."""
    with factory.begin() as session:
        session.execute(delete(WorkerHeartbeat))
        now = utcnow()
        session.add(WorkerHeartbeat(name=f"w/{queues}", hostname="w", pid=1, queues=queues,
                                    started_at=now, seen_at=now))  # fmt: skip


def submitted(factory, dispatcher, jid) -> list[str]:
    """Send job ``jid``'s canvas to the broker, its task ids recorded as the API does."""
    with factory.begin() as session:  # its clock left as it was (no progress)
        job = session.get(Job, jid)
        ids = job_task_ids(job)
        session.execute(
            update(Job).where(Job.id == jid).values(task_ids=ids, updated_at=Job.updated_at)
        )
    dispatcher.submit_job(row(factory, jid))
    return ids


def test_scoring_jobs_no_task_attends_are_resent_within_the_grace(env):
    """A scoring job whose shared scoring lease lapsed and that made no progress for the grace
    is lost, as a dead worker or a broker that lost its messages leave it, once a gpu worker
    is up and idle; one whose models are all scored gets its selection again (the canvas:
    settled models return at once). Not while any job's task holds a live lease and the
    broker still holds their tasks: they are queued behind that work."""
    settings, factory, tenant = env
    settings = settings.model_copy(update={"recovery_grace_seconds": GRACE})
    now = utcnow()
    lapsed = {"lease_owner": "score:x", "lease_expires_at": now - timedelta(seconds=5)}
    lost = add_job(factory, tenant, age=GRACE + 10, status="scoring", **lapsed)
    scored = add_job(factory, tenant, age=GRACE + 10, status="scoring", progress=1.0)
    exhausted = add_job(factory, tenant, age=GRACE + 10, status="queued", recoveries=2)
    recent = add_job(factory, tenant, age=GRACE - 10, status="scoring")
    live = {"lease_owner": "score:y", "lease_expires_at": now + timedelta(seconds=GRACE)}
    busy = add_job(factory, tenant, age=GRACE + 10, status="scoring", **live)
    with factory.begin() as session:
        session.execute(delete(WorkerHeartbeat))

    dispatcher = Dispatcher(settings)
    assert recovery.sweep(factory, dispatcher, settings) == []  # no worker could run them
    beating(factory, "cpu")
    assert recovery.sweep(factory, dispatcher, settings) == []  # none on the gpu queue
    beating(factory, "cpu,gpu")
    for jid in (lost, scored, exhausted, recent):
        submitted(factory, dispatcher, jid)
    assert recovery.sweep(factory, dispatcher, settings) == []  # busy, and their tasks queued
    with factory.begin() as session:  # the busy job's task ends
        session.execute(update(Job).where(Job.id == busy).values(status="succeeded"))
    validating = add_dataset(factory, tenant, "validating", 0)  # a worker validates it
    assert recovery.sweep(factory, dispatcher, settings) == []
    with factory.begin() as session:
        session.execute(update(Dataset).where(Dataset.id == validating).values(status="ready"))

    actions = recovery.sweep(factory, dispatcher, settings)
    assert {a.job_id: a.action for a in actions} == {
        lost: "requeued",
        scored: "requeued",
        exhausted: "failed",
    }
    assert all("no task attended it" in a.reason for a in actions)
    job = row(factory, lost)
    assert job.recoveries == 1 and job.lease_owner is None and job.status == "scoring"
    sent = queued_tasks(settings)
    assert ("gpu", "zoopick.score_model", f"{lost}-r1-score-1") in sent
    assert row(factory, scored).task_ids[-1] == f"{scored}-r1-select"
    job = row(factory, exhausted)
    assert job.status == "failed" and "no task attended it while queued" in job.error
    assert "re-queued 2 time(s) already" in job.error
    assert row(factory, recent).recoveries == 0
    # the grace starts again for the re-sent jobs
    assert recovery.sweep(factory, dispatcher, settings) == []
    later = utcnow() + timedelta(seconds=GRACE + 5)
    beating(factory, "cpu,gpu")
    with factory.begin() as session:  # a worker still beating then
        session.execute(update(WorkerHeartbeat).values(seen_at=later))
    again = recovery.sweep(factory, dispatcher, settings, now=later)
    assert {a.job_id for a in again} == {lost, scored, recent}


def test_a_model_whose_task_died_is_resent_while_the_others_are_still_scored(env):
    """Each model being scored holds its own lease: one lapsed (its task died with its worker)
    gets the job re-sent at the next sweep, while another model's task still runs and keeps
    the job's shared scoring lease, and the job's progress, fresh. The shared lease alone hid
    such a model until the others were done (issue 43: up to 184 s). A live model lease keeps
    the job attended, and the gpu worker busy for every job's unattended check."""
    settings, factory, tenant = env
    settings = settings.model_copy(update={"recovery_grace_seconds": GRACE})
    now = utcnow()
    shared = {"lease_owner": "score:j", "lease_expires_at": now + timedelta(seconds=GRACE)}
    jid = add_job(factory, tenant, status="scoring", **shared)  # progress a moment ago
    idle = add_job(factory, tenant, age=GRACE + 10, status="scoring")  # nothing attends it
    dispatcher = Dispatcher(settings)
    submitted(factory, dispatcher, idle)  # ... but its tasks wait in the broker
    with factory.begin() as session:
        session.add(ScoreLease(job_id=jid, model_id="m1", lease_owner=f"{jid}-score-0",
                               lease_expires_at=now + timedelta(seconds=GRACE)))  # fmt: skip
        session.add(ScoreLease(job_id=jid, model_id="m2", lease_owner=f"{jid}-score-1",
                               lease_expires_at=now + timedelta(seconds=1)))  # fmt: skip
    beating(factory, "cpu,gpu")
    assert recovery.sweep(factory, dispatcher, settings) == []  # both models' tasks alive

    later = now + timedelta(seconds=2)  # m2's task stopped renewing; m1's goes on
    with factory.begin() as session:
        session.execute(update(WorkerHeartbeat).values(seen_at=later))
    (action,) = recovery.sweep(factory, dispatcher, settings, now=later)
    assert (action.job_id, action.action) == (jid, "requeued")
    assert action.reason == f"the task scoring m2 ({jid}-score-1) stopped renewing its lease"
    job = row(factory, jid)
    assert job.recoveries == 1 and job.status == "scoring"
    fresh = [f"{jid}-r1-score-0", f"{jid}-r1-score-1", f"{jid}-r1-select"]
    assert job.task_ids == fresh
    sent = {t for _, _, t in queued_tasks(settings) if t.startswith(str(jid))}
    assert sent == set(fresh[:2])  # select: the chord's
    with factory() as session:  # the dead lease is gone (the new task takes it), m1's stays
        leases = {s.model_id: s.lease_owner for s in session.scalars(select(ScoreLease))}
    assert leases == {"m1": f"{jid}-score-0"}
    # the loss is counted once; the idle job waits: m1's live task holds back its queued tasks
    assert recovery.sweep(factory, dispatcher, settings, now=later) == []
    assert row(factory, idle).recoveries == 0


def gpu_messages(settings) -> dict[str, Callable[[], None]]:
    """Task id -> how to lose it, of every message waiting on the gpu queue of ``settings``'
    broker: Redis' list, or the embedded broker's files."""
    if settings.embedded_broker:
        folder = Path(broker_options(settings)["data_folder_in"])
        files = list(folder.glob("*.gpu.msg"))
        return {json.loads(f.read_bytes())["headers"]["id"]: f.unlink for f in files}
    client = redis.Redis.from_url(settings.broker_url)
    key = settings.redis_key_prefix + "gpu"
    return {
        json.loads(raw)["headers"]["id"]: partial(client.lrem, key, 1, raw)
        for raw in client.lrange(key, 0, -1)
    }


@pytest.mark.parametrize("broker", ["redis", "files"])
def test_a_job_the_broker_lost_is_resent_while_the_workers_are_busy(env, broker):
    """A job with no live lease and no progress for the grace, while another job's task keeps
    the only gpu worker busy (as an hours-long fine-tune does): the sweeper asks the broker.
    While its tasks are still queued it waits for the work ahead of it; once the broker no
    longer holds any of them (lost while queued, e.g. a Redis restarted without persistence)
    it is re-sent at the next sweep, not after the stall. Issue 43: before, only the stall
    (6 h by default) found it. On Redis and on the embedded broker's folder."""
    settings, factory, tenant = env
    settings = settings.model_copy(update={"recovery_grace_seconds": GRACE})
    if broker == "files":  # the embedded broker (its chords' results still in Redis)
        settings = settings.model_copy(update={"broker_url": EMBEDDED_BROKER})
    now = utcnow()
    training = {"status": "training", "chosen_model": "m1", "lease_owner": "ft:1",
                "lease_expires_at": now + timedelta(seconds=GRACE)}  # fmt: skip
    add_job(factory, tenant, finetune=True, **training)  # the busy gpu worker's work
    waiting = add_job(factory, tenant, age=GRACE + 10, status="queued")
    beating(factory, "cpu,gpu")
    dispatcher = Dispatcher(settings)
    ids = submitted(factory, dispatcher, waiting)
    assert recovery.sweep(factory, dispatcher, settings) == []  # queued behind the fine-tune
    assert row(factory, waiting).recoveries == 0

    queued = gpu_messages(settings)
    assert set(queued) == set(ids[:2])
    queued[ids[0]]()  # one lost: the other still runs once the fine-tune is done
    assert recovery.sweep(factory, dispatcher, settings) == []
    gpu_messages(settings)[ids[1]]()  # both lost (a Redis restarted without persistence)
    (action,) = recovery.sweep(factory, dispatcher, settings)
    assert (action.job_id, action.action) == (waiting, "requeued")
    assert "the broker holds none of its 3 task messages" in action.reason
    job = row(factory, waiting)
    assert job.recoveries == 1 and job.status == "queued"
    fresh = [f"{waiting}-r1-score-0", f"{waiting}-r1-score-1", f"{waiting}-r1-select"]
    assert job.task_ids == [*ids, *fresh]
    assert set(gpu_messages(settings)) == set(fresh[:2])
    # re-sent, and queued behind the same work again: it waits, however long that takes
    later = utcnow() + timedelta(seconds=GRACE + 5)
    with factory.begin() as session:
        session.execute(update(WorkerHeartbeat).values(seen_at=later))
        session.execute(update(Job).where(Job.status == "training")
                        .values(lease_expires_at=later + timedelta(seconds=GRACE)))  # fmt: skip
    assert recovery.sweep(factory, dispatcher, settings, now=later) == []
    assert row(factory, waiting).recoveries == 1


def add_dataset(factory, tenant, status: str, age: float) -> uuid.UUID:
    with factory.begin() as session:
        ds = Dataset(tenant_id=tenant, name="d", format="npz", filename="d.npz",
                     size_bytes=1, file_sha256="0" * 64, storage_path="tenants/x/d.npz",
                     status=status)  # fmt: skip
        session.add(ds)
        session.flush()
        stamp = utcnow() - timedelta(seconds=age)
        session.execute(update(Dataset).where(Dataset.id == ds.id).values(updated_at=stamp))
        return ds.id


def test_validations_no_task_attends_are_resent_within_the_grace(env):
    settings, factory, tenant = env
    settings = settings.model_copy(update={"recovery_grace_seconds": GRACE})
    with factory.begin() as session:
        session.execute(delete(Dataset))
    lost = add_dataset(factory, tenant, "validating", GRACE + 10)
    waiting = add_dataset(factory, tenant, "uploaded", GRACE + 10)
    dispatcher = Dispatcher(settings)
    beating(factory, "gpu")
    assert recovery.sweep_datasets(factory, dispatcher, settings, utcnow()) == []
    beating(factory, "cpu")
    live = {"lease_owner": "score:y", "lease_expires_at": utcnow() + timedelta(seconds=GRACE)}
    scoring = add_job(factory, tenant, status="scoring", **live)  # on the same worker, maybe
    assert recovery.sweep_datasets(factory, dispatcher, settings, utcnow()) == []
    with factory.begin() as session:
        session.execute(update(Job).where(Job.id == scoring).values(status="succeeded"))
    add_dataset(factory, tenant, "validating", GRACE - 10)  # its validation runs
    # one validation running: the others may be queued behind it
    assert recovery.sweep_datasets(factory, dispatcher, settings, utcnow()) == []
    with factory.begin() as session:  # the running one keeps its clock fresh, then dies
        recovery.touch_validation(session, lost)
    later = utcnow() + timedelta(seconds=GRACE + 5)
    with factory.begin() as session:
        session.execute(update(WorkerHeartbeat).values(seen_at=later))
    actions = recovery.sweep_datasets(factory, dispatcher, settings, later)
    assert len(actions) == 3 and {a.action for a in actions} == {"requeued"}
    assert {a.job_id for a in actions} >= {lost, waiting}
    sent = [name for _, name, _ in queued_tasks(settings)]
    assert sent.count("zoopick.validate_dataset") == 3
