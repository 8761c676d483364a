"""Recovery of lost jobs: the sweeper.

A job is *lost* when no task will ever move it on: the worker running it died (killed, out of
memory, machine gone) or the broker dropped its messages. Redis hands an unacknowledged task
back only after its visibility timeout (hours, since it must exceed the longest task), and the
embedded file broker deletes a message as soon as a worker takes it, so a worker killed
mid-task loses it for good. Any of these signs tells a lost job:

* **lease expired**: a training task renews its lease every few seconds while its trainer runs
  (``zoopick.workers.tasks.finetune``); a lease past its expiry means the owner stopped;
* **a model's task died**: each model being scored holds a lease of its own (``score_leases``,
  renewed while its task runs, dropped once the model is settled); one past its expiry means
  that model's task died with its worker, even while the job's other models are scored and keep
  the job's shared scoring lease live (as a race's candidate whose task died, below), so it is
  re-sent within about two lease periods (the lease, then the next sweep), however long the
  others take;
* **unattended**: a job being scored or selected (``queued``, ``scoring``) whose scoring lease
  (shared by its scoring tasks, renewed while one runs) lapsed and which made no progress for
  ``recovery_grace_seconds`` (60 s), while a gpu worker is up and idle (no job's task holds a
  live lease, no validation runs): nothing it could be queued behind runs, so its tasks are gone
  (a dead worker's, lost by the broker, or a selection that never ran). A dataset ``uploaded``
  or ``validating`` is lost the same way (a running validation keeps its ``updated_at`` fresh),
  while a cpu worker is up and idle likewise (no other validation runs either);
* **not in the broker**: such a job (no live lease, no progress for the grace, a gpu worker
  up) while other work keeps the workers busy (an hours-long fine-tune on the only gpu worker)
  may merely wait in a queue behind it. The sweep then asks the broker which task messages it
  still holds, queued or reserved (``zoopick.service.broker_probe``: Redis' queue lists and
  kombu's ``unacked`` hash, the embedded broker's message files; at most 10,000 messages
  read): a job none of whose task ids (``Job.task_ids``, every attempt's) the broker holds was
  lost while queued. The broker is asked once a sweep, and only when there is such a job; a
  broker that cannot tell (another transport, more messages than that, unreachable) leaves it
  to the stall. A message a worker has reserved counts as held, so one whose worker died
  before it started comes back only after Redis' visibility timeout (or the stall);
* **stalled**: no progress (``updated_at``) for longer than ``settings.stall_timeout``, by
  default the longest hard time limit, which no task can outlive (a training job holding a
  live lease is never stalled: its task is alive, however long an epoch takes).

A lost job is re-queued (``Dispatcher.requeue``: its remaining work under fresh task ids; the
trainer resumes from its last checkpoint, scoring skips the models already scored) up to
``recovery_attempts`` times, then failed with an error saying what was seen. A lost job whose
cancel was requested is settled as cancelled.

Where it runs (no extra process, the same on embedded and distributed setups): the API process
runs :class:`Sweeper`, a daemon thread that sweeps once at start and then every
``sweep_interval_seconds``; every worker sweeps once when it starts (``zoopick.workers.tasks``); and
``zoopick sweep`` runs one pass, e.g. from cron. Each action is a conditional UPDATE on the row
as it was read (``recoveries`` acts as a version), so sweepers running at once act on a job
once.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, exists, or_, select, update
from sqlalchemy.orm import Session, aliased, sessionmaker

from zoopick.service import tracking, webhooks
from zoopick.service.db.models import (
    Dataset,
    DatasetStatus,
    Job,
    JobStatus,
    RaceEntry,
    ScoreLease,
    WorkerHeartbeat,
)
from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
from zoopick.service.db.types import utcnow
from zoopick.service.pipeline import finish_run
from zoopick.service.queue import CPU, GPU
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)

UNFINISHED = (
    JobStatus.queued.value,
    JobStatus.scoring.value,
    JobStatus.racing.value,
    JobStatus.training.value,
)
LEASED = (JobStatus.racing.value, JobStatus.training.value)
"""Statuses whose tasks hold the job's lease while they train (a race's candidates share it)."""
SCORING = (JobStatus.queued.value, JobStatus.scoring.value)
"""Statuses whose tasks (scoring, then selection) share a short lease while one runs."""
BATCH = 100


@dataclass(frozen=True)
class Action:
    """What one sweep did to one job."""

    job_id: uuid.UUID
    action: str  # requeued | failed | cancelled
    reason: str


def _dead_candidate(now: datetime) -> Any:
    """A racing job one of whose candidates' task stopped renewing its lease: the others may
    still train (and keep the job's lease alive), but that one needs a new task."""
    return and_(
        Job.status == JobStatus.racing.value,
        exists().where(
            RaceEntry.job_id == Job.id,
            RaceEntry.status == "running",
            RaceEntry.lease_expires_at < now,
        ),
    )


def _dead_scorer(now: datetime) -> Any:
    """A job being scored one of whose models' task stopped renewing that model's lease: the
    other models' tasks may still run (and keep the job's shared lease alive), but that model
    needs a new task."""
    return and_(
        Job.status.in_(SCORING),
        exists().where(ScoreLease.job_id == Job.id, ScoreLease.lease_expires_at < now),
    )


def _worker_up(now: datetime, settings: Settings, queue: str) -> Any:
    """A worker consuming ``queue`` beat within the heartbeat timeout: work sent there runs."""
    fresh = now - timedelta(seconds=settings.heartbeat_timeout_seconds)
    return exists().where(WorkerHeartbeat.seen_at >= fresh, WorkerHeartbeat.queues.contains(queue))


def _idle(now: datetime, settings: Settings) -> Any:
    """No work runs that queued tasks could be waiting behind: no job's task holds a live
    lease (the job's, or a scored model's) and no validation keeps its dataset fresh (a worker
    may consume both queues)."""
    grace = now - timedelta(seconds=settings.recovery_grace_seconds)
    job, dataset = aliased(Job), aliased(Dataset)
    return and_(
        ~exists().where(job.status.in_(UNFINISHED), job.lease_expires_at >= now),
        ~exists().where(ScoreLease.lease_expires_at >= now),
        ~exists().where(
            dataset.status == DatasetStatus.validating.value, dataset.updated_at >= grace
        ),
    )


def _unleased(now: datetime, settings: Settings) -> Any:
    """A job being scored or selected whose scoring lease (and every model's) lapsed and that
    made no progress for the grace, while a gpu worker is up: no task attends it, but its
    tasks may still wait in the broker behind other work."""
    grace = now - timedelta(seconds=settings.recovery_grace_seconds)
    return and_(
        Job.status.in_(SCORING),
        Job.updated_at < grace,
        or_(Job.lease_expires_at.is_(None), Job.lease_expires_at < now),
        ~exists().where(ScoreLease.job_id == Job.id, ScoreLease.lease_expires_at >= now),
        _worker_up(now, settings, GPU),
    )


def _unattended(now: datetime, settings: Settings) -> Any:
    """An unleased job (:func:`_unleased`) while the gpu worker is idle too (so its tasks are
    not merely queued behind other work: they are gone)."""
    return and_(_unleased(now, settings), _idle(now, settings))


def _queued_behind(now: datetime, settings: Settings) -> Any:
    """An unleased job while other work keeps the workers busy: lost only if the broker no
    longer holds its tasks (:func:`_unheld`, asked once a sweep finds such a job)."""
    return and_(_unleased(now, settings), ~_idle(now, settings))


def _lost_clause(now: datetime, settings: Settings) -> Any:
    cutoff = now - timedelta(seconds=settings.stall_timeout)
    leased = and_(Job.status.in_(LEASED), Job.lease_owner.is_not(None))
    return and_(
        Job.status.in_(UNFINISHED),
        or_(
            _dead_candidate(now),
            _dead_scorer(now),
            and_(leased, Job.lease_expires_at < now),
            _unattended(now, settings),
            # a live lease is proof of life (renewed every few seconds), however long an
            # epoch takes: only jobs without one can be stalled
            and_(Job.updated_at < cutoff, ~and_(leased, Job.lease_expires_at >= now)),
        ),
    )


def lost_reason(job: Job, now: datetime, settings: Settings) -> str | None:
    """Why ``job`` counts as lost at ``now`` (None when it does not)."""
    if job.status not in UNFINISHED:
        return None
    if (
        job.status in LEASED
        and job.lease_owner
        and job.lease_expires_at is not None
        and job.lease_expires_at < now
    ):
        return (
            f"its {job.status} task ({job.lease_owner}) stopped renewing its lease, which expired "
            f"at {job.lease_expires_at.isoformat(timespec='seconds')}"
        )
    live_lease = job.lease_owner and job.lease_expires_at and job.lease_expires_at >= now
    if job.status in LEASED and live_lease:
        return None
    since = job.updated_at.isoformat(timespec="seconds")
    if job.updated_at < now - timedelta(seconds=settings.stall_timeout):
        return (
            f"no progress while {job.status} since {since}"
            f" (longer than {settings.stall_timeout} s, the longest a task may run)"
        )
    grace = settings.recovery_grace_seconds
    if job.status in SCORING and job.updated_at < now - timedelta(seconds=grace) and not live_lease:
        # the rest (a gpu worker up, no other work running) is the sweep's query's to check
        return (
            f"no task attended it while {job.status} since {since} (no live lease, no progress "
            f"for over {grace} s while a gpu worker was up and idle): its tasks were lost with "
            "a dead worker or by the broker"
        )
    return None


def _claim(
    session: Session, job: Job, now: datetime, settings: Settings, lost: Any, **values: Any
) -> bool:
    """Apply ``values`` if the job is still ``lost`` (a clause) and untouched since it was
    read."""
    stmt = (
        update(Job)
        .where(Job.id == job.id, Job.status == job.status, Job.recoveries == job.recoveries, lost)
        .values(**values)
    )
    return session.execute(stmt).rowcount == 1


def _recover(
    factory: sessionmaker[Session],
    dispatcher: Any,
    settings: Settings,
    job: Job,
    now: datetime,
    unheld: str | None = None,
) -> Action | None:
    """Re-queue, fail or cancel ``job`` if it is lost; ``unheld``: why it is, where the broker
    was asked (:func:`_unheld`), not the job's row."""
    reason = unheld or (  # a dead model's task first: the job's own row cannot tell one
        _dead_scorers(factory, job, now)
        or lost_reason(job, now, settings)
        or _dead_candidates(factory, job, now)
    )
    if reason is None:
        return None
    lost = _lost_clause(now, settings)
    if unheld:
        lost = or_(lost, _queued_behind(now, settings))
    with session_scope(factory) as session:
        if job.cancel_requested:
            status, error = JobStatus.cancelled.value, None
        elif job.recoveries >= settings.recovery_attempts:
            status = JobStatus.failed.value
            error = (
                f"job lost: {reason}; re-queued {job.recoveries} time(s) already "
                f"(ZOOPICK_RECOVERY_ATTEMPTS={settings.recovery_attempts}), so it is failed"
            )
        else:
            status = None
        if status is not None:  # a pending cancel, or no attempts left: settle the job
            fields = {"error": error} if error is not None else {}
            done = _claim(
                session,
                job,
                now,
                settings,
                lost,
                status=status,
                finished_at=now,
                updated_at=now,
                lease_owner=None,
                lease_expires_at=None,
                **fields,
            )
            if done:
                finish_run(session, job.id, status, error)
                webhooks.enqueue(session, job.id, JobStatus(status))
                tracking.enqueue(session, job.id, JobStatus(status))
            return Action(job.id, status, reason) if done else None
        # re-queue: count the attempt and clear the dead lease first (so the new task can
        # claim it and no other sweeper re-queues the same loss), then send the work
        if not _claim(
            session,
            job,
            now,
            settings,
            lost,
            recoveries=job.recoveries + 1,
            updated_at=now,
            lease_owner=None,
            lease_expires_at=None,
        ):
            return None
        # a racing job's dead candidates are queued again (live ones keep their lease)
        session.execute(
            update(RaceEntry)
            .where(
                RaceEntry.job_id == job.id,
                RaceEntry.status == "running",
                RaceEntry.lease_expires_at < now,
            )
            .values(status="queued", lease_owner=None, lease_expires_at=None)
        )
        # and a scoring job's dead models' leases go: their new tasks take them afresh, and
        # the next sweep does not count the same loss again
        session.execute(
            delete(ScoreLease).where(ScoreLease.job_id == job.id, ScoreLease.lease_expires_at < now)
        )
    attempt = job.recoveries + 1
    try:
        ids = dispatcher.requeue(job, attempt, _race_work(factory, job))
    except Exception:  # the broker is down: undo, so a later sweep tries again
        log.warning("could not re-queue lost job %s", job.id, exc_info=True)
        with session_scope(factory) as session:
            session.execute(
                update(Job)
                .where(Job.id == job.id, Job.recoveries == attempt)
                .values(
                    recoveries=job.recoveries,
                    updated_at=job.updated_at,
                    lease_owner=job.lease_owner,
                    lease_expires_at=job.lease_expires_at,
                )
            )
        return None
    with session_scope(factory) as session:
        # keep the old ids too: a cancel revokes whatever of either attempt is still queued
        session.execute(
            update(Job)
            .where(Job.id == job.id)
            .values(task_ids=list(dict.fromkeys([*(job.task_ids or []), *ids])))
        )
    log.warning("re-queued lost job %s (attempt %d): %s", job.id, attempt, reason)
    return Action(job.id, "requeued", reason)


def _dead_candidates(factory: sessionmaker[Session], job: Job, now: datetime) -> str | None:
    if job.status != JobStatus.racing.value:
        return None
    with factory() as session:
        dead = session.scalars(
            select(RaceEntry).where(
                RaceEntry.job_id == job.id,
                RaceEntry.status == "running",
                RaceEntry.lease_expires_at < now,
            )
        ).all()
    if not dead:
        return None
    names = ", ".join(f"{e.model_id} ({e.lease_owner})" for e in dead)
    return f"the task racing {names} stopped renewing its lease"


def _dead_scorers(factory: sessionmaker[Session], job: Job, now: datetime) -> str | None:
    if job.status not in SCORING:
        return None
    with factory() as session:
        dead = session.scalars(
            select(ScoreLease)
            .where(ScoreLease.job_id == job.id, ScoreLease.lease_expires_at < now)
            .order_by(ScoreLease.model_id)
        ).all()
    if not dead:
        return None
    names = ", ".join(f"{d.model_id} ({d.lease_owner})" for d in dead)
    return f"the task scoring {names} stopped renewing its lease"


def _unheld(jobs: list[Job], settings: Settings) -> list[tuple[Job, str]]:
    """Of ``jobs`` (:func:`_queued_behind`), those none of whose task messages the broker
    holds, each with why it is lost. Asks the broker once, and only where there is such a job;
    a broker that cannot tell (:func:`broker_probe.held_task_ids` None) leaves them all to
    the stall."""
    if not jobs:
        return []
    from zoopick.service.broker_probe import held_task_ids

    held = held_task_ids(settings)
    if held is None:
        return []
    grace = settings.recovery_grace_seconds
    lost = []
    for job in jobs:
        ids = list(job.task_ids or [])
        if held.intersection(ids):
            continue  # queued (or reserved): it runs once the work ahead of it is done
        since = job.updated_at.isoformat(timespec="seconds")
        lost.append((job, (
            f"no task attended it while {job.status} since {since} (no live lease, no progress "
            f"for over {grace} s) and the broker holds none of its {len(ids)} task messages: "
            "they were lost (by the broker, or with a worker that had taken them)"
        )))  # fmt: skip
    return lost


def _race_work(factory: sessionmaker[Session], job: Job) -> list[tuple[str, int]]:
    """(model, rung) of a racing job's candidates still to train; when none is left (the
    rung's last task died before moving the race on), one of the last rung's, whose task finds
    it settled and moves the race on."""
    if job.status != JobStatus.racing.value:
        return []
    from zoopick.service import race

    with factory() as session:
        found = race.entries(session, job.id)
    todo = [(e.model_id, e.rung) for e in found if e.status not in race.SETTLED]
    if todo or not found:
        return todo
    last = max(e.rung for e in found)
    return [next((e.model_id, e.rung) for e in found if e.rung == last)]


def sweep(
    factory: sessionmaker[Session],
    dispatcher: Any,
    settings: Settings,
    now: datetime | None = None,
) -> list[Action]:
    """One pass: re-queue, fail or cancel every lost job; returns what was done."""
    now = now or utcnow()
    with factory() as session:
        jobs = list(
            session.scalars(
                select(Job).where(_lost_clause(now, settings)).order_by(Job.updated_at).limit(BATCH)
            )
        )
        found = {job.id for job in jobs}
        behind = [  # the broker is asked about these below, and only if there are any
            job
            for job in session.scalars(
                select(Job)
                .where(_queued_behind(now, settings))
                .order_by(Job.updated_at)
                .limit(BATCH)
            )
            if job.id not in found
        ]
        session.expunge_all()
    actions = []
    try:
        actions += sweep_datasets(factory, dispatcher, settings, now)
    except Exception:  # noqa: BLE001 - the jobs' sweep must still run
        log.exception("sweeping lost datasets")
    try:
        webhooks.resend_stale(factory, dispatcher, settings)
    except Exception:  # noqa: BLE001 - the jobs' sweep must still run
        log.exception("re-sending lost webhook deliveries")
    try:
        tracking.resend_stale(factory, dispatcher, settings)
    except Exception:  # noqa: BLE001 - the jobs' sweep must still run
        log.exception("re-sending lost MLflow loggings")
    try:
        unheld = _unheld(behind, settings)
    except Exception:  # noqa: BLE001 - the other jobs' actions stand
        log.exception("asking the broker which tasks it holds")
        unheld = []
    # the lost jobs (their rows tell why), then those the broker no longer holds
    for job, reason in [*((job, None) for job in jobs), *unheld]:
        try:
            action = _recover(factory, dispatcher, settings, job, now, unheld=reason)
        except Exception:  # one bad row must not stop the sweep
            log.exception("recovering job %s", job.id)
            continue
        if action is not None:
            actions.append(action)
            if action.action != "requeued":
                log.warning("%s lost job %s: %s", action.action, job.id, action.reason)
    return actions


LOST_DATASET = (DatasetStatus.uploaded.value, DatasetStatus.validating.value)


def sweep_datasets(
    factory: sessionmaker[Session], dispatcher: Any, settings: Settings, now: datetime
) -> list[Action]:
    """Datasets ``uploaded`` or ``validating`` whose validation is gone: no progress for
    ``recovery_grace_seconds`` (a running validation keeps ``updated_at`` fresh) while a cpu
    worker is up and no other work runs (no validation, no job's leased task), or for longer
    than a validation may take at all (twice the light tasks' hard time limit: queueing and
    running). Their message was lost (the broker lost it, or the embedded broker dropped what
    its dead worker had reserved) or their worker died. Each is sent for validation again, at
    most ``max_deliveries`` times, then marked invalid."""
    from zoopick.service import datasets as store
    from zoopick.service.liveness import count_delivery

    cutoff = now - timedelta(seconds=2 * settings.light_hard_time_limit)
    grace = now - timedelta(seconds=settings.recovery_grace_seconds)
    unattended = and_(
        Dataset.updated_at < grace, _idle(now, settings), _worker_up(now, settings, CPU)
    )
    with factory() as session:
        stuck = list(
            session.execute(
                select(Dataset.id, Dataset.updated_at)
                .where(
                    Dataset.status.in_(LOST_DATASET),
                    or_(Dataset.updated_at < cutoff, unattended),
                )
                .order_by(Dataset.updated_at)
                .limit(BATCH)
            )
        )
    actions = []
    for dataset_id, seen in stuck:
        with session_scope(factory) as session:
            claimed = session.execute(
                update(Dataset)
                .where(Dataset.id == dataset_id, Dataset.updated_at == seen)
                .values(updated_at=now)
            ).rowcount
            if not claimed:  # another sweeper, or the dataset moved on
                continue
            count = count_delivery(session, f"requeue:validate:{dataset_id}")
        if count > settings.max_deliveries:
            reason = f"its validation was lost {count - 1} times; not sent again"
            store.fail_validation(factory, dataset_id, settings, reason)
            actions.append(Action(dataset_id, "failed", reason))
            continue
        try:
            dispatcher.validate_dataset(str(dataset_id))
        except Exception:  # the broker is down: a later sweep tries again
            log.warning("could not re-queue dataset %s", dataset_id, exc_info=True)
            continue
        log.warning("re-queued the validation of dataset %s (lost since %s)", dataset_id, seen)
        actions.append(Action(dataset_id, "requeued", "validation lost"))
    return actions


def touch_validation(session: Session, dataset_id: uuid.UUID) -> None:
    """A running validation's proof of life (renewed by its task, as a lease)."""
    session.execute(
        update(Dataset)
        .where(Dataset.id == dataset_id, Dataset.status == DatasetStatus.validating.value)
        .values(updated_at=utcnow())
    )


def sweep_once(settings: Settings) -> list[Action]:
    """A pass with its own engine, disposed afterwards (worker start, ``zoopick sweep``)."""
    from zoopick.service.dispatch import Dispatcher

    engine = make_engine(settings.database_url)
    try:
        return sweep(make_sessionmaker(engine), Dispatcher(settings), settings)
    finally:
        engine.dispose()


SWEEPER_THREAD = "zoopick-sweeper"
"""The in-process sweeper's thread name (what it runs is told apart by it in logs and tests)."""


class Sweeper:
    """The API process' sweeper thread: a pass at start, then one every ``interval`` s."""

    def __init__(self, factory: sessionmaker[Session], dispatcher: Any, settings: Settings) -> None:
        self.factory, self.dispatcher, self.settings = factory, dispatcher, settings
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=SWEEPER_THREAD, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                sweep(self.factory, self.dispatcher, self.settings)
            except Exception:  # the database is down: try again next time
                log.warning("sweep for lost jobs failed", exc_info=True)
            self.passes += 1
            if self._stop.wait(self.settings.sweep_interval_seconds):
                return
