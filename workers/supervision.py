"""A local worker of ``zoopick serve`` never outlives its ``serve`` (issue 21, item 13).

``serve`` starts its worker with a parent-death signal (Linux) and names itself in
``ZOOPICK_SUPERVISOR_PID``; here the worker's main process watches that pid
(:class:`zoopick.service.processes.SupervisorWatch`). A parent-death signal only starts a warm
shutdown, which waits for whatever the pool is running (minutes of a hostile dataset's
validation, say): orphaned workers were found alive 40 minutes after their ``serve`` was
killed. A worker started any other way (``zoopick worker``, under a supervisor) has no such
variable and no watch.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_init

from zoopick.service.processes import SupervisorWatch

log = logging.getLogger(__name__)


def _orphaned(supervisor: int) -> None:
    log.error(
        "zoopick serve (pid %d) is gone: this worker and its pool stop now; their tasks "
        "are re-delivered or swept",
        supervisor,
    )


@worker_init.connect
def watch_supervisor(**_: Any) -> None:
    """In the worker's main process, before its pool starts (a ``serve`` already gone is seen
    at the first check)."""
    watch = SupervisorWatch.from_env(on_orphaned=_orphaned)
    if watch is not None:
        watch.start()
