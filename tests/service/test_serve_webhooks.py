"""Issue 41: a phase's webhook waited behind scoring on ``zoopick serve``'s one local worker
(job.scoring delivered 65 s after the event). Serve's ``LocalWorker`` now runs a consumer of
the ``webhooks`` queue beside the worker of jobs and datasets; real processes on the embedded
setup (SQLite, file broker), a real receiver on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from datetime import timedelta

from sqlalchemy import select

from tests.service.procs import poll
from tests.service.test_webhooks import Receiver, _pending_delivery
from zoopick.service import liveness
from zoopick.service.db import migrate
from zoopick.service.db.models import WebhookDelivery, WorkerHeartbeat
from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
from zoopick.service.db.types import utcnow
from zoopick.service.dispatch import Dispatcher
from zoopick.service.queue import CPU, WEBHOOKS
from zoopick.service.settings import Settings
from zoopick.serving import LocalWorker

BOUND = 20.0
"""Seconds from sending a delivery to its arrival while the worker of jobs is busy (measured:
0.9 s on a quiet machine, the file broker polling its folder; 9.6 s at a load average of 10,
and a full suite at a load of 16 missed 5 s; on one worker it waited for the busy pool
process, without bound, so any finite bound tells the two designs apart)."""


def _embedded(tmp_path, monkeypatch) -> Settings:
    for name in [n for n in os.environ if n.startswith("ZOOPICK_")]:  # the suite's own stack
        monkeypatch.delenv(name)
    settings = Settings(
        data_dir=tmp_path / "data",
        webhook_allow_networks=["127.0.0.1/32"],
        heartbeat_seconds=0.5,
        heartbeat_timeout_seconds=3,
    )
    settings.ensure_dirs()
    migrate.upgrade(settings.database_url)
    return settings


def _status(factory, delivery) -> str:
    with factory() as session:
        return session.get(WebhookDelivery, delivery).status


def _beating(factory) -> dict[str, str]:
    """Fresh heartbeat rows: worker name -> queues."""
    fresh = utcnow() - timedelta(seconds=3)
    with factory() as session:
        rows = session.execute(
            select(WorkerHeartbeat.name, WorkerHeartbeat.queues).where(
                WorkerHeartbeat.seen_at >= fresh
            )
        )
        return dict(rows.all())


def test_a_delivery_is_sent_while_the_local_worker_is_busy_and_a_dead_one_is_restarted(
    tmp_path, monkeypatch
):
    """The worker of jobs and datasets is stopped (its whole group, as one held by a long
    scoring task looks to the queue: it takes nothing more): a delivery sent then arrives
    within :data:`BOUND`, by the webhook consumer. That consumer keeps beating meanwhile, and
    the watch still finds the stopped worker stalled and starts another. The consumer killed
    outright is replaced in turn, and the new one delivers."""
    settings = _embedded(tmp_path, monkeypatch)
    engine = make_engine(settings.database_url)
    factory = make_sessionmaker(engine)
    receiver = Receiver()
    local = LocalWorker(settings, concurrency=1, nice=0, grace=3)
    stopped = None
    try:
        local.start()
        beating = poll(
            lambda: _beating(factory), lambda b: len(b) == 2, 60, what="both local workers"
        )
        assert sorted(beating.values()) == ["cpu,gpu", WEBHOOKS]  # deliveries: one consumer
        stopped = local.proc
        os.killpg(stopped.pid, signal.SIGSTOP)

        delivery = _pending_delivery(factory, "hooks-serve", receiver.url)
        sent = time.monotonic()
        Dispatcher(settings).deliver_webhook(str(delivery))
        poll(lambda: receiver.calls, bool, BOUND, interval=0.05, what="the delivery")
        took = time.monotonic() - sent
        # the row is marked after the receiver's answer: poll it (CI at 1cc1520 read it early)
        poll(lambda: _status(factory, delivery), lambda s: s == "delivered", 10, what="its row")

        # the consumer's fresh heartbeat does not hide the stopped worker: it is replaced
        # the watch counts a restart once the new process is in place: poll the count
        poll(lambda: local._watch.restarts, bool, 30, what="the stalled worker's restart")
        assert local.proc is not stopped
        assert local._watch.restarts == 1  # the consumer itself was never taken for stalled

        # the consumer dies (while the new worker starts): it is restarted at once, and both
        # new processes beat (rows are named host/pid: a dead one's row is not taken for it)
        consumer = local.procs[WEBHOOKS]
        os.killpg(consumer.pid, signal.SIGKILL)
        poll(lambda: local._watch.restarts, lambda n: n == 2, 10, what="its restart")
        assert local.procs[WEBHOOKS] is not consumer
        host = socket.gethostname()
        poll(
            lambda: _beating(factory),
            lambda b: (
                b.get(f"{host}/{local.proc.pid}") == "cpu,gpu"
                and b.get(f"{host}/{local.procs[WEBHOOKS].pid}") == WEBHOOKS
            ),
            60,
            what="the new worker's and the new consumer's heartbeats",
        )
        again = _pending_delivery(factory, "hooks-serve-2", receiver.url)
        Dispatcher(settings).deliver_webhook(str(again))
        poll(lambda: len(receiver.calls), lambda n: n == 2, BOUND, what="the second delivery")
    finally:
        local.begin_stop()
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(stopped.pid, signal.SIGKILL)
        local.stop()
        receiver.close()
        engine.dispose()
    assert took < BOUND, took
    assert all(p.poll() is not None for p in local.procs.values())


def test_the_stall_check_and_readiness_ignore_a_webhook_consumers_heartbeat(tmp_path, monkeypatch):
    """Heartbeat rows as the two local workers write them: the webhook consumer's fresh, the
    worker of jobs' stale. The watch finds the ``cpu`` worker stalled and not the consumer,
    and /readyz's worker status has no live worker (a consumer of deliveries runs no job)."""
    settings = _embedded(tmp_path, monkeypatch)
    engine = make_engine(settings.database_url)
    factory = make_sessionmaker(engine)
    now = utcnow()
    host = socket.gethostname()
    rows = {"a/1": ("cpu,gpu", now - timedelta(seconds=10)), "a/2": (WEBHOOKS, now)}
    with session_scope(factory) as session:
        for name, (queues, seen) in rows.items():
            session.add(WorkerHeartbeat(name=name, hostname=host, pid=1, queues=queues,
                                        started_at=seen, seen_at=seen))  # fmt: skip
    watch = liveness.LocalWorkerWatch(settings, lambda _: None, watched=(CPU, WEBHOOKS))
    try:
        watch.started = dict.fromkeys(watch.watched, now - timedelta(seconds=60))
        assert watch.stalled(CPU) and not watch.stalled(WEBHOOKS)
        with factory() as session:
            status = liveness.worker_status(session, settings)
        assert status.live == [] and status.stale == ["a/1"], status
        # the worker of jobs beats again: neither is stalled, and it is the live one
        with session_scope(factory) as session:
            session.get(WorkerHeartbeat, "a/1").seen_at = utcnow()
        assert not watch.stalled(CPU) and not watch.stalled(WEBHOOKS)
        with factory() as session:
            assert liveness.worker_status(session, settings).live == ["a/1"]
    finally:
        watch.engine.dispose()
        engine.dispose()


def test_the_watch_waits_for_a_starting_workers_first_beat(tmp_path, monkeypatch):
    """A local worker whose pid has no heartbeat row yet is starting, not stalled, past twice
    the heartbeat timeout (under load, the watch restarted workers still importing torch) and
    until :data:`liveness.START_UP_SECONDS`; once it has beaten, a beat missing for the
    timeout is a stall again."""
    settings = _embedded(tmp_path, monkeypatch)  # heartbeat timeout 3 s
    engine = make_engine(settings.database_url)
    factory = make_sessionmaker(engine)
    host = socket.gethostname()
    watch = liveness.LocalWorkerWatch(settings, lambda _: None, pid=lambda _: 4242)
    try:
        now = utcnow()
        watch.started[CPU] = now - timedelta(seconds=60)  # 20 timeouts, no beat yet
        assert not watch.stalled(CPU, now)
        watch.started[CPU] = now - timedelta(seconds=liveness.START_UP_SECONDS + 1)
        assert watch.stalled(CPU, now)  # a worker hanging while it starts is still caught
        # it beat once, 10 s ago, and not since: stalled, however recent its start
        watch.started[CPU] = now - timedelta(seconds=60)
        seen = now - timedelta(seconds=10)
        with session_scope(factory) as session:
            row = {"hostname": host, "pid": 4242, "started_at": seen, "seen_at": seen}
            session.add(WorkerHeartbeat(name=f"{host}/4242", queues="cpu,gpu", **row))
        assert watch.stalled(CPU, now)
        # without a known pid the watch keeps the old rule: twice the timeout, then stalled
        plain = liveness.LocalWorkerWatch(settings, lambda _: None)
        plain.started[CPU] = now - timedelta(seconds=60)
        assert plain.stalled(CPU, now)
        plain.engine.dispose()
    finally:
        watch.engine.dispose()
        engine.dispose()
