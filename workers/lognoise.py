"""Expected events in the worker's log as one info line, not an error with a traceback.

Cancelling a job revokes its queued scoring tasks; when the chord that joins them next
counts its header, Celery's result backend finds the revoked result and logs
``Chord ... raised: ChordError('Dependency ... raised TaskRevokedError(...)')`` with
``logger.exception``: an error and a traceback for every cancelled job, though nothing went
wrong (the job is already ``cancelled``; its select task sees the flag). A filter on the
backends' loggers turns exactly that record into one info line; every other chord error
stays an error.
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


def install() -> None:
    """Add the filter once to each logger that writes the record (idempotent)."""
    for name in CHORD_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RevokedChord) for f in logger.filters):
            logger.addFilter(RevokedChord())
