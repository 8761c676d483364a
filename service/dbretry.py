"""A task's database work retried through a database outage, with backoff.

A worker's task that meets a database which stopped answering (a restart, a failover, a cut
link) used to raise at once: four scoring tasks and the chord's failure callback all failed
within the same second of a 10 s outage, and the job stayed stuck. Here a unit of database
work (one transaction, written as a function that opens its own session) runs again after
0.5, 1, 2, ... 10 s while the error is a lost or refused connection, up to
``ZOOPICK_TASK_DB_RETRY_SECONDS``; then the error propagates as before. A transaction that
failed was rolled back, so running it again is safe; an error that is not an outage (a
constraint, a bug) is raised at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_DELAY = 0.5
MAX_DELAY = 10.0


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is the database not answering, as
    opposed to a statement it refused."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OperationalError | InterfaceError):
            return True
        if isinstance(current, DBAPIError) and current.connection_invalidated:
            return True
        current = current.__cause__ or current.__context__
    return False


def retrying(work: Callable[[], T], *, what: str, budget_seconds: float) -> T:
    """``work()``, run again with exponential backoff while it fails on a database outage,
    for at most ``budget_seconds`` of waiting; ``what`` names it in the log."""
    deadline = time.monotonic() + budget_seconds
    delay = FIRST_DELAY
    while True:
        try:
            return work()
        except Exception as exc:
            if not is_outage(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning(
                "%s: the database is unavailable (%s); trying again in %.1f s",
                what,
                type(exc).__name__,
                delay,
            )
            time.sleep(delay)
            delay = min(delay * 2, MAX_DELAY)
