"""Expected events in the worker's log as one info line, not an error with a traceback.

Cancelling a job revokes its queued scoring tasks; when the chord that joins them next
counts its header, Celery's result backend finds the revoked result and logs
``Chord ... raised: ChordError('Dependency ... raised TaskRevokedError(...)')`` with
``logger.exception``: an error and a traceback for every cancelled job, though nothing went
wrong (the job is already ``cancelled``; its select task sees the flag). A filter on the
backends' loggers turns exactly that record into one info line; every other chord error
stays an error.

Stopping a worker by its process group (``zoopick serve``'s restart of a stalled worker, an
operator's ``kill -- -PGID``) signals its pool processes too, and each one's end by that
signal was logged as ``ERROR ... Process 'ForkPoolWorker-1' ... exited with 'signal 15
(SIGTERM)'``, one per process at every stop. Once the worker is shutting down, that record is
an info line; a pool process killed while the worker runs stays an error. (``serve``'s own
stop signals the worker's main process alone, which stops its pool itself: a pool process
that died of a group's signal before the main process ran its handler still read as lost.)
"""

from __future__ import annotations

import logging

CHORD_LOGGERS = ("celery.backends.redis", "celery.backends.base", "celery.app.builtins")
_CHORD_RAISED = "Chord %r raised: %r"


class RevokedChord(logging.Filter):
    """Downgrades Celery's "Chord ... raised" record when the cause is a revoked task."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg == _CHORD_RAISED and len(args) == 2 and "TaskRevokedError" in repr(args[1]):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = "chord %s stopped: one of its tasks was revoked (its job was cancelled)"
            record.args = (args[0],)
            record.exc_info = record.exc_text = None
        return True


POOL_LOGGER = "multiprocessing"
"""billiard's logger (``billiard.util.get_logger``), which reports a pool process' exit."""
_CHILD_EXITED = "Process %r pid:%r exited with %r"


def _shutting_down() -> bool:
    from celery.worker import state

    # as Celery reads it: a warm shutdown's flag is its exit code, 0
    return state.should_stop is not None and state.should_stop is not False


class StoppedPoolProcess(logging.Filter):
    """Downgrades billiard's "Process ... exited with 'signal 15 (SIGTERM)'" record while the
    worker is shutting down (its own signal handler has run: ``state.should_stop``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if (
            record.msg == _CHILD_EXITED
            and len(args) == 3
            and "SIGTERM" in str(args[2])
            and _shutting_down()
        ):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = "pool process %r (pid %r) stopped with the worker (SIGTERM)"
            record.args = args[:2]
        return True


def install() -> None:
    """Add each filter once to each logger that writes its record (idempotent)."""
    for name, kind in [(n, RevokedChord) for n in CHORD_LOGGERS] + [
        (POOL_LOGGER, StoppedPoolProcess)
    ]:
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
