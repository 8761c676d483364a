"""The Redis result backend as zoopick's processes use it: results are stored, never awaited.

No zoopick process waits on a Celery result: a job's state lives in the database, and the
only readers of the result backend are Celery's own chord counters in the workers. Yet
Celery's Redis backend subscribes the sending process to each task's result channel when it
sends the task (``RedisBackend.on_task_call``; celery/celery#3808, #5320, #6963), and only a
process that then waits on the result ever drains or drops that subscription. In the API,
which sends every job's tasks and never waits, the set of subscribed channels and the
unread pub/sub messages would grow with every task sent for the life of the process.
:class:`SendOnlyRedisBackend` stores and reads results as Celery does, but never subscribes
at send time.
"""

from __future__ import annotations

from typing import Any

from celery.backends.redis import RedisBackend

REDIS_SCHEMES = ("redis://", "rediss://")


class SendOnlyRedisBackend(RedisBackend):
    """Celery's Redis result backend, less the subscription to each sent task's channel."""

    def on_task_call(self, producer: Any, task_id: str) -> None:
        """Subscribe to nothing: no zoopick process waits on a task's result."""


def backend_url(url: str) -> str:
    """``url`` as Celery's ``backend`` argument: a Redis URL names
    :class:`SendOnlyRedisBackend` (Celery's ``class+url`` form); any other is unchanged."""
    if url.startswith(REDIS_SCHEMES):
        return f"{__name__}:{SendOnlyRedisBackend.__name__}+{url}"
    return url
