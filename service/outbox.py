"""Tasks sent once the transaction that asked for them commits (the transactional outbox).

A webhook delivery or an MLflow logging is written as a pending row in the same transaction as
the job's move, so the two commit or roll back together; the task that does the work must not
leave before that commit (a worker would find no row) nor after a rollback (it would do work
for a move that never happened). :func:`send_after_commit` keeps the ids on the session and
sends them from its ``after_commit`` event; a rollback drops them. A send that fails is only
logged: the row stays pending and the sweeper re-sends it. A failed try is tried again after a
doubling wait (:func:`retry_in`), and a row left pending past :func:`stale_after` is
re-sent.

The dispatcher is the session's own when the API put one in its sessionmaker's ``info``
(:data:`DISPATCHER_KEY`), else one built from the settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from zoopick.service.settings import get_settings

log = logging.getLogger(__name__)

DISPATCHER_KEY = "dispatcher"
"""The ``Session.info`` key of the dispatcher that sends the tasks (the API sets it)."""
PENDING_KEY = "zoopick_outbox"
"""The ``Session.info`` key of what waits for the commit: (what, id, send) triples."""

Send = Callable[[Any, str], None]
"""How one id is sent: ``send(dispatcher, id)``."""


def retry_in(first: float, attempts: int) -> float:
    """Seconds before the next try after ``attempts`` failed ones: ``first``, doubled before
    each next one."""
    return first * 2 ** (attempts - 1)


def stale_after(first: float, max_attempts: int, try_seconds: float) -> float:
    """Seconds after which a pending item nobody touched was lost (its task message, or the
    send after its commit): longer than the whole backoff schedule (:func:`retry_in`), one try
    of ``try_seconds`` and a minute."""
    return first * 2**max_attempts + try_seconds + 60


def dispatcher_of(session: Session) -> Any:
    """The session's dispatcher, or one built from the settings."""
    dispatcher = session.info.get(DISPATCHER_KEY)
    if dispatcher is None:
        from zoopick.service.dispatch import Dispatcher

        dispatcher = Dispatcher(get_settings())
    return dispatcher


def send_after_commit(session: Session, what: str, item_id: object, send: Send) -> None:
    """Send ``item_id`` with ``send`` once the session's transaction commits (never if it
    rolls back); ``what`` names it in the warning of a send that failed."""
    if not event.contains(session, "after_commit", _after_commit):  # once per session
        event.listen(session, "after_commit", _after_commit)
        event.listen(session, "after_soft_rollback", _after_rollback)
    session.info.setdefault(PENDING_KEY, []).append((what, str(item_id), send))


def _after_rollback(session: Session, previous_transaction: Any) -> None:
    session.info.pop(PENDING_KEY, None)  # the rows rolled back with the move


def _after_commit(session: Session) -> None:
    pending = session.info.pop(PENDING_KEY, [])
    if not pending:
        return
    dispatcher = dispatcher_of(session)
    for what, item_id, send in pending:
        try:
            send(dispatcher, item_id)
        except Exception:  # noqa: BLE001 - the row stays pending: the sweep re-sends it
            log.warning("could not send %s %s", what, item_id, exc_info=True)
