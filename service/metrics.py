"""Operator metrics computed at scrape time from the database and the broker.

The API may run as several processes (``zoopick serve --workers N``), and the work happens in
other processes still (Celery workers, trainers). A gauge or histogram kept in one process'
memory would tell only that process' share, so everything here is *read* when Prometheus
scrapes, from the one source of truth every process writes: the job, score, training-run and
heartbeat tables, and the broker's queues. Whichever API process answers a scrape answers the
same. (The API's own HTTP latency is per process and lives in ``zoopick.app.metrics``.)

The duration histograms are rebuilt from rows on each scrape, so they count what the database
still holds (deleting jobs lowers them, which Prometheus' ``rate()`` reads as a reset).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import ColumnElement, case, func, select
from sqlalchemy.orm import Session

from zoopick.service.db.models import Job, JobStatus, Score, TrainingRun, WorkerHeartbeat
from zoopick.service.db.types import utcnow
from zoopick.service.queue import QUEUES
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)

SCORING_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
"""Seconds to score one model for one job (its forward pass plus every metric)."""
TRAINING_BUCKETS = (10, 30, 60, 120, 300, 600, 1800, 3600, 2 * 3600, 6 * 3600)
"""Seconds of one finished training run."""


def _histogram(
    session: Session, durations: ColumnElement[float], buckets: Sequence[float], where=None
) -> tuple[list[tuple[str, float]], float]:
    """Cumulative bucket counts and the sum of ``durations`` in one aggregate query (no rows
    come to Python, however many the table holds)."""
    columns = [func.sum(case((durations <= b, 1), else_=0)) for b in buckets]
    query = select(func.count(), func.coalesce(func.sum(durations), 0.0), *columns)
    if where is not None:
        query = query.where(where)
    total, total_sum, *counts = session.execute(query).one()
    cumulative = [(str(float(b)), float(c or 0)) for b, c in zip(buckets, counts, strict=True)]
    return [*cumulative, ("+Inf", float(total or 0))], float(total_sum or 0.0)


def _seconds_between(session: Session, start, end) -> ColumnElement[float]:
    if session.get_bind().dialect.name == "postgresql":
        return func.extract("epoch", end - start)
    return (func.julianday(end) - func.julianday(start)) * 86400.0


class ServiceCollector(Collector):
    """Jobs by state, queue depths, worker liveness and the scoring / training durations, read
    through ``session`` (the scraping request's) and the broker of ``celery`` (None: no queue
    depths)."""

    def __init__(self, session: Session, settings: Settings, celery=None) -> None:
        self.session = session
        self.settings = settings
        self.celery = celery

    def collect(self) -> Iterator[Metric]:
        yield from self._jobs()
        yield from self._workers()
        yield from self._durations()
        yield from self._queues()

    def _jobs(self) -> Iterable[Metric]:
        counts = dict(
            self.session.execute(select(Job.status, func.count()).group_by(Job.status)).all()
        )
        jobs = GaugeMetricFamily("zoopick_jobs", "Jobs in the database by state.", labels=["state"])
        for state in JobStatus:
            jobs.add_metric([state.value], counts.get(state.value, 0))
        yield jobs

    def _workers(self) -> Iterable[Metric]:
        now = utcnow()
        rows = self.session.execute(
            select(WorkerHeartbeat.name, WorkerHeartbeat.queues, WorkerHeartbeat.seen_at).where(
                WorkerHeartbeat.seen_at >= now - timedelta(days=1)
            )
        ).all()
        fresh = now - timedelta(seconds=self.settings.heartbeat_timeout_seconds)
        up = GaugeMetricFamily(
            "zoopick_worker_up",
            "1 while a worker's heartbeat is fresher than ZOOPICK_HEARTBEAT_TIMEOUT_SECONDS "
            "(workers seen in the last day).",
            labels=["worker", "queues"],
        )
        age = GaugeMetricFamily(
            "zoopick_worker_heartbeat_age_seconds",
            "Seconds since a worker's last heartbeat.",
            labels=["worker", "queues"],
        )
        live = GaugeMetricFamily("zoopick_workers_live", "Workers with a fresh heartbeat.")
        for name, queues, seen in rows:
            up.add_metric([name, queues], 1.0 if seen >= fresh else 0.0)
            age.add_metric([name, queues], max(0.0, (now - seen).total_seconds()))
        live.add_metric([], sum(1 for _, _, seen in rows if seen >= fresh))
        yield from (up, age, live)

    def _durations(self) -> Iterable[Metric]:
        per_model = (
            select(
                (
                    func.sum(Score.seconds) + func.coalesce(func.max(Score.forward_seconds), 0.0)
                ).label("seconds")
            )
            .group_by(Score.job_id, Score.model_id)
            .subquery()
        )
        buckets, total = _histogram(self.session, per_model.c.seconds, SCORING_BUCKETS)
        yield HistogramMetricFamily(
            "zoopick_scoring_duration_seconds",
            "Time to score one model for one job: its forward pass plus every metric.",
            buckets=buckets,
            sum_value=total,
        )
        seconds = _seconds_between(self.session, TrainingRun.started_at, TrainingRun.finished_at)
        buckets, total = _histogram(
            self.session, seconds, TRAINING_BUCKETS, TrainingRun.finished_at.is_not(None)
        )
        yield HistogramMetricFamily(
            "zoopick_training_duration_seconds",
            "Wall time of finished training runs (fine-tunes), from start to finish.",
            buckets=buckets,
            sum_value=total,
        )

    def _queues(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("zoopick_broker_up", "1 when the broker answered this scrape.")
        if self.celery is None:
            return
        depth = GaugeMetricFamily(
            "zoopick_queue_depth",
            "Tasks waiting in a Celery queue on the broker (not those a worker reserved).",
            labels=["queue"],
        )
        try:
            with self.celery.connection_for_read() as conn:
                conn.ensure_connection(max_retries=1, timeout=2)
                channel = conn.default_channel
                for queue in QUEUES:
                    # not passive: an empty Redis queue has no key, and a passive declare
                    # would call it missing; declaring an existing queue changes nothing
                    ok = channel.queue_declare(queue=queue, durable=True, auto_delete=False)
                    depth.add_metric([queue], ok.message_count)
        except Exception:  # noqa: BLE001 - a scrape must answer: report the broker down
            log.warning("queue depths: the broker did not answer", exc_info=True)
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield from (up, depth)
