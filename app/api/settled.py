"""The serialised view of a job whose work is over, kept by each API process.

Why: a client (a CI job, a notebook, the dashboard) often keeps polling ``GET /jobs/{id}``
after the job ended, and a finished job with a fine-tune and a race is the most expensive view
to build: its latest run (the config, the recipe, the sub-epoch curve of up to
``service.progress.MAX_POINTS`` points), every epoch, the race's entries and the scores, four
statements and a few hundred values validated and written out on every poll (issue 42: about
three times the CPU of a scoring job's poll, which at 200 polls a second on two cores is
what made the p99 latency hundreds of milliseconds). Once nothing is left to change, the
same JSON is answered again.

When a view is kept: the job is terminal, its training run (if any) is closed, and every
race entry (if any) is settled; until then a poll builds it afresh. It is found again only
for the same job row as it was then (its ``updated_at``, which every update of the row moves,
and its ``dataset_id``, which a deleted dataset clears without one) and the same URL prefix,
and only for ``TTL_SECONDS``: a row under the job that a straggler wrote after the job
settled (none is known to) shows within that time. Every request still authenticates and
reads the job's row first (``deps.owned_job``): a deleted job or a key that lost access gets
its 404 as before.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from datetime import datetime

from zoopick.app.api.schemas import JobOut
from zoopick.service.db.models import TERMINAL, Job
from zoopick.service.race import SETTLED

MAX_VIEWS = 256
"""Views kept per API process (least recently used dropped first): at a few tens of KiB each
(a 40-epoch run's view is about 34 KiB), a few MiB."""
TTL_SECONDS = 30.0
"""How long a kept view is answered before it is built again from the rows."""

Key = tuple[uuid.UUID, datetime, uuid.UUID | None, str]


def settled(out: JobOut) -> bool:
    """Whether nothing in the view ``out`` can still change unless the job's row does: the
    job is terminal, its run closed, its race's entries settled."""
    if out.status not in TERMINAL:
        return False
    if out.training is not None and out.training.finished_at is None:
        return False
    if out.race is not None:
        return all(e.status in SETTLED for rung in out.race.rungs for e in rung.entries)
    return True


class SettledViews:
    """A bounded, thread-safe map of a settled job's view to its JSON (polls run in the
    thread pool)."""

    def __init__(self, size: int = MAX_VIEWS, ttl: float = TTL_SECONDS) -> None:
        self.size, self.ttl = size, ttl
        self._views: OrderedDict[Key, tuple[float, str]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(job: Job, base: str) -> Key:
        return (job.id, job.updated_at, job.dataset_id, base)

    def get(self, job: Job, base: str) -> str | None:
        """The kept JSON of ``job`` as its row is now, if any and still fresh."""
        if job.status not in TERMINAL:
            return None
        key = self.key(job, base)
        with self._lock:
            kept = self._views.get(key)
            if kept is None:
                return None
            if time.monotonic() - kept[0] > self.ttl:
                del self._views[key]
                return None
            self._views.move_to_end(key)
            return kept[1]

    def put(self, job: Job, base: str, out: JobOut, body: str) -> None:
        """Keep ``body`` (``out`` as JSON) when ``out`` is settled."""
        if not settled(out):
            return
        with self._lock:
            self._views[self.key(job, base)] = (time.monotonic(), body)
            self._views.move_to_end(self.key(job, base))
            while len(self._views) > self.size:
                self._views.popitem(last=False)
