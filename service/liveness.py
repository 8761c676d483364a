"""Liveness of the work itself: task delivery counts and worker heartbeats, in the database.

*Deliveries.* Tasks are acknowledged late and re-queued when their worker dies, so work is not
lost with a crashed worker; but work that *kills* its worker (a memory bomb under the kernel's
OOM killer) would then be re-delivered forever, each time taking a worker down. Each task counts
its start under a key for its piece of work (:func:`count_delivery`); past
``settings.max_deliveries`` starts the previous ones all died, and the task fails the work with
"worker died N times while ..." instead of running it again.

*Heartbeats.* A worker's main process keeps reserving tasks even when its pool can no longer
run them, so a process being alive proves nothing. Every pool process writes a heartbeat row
every ``heartbeat_seconds`` from a thread (:class:`Heartbeat`); ``/readyz`` (and the
dashboard) report the workers seen within ``heartbeat_timeout_seconds``
(:func:`worker_status`), and ``zoopick serve`` restarts a local worker that has none.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from zoopick.service.db.models import TaskDelivery, WorkerHeartbeat
from zoopick.service.db.session import session_scope
from zoopick.service.db.types import utcnow
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
    """Remove a heartbeat row (a pool process shutting down cleanly)."""
    with session_scope(factory) as session:
        session.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.name == name))


class Heartbeat:
    """A daemon thread beating for one process every ``interval`` seconds."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        name: str,
        hostname: str,
        pid: int,
        queues: str,
        interval: float,
    ) -> None:
        self.args = (factory, name, hostname, pid, queues)
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zoopick-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                beat(*self.args)
            except Exception:  # the database is away: try again next time
                log.warning("worker heartbeat failed", exc_info=True)
            self._stop.wait(self.interval)


@dataclass(frozen=True)
class WorkerStatus:
    live: list[str]
    stale: list[str]
    last_seen: datetime | None

    def problem(self) -> str | None:
        """Why no worker can run tasks, when workers were seen but none lately."""
        if self.live or not self.stale:
            return None
        ago = (utcnow() - self.last_seen).total_seconds() if self.last_seen else 0
        return (
            f"no live worker: the last heartbeat was {ago:.0f} s ago "
            f"({len(self.stale)} worker process(es) stopped or stalled)"
        )

    def summary(self) -> str:
        if self.live:
            return f"ok ({len(self.live)} live worker process(es))"
        return self.problem() or "no worker has been seen"


def worker_status(
    session: Session, settings: Settings, now: datetime | None = None
) -> WorkerStatus:
    """Worker processes seen within the heartbeat timeout, and those not (rows older than a day
    are ignored: a worker retired long ago is not a stalled one)."""
    now = now or utcnow()
    fresh = now - timedelta(seconds=settings.heartbeat_timeout_seconds)
    rows = list(
        session.execute(
            select(WorkerHeartbeat.name, WorkerHeartbeat.seen_at).where(
                WorkerHeartbeat.seen_at >= now - timedelta(days=1)
            )
        )
    )
    live = [name for name, seen in rows if seen >= fresh]
    stale = [name for name, seen in rows if seen < fresh]
    last = max((seen for _, seen in rows), default=None)
    return WorkerStatus(live, stale, last)


class LocalWorkerWatch:
    """``zoopick serve``'s watch over its own local worker: when no pool process on this host
    has beaten for ``heartbeat_timeout_seconds`` (after a start-up grace of twice that), the
    worker is stalled (its pool died while its main process keeps reserving tasks, or it
    hangs): ``restart`` is called. Its reserved work is recovered by the sweepers (lost jobs
    and lost dataset validations)."""

    def __init__(self, settings: Settings, restart) -> None:
        from zoopick.service.db.session import make_engine, make_sessionmaker

        self.settings = settings
        self.restart = restart
        self.engine = make_engine(settings.database_url)
        self.factory = make_sessionmaker(self.engine)
        self.started = utcnow()
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

    def stalled(self, now: datetime | None = None) -> bool:
        import socket

        now = now or utcnow()
        timeout = timedelta(seconds=self.settings.heartbeat_timeout_seconds)
        if now - self.started < 2 * timeout:
            return False
        with self.factory() as session:
            seen = session.scalar(
                select(WorkerHeartbeat.seen_at)
                .where(WorkerHeartbeat.hostname == socket.gethostname())
                .order_by(WorkerHeartbeat.seen_at.desc())
                .limit(1)
            )
        return seen is None or seen < now - timeout

    def _loop(self) -> None:
        interval = max(1.0, self.settings.heartbeat_timeout_seconds / 3)
        while not self._stop.wait(interval):
            try:
                if self.stalled():
                    log.warning(
                        "the local worker has not beaten for %s s: restarting it",
                        self.settings.heartbeat_timeout_seconds,
                    )
                    self.restart()
                    self.restarts += 1
                    self.started = utcnow()
            except Exception:  # noqa: BLE001 - the watch must outlive a database hiccup
                log.warning("watching the local worker failed", exc_info=True)
