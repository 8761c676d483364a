"""Liveness of the work itself: task delivery counts and worker heartbeats, in the database.

*Deliveries.* Tasks are acknowledged late and re-queued when their worker dies, so work is not
lost with a crashed worker; but work that *kills* its worker (a memory bomb under the kernel's
OOM killer) would then be re-delivered forever, each time taking a worker down. Each task counts
its start under a key for its piece of work (:func:`count_delivery`); past
``settings.max_deliveries`` starts the previous ones all died, and the task fails the work with
"worker died N times while ..." instead of running it again.

*Heartbeats.* A worker's main process can be alive, and its pool processes too, while no task
runs: after both prefork pool processes of a worker were SIGKILLed, Celery replaces them but
its main process goes on reserving tasks that it never hands to them (reproduced with the
embedded file broker, ``tests/service/test_serve_watch.py``). So neither a live process nor a
thread beating in a pool process proves anything. The heartbeat is written by the worker's
main process (:class:`Heartbeat`, every ``heartbeat_seconds``) and only while that worker is
healthy (:class:`DispatchCheck`): its event loop runs, and no task it reserved has waited
longer than ``heartbeat_timeout_seconds`` for a pool process while one is free. ``/readyz``
(and the dashboard) report the workers seen within ``heartbeat_timeout_seconds``
(:func:`worker_status`). A worker that finds itself stalled hands the tasks it reserved back
to the broker and shuts down (``zoopick.workers.tasks``): a worker that cannot run tasks must
not hold them, where another worker (or its own restart) can run them; ``zoopick serve``
restarts a local worker that exited or stopped beating (:class:`LocalWorkerWatch`). Work lost
otherwise (a worker killed outright) is recovered by the sweepers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from zoopick.service.db.models import TaskDelivery, WorkerHeartbeat
from zoopick.service.db.session import session_scope
from zoopick.service.db.types import utcnow
from zoopick.service.queue import CPU, GPU
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)


def _upsert(session: Session):
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


def count_delivery(session: Session, key: str) -> int:
    """Count one more start of the task doing ``key``; returns the count including this one.
    One atomic statement, so concurrent deliveries each get their own number."""
    insert = _upsert(session)
    now = utcnow()
    stmt = insert(TaskDelivery).values(key=key, count=1, updated_at=now)
    stmt = stmt.on_conflict_do_update(
        index_elements=[TaskDelivery.key],
        set_={"count": TaskDelivery.count + 1, "updated_at": now},
    ).returning(TaskDelivery.count)
    return int(session.execute(stmt).scalar_one())


def died_too_often(count: int, settings: Settings, doing: str) -> str | None:
    """The error for work whose ``count``-th start follows ``count - 1`` that died, if that
    is more than ``settings.max_deliveries`` allows."""
    died = count - 1
    if died >= settings.max_deliveries:
        return (
            f"worker died {died} times while {doing} (ZOOPICK_MAX_DELIVERIES="
            f"{settings.max_deliveries}); not run again"
        )
    return None


def beat(factory: sessionmaker[Session], name: str, hostname: str, pid: int, queues: str) -> None:
    insert = None
    with session_scope(factory) as session:
        insert = _upsert(session)
        now = utcnow()
        stmt = insert(WorkerHeartbeat).values(
            name=name, hostname=hostname, pid=pid, queues=queues, started_at=now, seen_at=now
        )
        session.execute(
            stmt.on_conflict_do_update(index_elements=[WorkerHeartbeat.name], set_={"seen_at": now})
        )


def forget(factory: sessionmaker[Session], name: str) -> None:
    """Remove a heartbeat row (a worker shutting down cleanly)."""
    with session_scope(factory) as session:
        session.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.name == name))


class Heartbeat:
    """A daemon thread beating for one process every ``interval`` seconds, while ``problem()``
    finds nothing wrong (a worker that cannot run tasks must look dead from outside)."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        name: str,
        hostname: str,
        pid: int,
        queues: str,
        interval: float,
        problem: Callable[[], str | None] = lambda: None,
        on_problem: Callable[[str], None] | None = None,
    ) -> None:
        self.args = (factory, name, hostname, pid, queues)
        self.interval = interval
        self.problem, self.on_problem = problem, on_problem
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zoopick-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        reported = None
        while not self._stop.is_set():
            try:
                problem = self.problem()
                if problem is None:
                    beat(*self.args)
                elif reported is None:
                    log.error("this worker cannot run tasks, so it stops beating: %s", problem)
                    if self.on_problem is not None:
                        self.on_problem(problem)
                reported = problem
            except Exception:  # the database is away: try again next time
                log.warning("worker heartbeat failed", exc_info=True)
            self._stop.wait(self.interval)


class Renewal:
    """A daemon thread calling ``renew()`` every ``interval`` seconds while a task's work runs
    (``with Renewal(...):``): the proof of life the sweeper reads (a scoring task's lease, a
    validating dataset's ``updated_at``) must not lapse during one long forward pass or load.
    A failed call (the database is away) is logged and tried again at the next tick."""

    def __init__(self, renew: Callable[[], object], interval: float) -> None:
        self.renew, self.interval = renew, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zoopick-renewal", daemon=True)

    def __enter__(self) -> Renewal:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.renew()
            except Exception:  # noqa: BLE001 - the next tick tries again
                log.warning("renewing a task's lease failed", exc_info=True)


def _ids(requests: Iterable[object]) -> set[str]:
    """Ids of a ``celery.worker.state`` request set, read from another thread (the worker's
    event loop may change the set meanwhile: read it again)."""
    for _ in range(100):
        try:
            return {r.id for r in list(requests)}  # type: ignore[attr-defined]
        except RuntimeError:  # changed size during iteration
            continue
    return set()


class DispatchCheck:
    """Whether a Celery worker's main process still hands the tasks it reserved to its pool.

    :meth:`problem` is called from the heartbeat thread of the worker's main process, and
    :meth:`loop_tick` from the worker's event loop (the caller asks the loop to run it after
    each check). A task reserved but not yet accepted by a pool process normally waits
    milliseconds, or until a busy pool frees a process; waiting longer than ``timeout``
    seconds while a pool process is free means the worker reserves work it will never run.
    ``pool()`` gives the pool's process ids: a process counts only once it has been there for
    ``start_grace`` seconds (a new one may still be starting: importing torch, say).
    An event loop that ran no tick for ``timeout`` seconds is stuck. Both spans are measured
    from what this thread saw, and start afresh after a gap in the checks themselves (the
    whole process was stopped or suspended: nothing could be seen then)."""

    def __init__(
        self,
        pool: Callable[[], Iterable[int]],
        timeout: float,
        start_grace: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool, self.timeout, self.clock = pool, timeout, clock
        self.start_grace = timeout if start_grace is None else start_grace
        self.waiting_since: dict[str, float] = {}
        self.pool_seen: dict[int, float] = {}
        self.ticks = 0
        self._ticks_seen = 0
        self._quiet_since: float | None = None
        self._last_check: float | None = None

    def loop_tick(self) -> None:
        self.ticks += 1

    def problem(self) -> str | None:
        from celery.worker import state

        now = self.clock()
        if self._last_check is not None and now - self._last_check > self.timeout:
            self.waiting_since, self._quiet_since = {}, None
        self._last_check = now
        if self.ticks != self._ticks_seen:
            self._ticks_seen, self._quiet_since = self.ticks, None
        elif self._quiet_since is None:
            self._quiet_since = now
        elif now - self._quiet_since > self.timeout:
            return f"its event loop has not run for {now - self._quiet_since:.0f} s"
        active = _ids(state.active_requests)
        waiting = _ids(state.reserved_requests) - active
        pids = set(self.pool())
        self.pool_seen = {pid: self.pool_seen.get(pid, now) for pid in pids}
        started = [pid for pid, seen in self.pool_seen.items() if now - seen >= self.start_grace]
        free = len(started) - len(active)
        if free <= 0:  # every pool process is busy: waiting is normal, start counting later
            self.waiting_since = {}
            return None
        self.waiting_since = {i: self.waiting_since.get(i, now) for i in waiting}
        oldest = min(self.waiting_since.values(), default=now)
        if now - oldest > self.timeout:
            return (
                f"{len(waiting)} reserved task(s) not started for {now - oldest:.0f} s while "
                f"{free} pool process(es) are free"
            )
        return None


NO_WORKER_SEEN = (
    "no worker has been seen yet: uploads and jobs wait in the queue until one runs "
    "(zoopick worker, or the local worker of zoopick serve while it starts)"
)


def consumes(queues: str, queue: str) -> bool:
    """Whether a heartbeat row's ``queues`` (``cpu,gpu,webhooks``) include ``queue``."""
    return queue in queues.split(",")


def runs_jobs(queues: str) -> bool:
    """Whether a worker consuming ``queues`` runs datasets' and jobs' tasks: a consumer of
    webhook deliveries alone (``serve``'s, ``zoopick worker --queues webhooks``) does not,
    so it does not make a service without any other worker ready. A row whose queues are
    unknown (empty) counts, as it did before rows named them."""
    return not queues or consumes(queues, CPU) or consumes(queues, GPU)


@dataclass(frozen=True)
class WorkerStatus:
    live: list[str]
    stale: list[str]
    last_seen: datetime | None

    def problem(self) -> str | None:
        """Why no worker can run tasks: none was ever seen (e.g. the local worker of ``serve``
        is still starting), or those seen stopped beating. A service without a worker only
        queues work, so it is not ready (``/readyz``)."""
        if self.live:
            return None
        if not self.stale:
            return NO_WORKER_SEEN
        ago = (utcnow() - self.last_seen).total_seconds() if self.last_seen else 0
        return (
            f"no live worker: the last heartbeat was {ago:.0f} s ago "
            f"({len(self.stale)} worker(s) stopped or stalled)"
        )

    def summary(self) -> str:
        if self.live:
            return f"ok ({len(self.live)} live worker(s))"
        return self.problem() or NO_WORKER_SEEN


def worker_status(
    session: Session, settings: Settings, now: datetime | None = None
) -> WorkerStatus:
    """Worker processes that run jobs' and datasets' tasks (:func:`runs_jobs`) seen within
    the heartbeat timeout, and those not (rows older than a day are ignored: a worker retired
    long ago is not a stalled one)."""
    now = now or utcnow()
    fresh = now - timedelta(seconds=settings.heartbeat_timeout_seconds)
    rows = [
        (name, seen)
        for name, queues, seen in session.execute(
            select(WorkerHeartbeat.name, WorkerHeartbeat.queues, WorkerHeartbeat.seen_at).where(
                WorkerHeartbeat.seen_at >= now - timedelta(days=1)
            )
        )
        if runs_jobs(queues)
    ]
    live = [name for name, seen in rows if seen >= fresh]
    stale = [name for name, seen in rows if seen < fresh]
    last = max((seen for _, seen in rows), default=None)
    return WorkerStatus(live, stale, last)


START_UP_SECONDS = 300.0
"""How long a local worker that has not beaten once since it was (re)started is taken to be
starting (importing torch, connecting to the broker and the database), not stalled, when the
watch knows its pid. Its first beat ends that grace; from then on ``heartbeat_timeout_seconds``
without a beat is a stall. Twice the timeout alone (60 s by default) was too short under load:
at a load average of 16 the watch restarted local workers that were still starting, and each
new one started again from nothing. A worker holds no task before its first beat (it beats
from ``worker_ready``), so the longer grace delays only a worker that hangs while starting."""


class LocalWorkerWatch:
    """``zoopick serve``'s watch over its own local workers, each named by a queue it consumes
    (``watched``: ``cpu`` for the worker of jobs and datasets, ``webhooks`` for the consumer of
    deliveries): when no worker on this host whose queues include that queue has beaten for
    ``heartbeat_timeout_seconds`` (after a start-up grace of twice that, and while one whose
    ``pid`` is known has not beaten once, :data:`START_UP_SECONDS`), that worker is
    stalled (it reserves tasks it does not run, or it hangs): ``restart(queue)`` is called, as
    it is at once when ``exited(queue)`` (a stalled worker gives its reserved tasks back and
    exits). Only the heartbeats of workers on that queue count: the webhook consumer beating
    does not hide a dead scoring worker. Work lost with a worker killed outright is recovered
    by the sweepers (lost jobs and lost dataset validations)."""

    def __init__(
        self,
        settings: Settings,
        restart: Callable[[str], None],
        exited: Callable[[str], bool] = lambda _: False,
        watched: tuple[str, ...] = (CPU,),
        pid: Callable[[str], int | None] = lambda _: None,
    ) -> None:
        from zoopick.service.db.session import make_engine, make_sessionmaker

        self.settings = settings
        self.restart, self.exited, self.watched, self.pid = restart, exited, watched, pid
        self.engine = make_engine(settings.database_url)
        self.factory = make_sessionmaker(self.engine)
        self.started = dict.fromkeys(watched, utcnow())
        """When each watched worker was (re)started: its start-up grace runs from there."""
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zoopick-worker-watch", daemon=True)

    def start(self) -> LocalWorkerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.engine.dispose()

    def stalled(self, queue: str = CPU, now: datetime | None = None) -> bool:
        """Whether the local worker on ``queue`` is past its start-up grace and no worker of
        this host on ``queue`` has beaten within the heartbeat timeout. A worker whose pid is
        known and that has not beaten once since its start is still starting until
        :data:`START_UP_SECONDS` have passed."""
        import socket

        now = now or utcnow()
        timeout = timedelta(seconds=self.settings.heartbeat_timeout_seconds)
        since = now - self.started[queue]
        if since < 2 * timeout:
            return False
        pid = self.pid(queue)
        with self.factory() as session:
            rows = session.execute(
                select(WorkerHeartbeat.pid, WorkerHeartbeat.queues, WorkerHeartbeat.seen_at).where(
                    WorkerHeartbeat.hostname == socket.gethostname(),
                    WorkerHeartbeat.seen_at >= min(now - timeout, self.started[queue]),
                )
            ).all()
        if any(consumes(queues, queue) and seen >= now - timeout for _, queues, seen in rows):
            return False
        starting = pid is not None and not any(row_pid == pid for row_pid, _, _ in rows)
        return not (starting and since < timedelta(seconds=START_UP_SECONDS))

    def _loop(self) -> None:
        interval = max(1.0, self.settings.heartbeat_timeout_seconds / 3)
        while not self._stop.wait(interval):
            for queue in self.watched:
                try:
                    self._check(queue)
                except Exception:  # noqa: BLE001 - the watch must outlive a database hiccup
                    log.warning("watching the local %s worker failed", queue, exc_info=True)

    def _check(self, queue: str) -> None:
        if self.exited(queue):
            log.warning("the local %s worker exited: restarting it", queue)
        elif self.stalled(queue):
            log.warning(
                "the local %s worker has not beaten for %s s: restarting it",
                queue,
                self.settings.heartbeat_timeout_seconds,
            )
        else:
            return
        self.restart(queue)
        self.restarts += 1
        self.started[queue] = utcnow()
