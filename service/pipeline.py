"""A job's life in the database, shared by the API and the workers.

Every change is a conditional UPDATE on the job row (the state machine below), so two tasks
racing on the same job (a re-delivered message, a cancel arriving mid-run) cannot move it
backwards or out of a terminal state. Scores and epoch metrics are upserted on their unique
keys, so running a task twice leaves one row per (job, model, metric) and (run, epoch).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from zoopick.selection.ties import tie_groups
from zoopick.service import progress, tracking, webhooks
from zoopick.service.db.models import (
    TERMINAL,
    Artefact,
    EpochMetric,
    Job,
    JobStatus,
    RaceEntry,
    Score,
    ScoreLease,
    TrainingRun,
)
from zoopick.service.db.types import utcnow
from zoopick.training.config import EpochRecord, RunEvent

log = logging.getLogger(__name__)

S = JobStatus
ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    S.queued: frozenset({S.scoring, S.failed, S.cancelled}),
    S.scoring: frozenset({S.racing, S.training, S.succeeded, S.failed, S.cancelled}),
    S.racing: frozenset({S.training, S.succeeded, S.failed, S.cancelled}),
    S.training: frozenset({S.succeeded, S.failed, S.cancelled}),
}
SCORING_SHARE_WITH_TRAINING = 0.2
"""Share of the progress bar given to scoring when the job also fine-tunes."""


def sources_of(target: JobStatus) -> list[str]:
    return [s.value for s, targets in ALLOWED.items() if target in targets]


def transition(session: Session, job_id: uuid.UUID, to: JobStatus, **values: Any) -> bool:
    """Move the job to ``to`` if the state machine allows it from where it is now; returns
    whether it moved. Terminal states stamp ``finished_at`` and drop the lease, and cancel
    the race candidates no task has started (``queued``: none ever will; a running one's
    task settles it). They had stayed ``queued`` in a cancelled job's race."""
    now = utcnow()
    values = {"status": to.value, "updated_at": now, **values}
    if to in TERMINAL:
        values.setdefault("finished_at", now)
        values.update(lease_owner=None, lease_expires_at=None)
        if to is S.succeeded:
            values["progress"] = 1.0
    stmt = update(Job).where(Job.id == job_id, Job.status.in_(sources_of(to))).values(**values)
    if to is S.scoring:
        stmt = stmt.values(started_at=func.coalesce(Job.started_at, now))
    moved = session.execute(stmt).rowcount == 1
    if moved and to in TERMINAL:
        session.execute(
            update(RaceEntry)
            .where(RaceEntry.job_id == job_id, RaceEntry.status == "queued")
            .values(status="cancelled", updated_at=now)
        )
    if moved:  # its webhook's event, in the same transaction (an outbox row)
        webhooks.enqueue(session, job_id, to)
        tracking.enqueue(session, job_id, to)  # and its MLflow run, once it ended
    return moved


def fail(session: Session, job_id: uuid.UUID, error: str) -> bool:
    """Mark the job failed with ``error`` unless it already finished."""
    return transition(session, job_id, S.failed, error=error[:10_000])


def finish_cancelled(session: Session, job_id: uuid.UUID) -> bool:
    return transition(session, job_id, S.cancelled)


# -- the lease: which task currently drives a job stage ------------------------------------


def claim_lease(session: Session, job_id: uuid.UUID, owner: str, seconds: int) -> bool:
    """Take the job's lease if it is free, expired or already ours."""
    now = utcnow()
    stmt = (
        update(Job)
        .where(
            Job.id == job_id,
            or_(
                Job.lease_owner.is_(None),
                Job.lease_expires_at < now,
                Job.lease_owner == owner,
            ),
        )
        .values(lease_owner=owner, lease_expires_at=now + timedelta(seconds=seconds))
    )
    return session.execute(stmt).rowcount == 1


def renew_lease(session: Session, job_id: uuid.UUID, owner: str, seconds: int) -> bool:
    """Extend our lease; False means we lost it (it expired and another task took it)."""
    stmt = (
        update(Job)
        .where(Job.id == job_id, Job.lease_owner == owner)
        .values(lease_expires_at=utcnow() + timedelta(seconds=seconds))
    )
    return session.execute(stmt).rowcount == 1


def scoring_owner(job_id: uuid.UUID) -> str:
    """The lease owner every scoring task of a job shares (as a race's candidates share
    ``race:<job>``): a job's models may be scored on several workers at once, and any of them
    alive keeps the job alive. Selection releases it when it moves the job on. Which model's
    task died is told by each model's own lease (:func:`claim_model_lease`), as each race
    candidate has its own."""
    return f"score:{job_id}"


def release_lease(session: Session, job_id: uuid.UUID, owner: str) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.lease_owner == owner)
        .values(lease_owner=None, lease_expires_at=None)
    )


def claim_model_lease(
    session: Session, job_id: uuid.UUID, model_id: str, owner: str, seconds: int
) -> bool:
    """Take the lease on scoring ``model_id`` for the job (``score_leases``) if no task holds
    it, its holder stopped renewing it (a dead worker) or it is already ours; False while
    another live task scores that model. One atomic statement: of two deliveries starting the
    same model at once, one gets it."""
    now = utcnow()
    stmt = _insert(session)(ScoreLease).values(
        job_id=job_id, model_id=model_id, lease_owner=owner,
        lease_expires_at=now + timedelta(seconds=seconds),
    )  # fmt: skip
    stmt = stmt.on_conflict_do_update(
        index_elements=[ScoreLease.job_id, ScoreLease.model_id],
        set_={"lease_owner": owner, "lease_expires_at": stmt.excluded.lease_expires_at},
        where=or_(ScoreLease.lease_expires_at < now, ScoreLease.lease_owner == owner),
    ).returning(ScoreLease.model_id)
    return session.execute(stmt).scalar() is not None


def renew_model_lease(
    session: Session, job_id: uuid.UUID, model_id: str, owner: str, seconds: int
) -> bool:
    """Extend our lease on scoring ``model_id``; False means it is no longer ours."""
    stmt = (
        update(ScoreLease)
        .where(
            ScoreLease.job_id == job_id,
            ScoreLease.model_id == model_id,
            ScoreLease.lease_owner == owner,
        )
        .values(lease_expires_at=utcnow() + timedelta(seconds=seconds))
    )
    return session.execute(stmt).rowcount == 1


def release_model_lease(session: Session, job_id: uuid.UUID, model_id: str) -> None:
    """Drop the lease on scoring ``model_id``: the model is settled (scored or failed), in the
    transaction that settles it, so no sweeper sees a settled model's lease lapse."""
    session.execute(
        delete(ScoreLease).where(ScoreLease.job_id == job_id, ScoreLease.model_id == model_id)
    )


# -- scores ---------------------------------------------------------------------------------


def _insert(session: Session):
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


def upsert_scores(
    session: Session,
    job_id: uuid.UUID,
    model_id: str,
    scores: Mapping[str, float],
    seconds: Mapping[str, float],
    cached: bool = False,
    parts: Mapping[str, Sequence[float]] | None = None,
) -> None:
    """Write one model's scores; a second write of the same (job, model, metric) replaces the
    first instead of adding a row. ``cached``: its forward pass came from the feature cache;
    ``parts``: the components of zoo-normalised metrics (see :func:`combine_zoo_scores`)."""
    if not scores:
        return
    now = utcnow()
    parts = parts or {}
    rows = [
        {
            "job_id": job_id,
            "model_id": model_id,
            "metric": metric,
            "value": float(value),
            "seconds": float(seconds.get(metric, 0.0)),
            "forward_seconds": seconds.get("forward"),
            "cached": bool(cached),
            "parts": [float(v) for v in parts[metric]] if metric in parts else None,
            "created_at": now,
        }
        for metric, value in scores.items()
    ]
    stmt = _insert(session)(Score).values(rows)
    stmt = stmt.on_conflict_do_update(
        index_elements=["job_id", "model_id", "metric"],
        set_={
            "value": stmt.excluded.value,
            "seconds": stmt.excluded.seconds,
            "forward_seconds": stmt.excluded.forward_seconds,
            "cached": stmt.excluded.cached,
            "parts": stmt.excluded.parts,
            "created_at": stmt.excluded.created_at,
        },
    )
    session.execute(stmt)


def combine_zoo_scores(session: Session, job: Job) -> None:
    """Give zoo-normalised metrics (NCTI) the scores their paper defines over the whole zoo:
    each model's stored parts combined across the job's scored models
    (``selection.rank.combine_zoo``'s rule), written over the single-model stand-ins. Run by
    selection once every model is settled; reads parts, never values, so running it again
    gives the same scores. Fewer than two scored models keep their stand-ins."""
    from zoopick.selection.metrics import registry  # numpy: the workers' side only

    scored = scored_models(session, job)
    if len(scored) < 2:
        return
    for name in job.metrics:
        spec = registry.get(name)
        if spec.zoo_combine is None:
            continue
        rows = [
            row
            for row in session.scalars(
                select(Score).where(Score.job_id == job.id, Score.metric == name)
            )
            if row.model_id in scored
        ]
        if any(row.parts is None for row in rows):  # scored before parts were kept
            log.warning("job %s: %s keeps single-model scores (parts missing)", job.id, name)
            continue
        combined = spec.zoo_combine({row.model_id: tuple(row.parts) for row in rows})
        for row in rows:
            row.value = float(combined[row.model_id])
    session.flush()


def scored_models(session: Session, job: Job) -> set[str]:
    """Models of ``job`` that have a score for every requested metric."""
    rows = session.execute(
        select(Score.model_id)
        .where(Score.job_id == job.id, Score.metric.in_(job.metrics))
        .group_by(Score.model_id)
        .having(func.count(Score.id) >= len(job.metrics))
    )
    return {r[0] for r in rows}


def record_model_error(session: Session, job_id: uuid.UUID, model_id: str, error: str) -> None:
    """Remember that ``model_id`` could not be scored for the job (the others go on)."""
    # locked and re-read: another model's task may have added its error since this session
    # loaded the job
    job = session.get(Job, job_id, with_for_update=True, populate_existing=True)
    if job is None:
        return
    job.model_errors = {**(job.model_errors or {}), model_id: error[:2000]}
    session.flush()


def update_scoring_progress(session: Session, job: Job) -> float:
    settled = scored_models(session, job) | set(job.model_errors or {})
    done = len(settled & set(job.models))
    share = SCORING_SHARE_WITH_TRAINING if job.finetune else 1.0
    progress = min(1.0, share * done / max(1, len(job.models)))
    session.execute(
        update(Job)
        .where(
            Job.id == job.id,
            Job.status.in_([S.queued.value, S.scoring.value]),
            Job.progress <= progress,  # never backwards (tasks finish in any order)
        )
        .values(progress=progress, updated_at=utcnow())
    )
    return progress


def ranking(session: Session, job: Job) -> list[dict[str, Any]]:
    """The ranking so far: models with every metric scored, best first by ``select_by``
    (models the metric cannot tell apart share a rank)."""
    by_model: dict[str, dict[str, Any]] = {}
    # the columns it shows, as plain rows: no ORM objects, no ``parts`` JSON decoded (every
    # poll of a job reads this)
    columns = (Score.model_id, Score.metric, Score.value, Score.seconds, Score.forward_seconds,
               Score.cached)  # fmt: skip
    for model_id, metric, value, seconds, forward, cached in session.execute(
        select(*columns).where(Score.job_id == job.id)
    ):
        entry = by_model.setdefault(
            model_id, {"model": model_id, "scores": {}, "seconds": {}, "cached": False}
        )
        entry["cached"] = entry["cached"] or bool(cached)
        entry["scores"][metric] = value
        entry["seconds"][metric] = seconds
        if forward is not None:
            entry["seconds"]["forward"] = forward
    order = {m: i for i, m in enumerate(job.models)}
    complete = sorted(
        (e for e in by_model.values() if all(m in e["scores"] for m in job.metrics)),
        key=lambda e: order.get(e["model"], len(order)),
    )
    out: list[dict[str, Any]] = []
    values = [e["scores"][job.select_by] for e in complete]
    for rank, group in enumerate(tie_groups(values), start=1):
        for i in sorted(group, key=lambda i: order.get(complete[i]["model"], len(order))):
            out.append({"rank": rank, **complete[i]})
    return out


def choose(session: Session, job: Job) -> str | None:
    """The winner by ``select_by``; ties go to the model listed first in the request."""
    ranked = ranking(session, job)
    return ranked[0]["model"] if ranked else None


# -- training runs --------------------------------------------------------------------------


EPOCH_COLUMNS = (
    "loss",
    "train_accuracy",
    "test_accuracy",
    "bytes_sent",
    "compute_seconds",
    "select_seconds",
    "comm_seconds",
)
"""Fields of ``training.config.EpochRecord`` that have their own ``epoch_metrics`` column; the
others (workers, compressor) go to ``extra``."""


def epoch_values(record: EpochRecord) -> dict[str, Any]:
    """Columns of an ``epoch_metrics`` row for one epoch record of the trainer."""
    values: dict[str, Any] = {"epoch": record.epoch}
    for name in EPOCH_COLUMNS:
        value = getattr(record, name)
        values[name] = None if value is None else (int if name == "bytes_sent" else float)(value)
    rest = {k: v for k, v in asdict(record).items() if k not in values and v is not None}
    values["extra"] = rest
    return values


def record_epoch(session: Session, run_id: uuid.UUID, record: EpochRecord) -> None:
    """Upsert one per-epoch record on (run, epoch): a re-sent line replaces the first."""
    values = {"run_id": run_id, **epoch_values(record), "created_at": utcnow()}
    stmt = _insert(session)(EpochMetric).values(values)
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "epoch"],
        set_={k: getattr(stmt.excluded, k) for k in (*EPOCH_COLUMNS, "extra", "created_at")},
    )
    session.execute(stmt)


def record_run_event(session: Session, run_id: uuid.UUID, event: RunEvent) -> None:
    """What the backend said of the run: its own id once started (the Ray job id), one more
    resume from the checkpoint when a worker, node or task was lost."""
    if event.event == "progress":
        record_progress(session, run_id, event)
        return
    if event.event == "recipe":
        values: dict[str, Any] = {"recipe": event.recipe}
    elif event.event == "started":
        values = {"backend_ref": event.ref}
    else:
        values = {"resumes": TrainingRun.resumes + 1}
    session.execute(update(TrainingRun).where(TrainingRun.id == run_id).values(**values))


def record_progress(session: Session, run_id: uuid.UUID, event: RunEvent) -> None:
    """Fold a progress event into the run's ``progress`` (one follower per run writes it) and
    move the job's bar with the steps done."""
    run = session.get(TrainingRun, run_id)
    if run is None or run.status != "running":
        return
    run.progress = progress.apply(run.progress, event)
    done = progress.fraction(run.progress)
    if done is not None:
        share = SCORING_SHARE_WITH_TRAINING
        set_progress(session, run.job_id, share + (1 - share) * done * 0.99)


def open_run(
    session: Session,
    job: Job,
    model_id: str,
    config: dict[str, Any],
    world_size: int,
    out: str,
    backend: str = "local",
) -> TrainingRun:
    """The job's running training run: the one a re-delivered task left open (the trainer
    resumes from its last checkpoint and the epochs land on the same curve), or a new one."""
    run = latest_run(session, job.id)
    if run is not None and run.status == "running":
        run.progress = progress.starting(run.progress)
        run.output_dir = out  # this delivery's machine's folder (the lost one's may be elsewhere)
        return run
    run = TrainingRun(
        job_id=job.id,
        model_id=model_id,
        config=config,
        world_size=world_size,
        output_dir=out,
        backend=backend,
        progress=progress.starting(None),
    )
    session.add(run)
    session.flush()
    return run


def record_recipe(session: Session, run_id: uuid.UUID, final_config: Path) -> None:
    """The recipe's choices as the finished run wrote them beside its model (its best
    validation step is known only at the end); the run's ``recipe`` event said the rest."""
    try:
        chosen = json.loads(final_config.read_text()).get("recipe")
    except (OSError, ValueError):
        return
    if isinstance(chosen, dict):
        session.execute(update(TrainingRun).where(TrainingRun.id == run_id).values(recipe=chosen))


def finish_run(session: Session, job_id: uuid.UUID, status: str, error: str | None) -> None:
    """Close the job's running training run as ``status`` (the task that trained, or the
    sweeper settling a lost job). In the caller's session: a second one writing at the same
    time would wait for the first's lock on SQLite (embedded mode) until "database is
    locked"."""
    session.execute(
        update(TrainingRun)
        .where(TrainingRun.job_id == job_id, TrainingRun.status == "running")
        .values(status=status, error=error, finished_at=utcnow())
    )


def add_artefact(
    session: Session, job_id: uuid.UUID, kind: str, path: str, digest: str, size: int
) -> None:
    stmt = _insert(session)(Artefact).values(
        id=uuid.uuid4(),
        job_id=job_id,
        kind=kind,
        path=path,
        digest=digest,
        size_bytes=size,
        created_at=utcnow(),
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["job_id", "kind"],
        set_={k: getattr(stmt.excluded, k) for k in ("path", "digest", "size_bytes", "created_at")},
    )
    session.execute(stmt)


def latest_run(session: Session, job_id: uuid.UUID) -> TrainingRun | None:
    return session.scalar(
        select(TrainingRun)
        .where(TrainingRun.job_id == job_id)
        .order_by(TrainingRun.started_at.desc())
        .limit(1)
    )


def epoch_rows(session: Session, run_id: uuid.UUID) -> list[dict[str, Any]]:
    """A run's per-epoch records in epoch order, as plain mappings of their columns (what
    ``app.api.schemas.EpochOut`` reads): one statement and no ORM objects, where the run's
    ``epochs`` relationship would load each row as an object on every poll of the job. Of
    ``extra`` only the two values shown are read, in SQL (as numbers: the schema makes the
    iterations an integer, as it did from the decoded JSON)."""
    columns = [getattr(EpochMetric, name) for name in EPOCH_SHOWN]
    extra = [EpochMetric.extra[key].as_float().label(key) for key in EPOCH_EXTRA_SHOWN]
    stmt = select(*columns, *extra).where(EpochMetric.run_id == run_id).order_by(EpochMetric.epoch)
    return [dict(row) for row in session.execute(stmt).mappings()]


EPOCH_SHOWN = ("epoch", *EPOCH_COLUMNS)
EPOCH_EXTRA_SHOWN = ("iterations", "dense_bytes")
"""What a job's view shows of each epoch: its columns, and two values of its ``extra``."""


def active_jobs_for_dataset(session: Session, dataset_id: uuid.UUID) -> int:
    return (
        session.scalar(
            select(func.count(Job.id)).where(
                Job.dataset_id == dataset_id, Job.status.not_in([s.value for s in TERMINAL])
            )
        )
        or 0
    )


def finish_cancelled_if_queued(session: Session, job_id: uuid.UUID) -> bool:
    """Cancel now a job no task has started (nothing running would ever notice the flag)."""
    now = utcnow()
    stmt = (
        update(Job)
        .where(Job.id == job_id, Job.status == S.queued.value)
        .values(status=S.cancelled.value, finished_at=now, updated_at=now, cancel_requested=True)
    )
    moved = session.execute(stmt).rowcount == 1
    if moved:
        webhooks.enqueue(session, job_id, S.cancelled)
        tracking.enqueue(session, job_id, S.cancelled)
    return moved


def set_progress(session: Session, job_id: uuid.UUID, progress: float) -> None:
    """Raise the progress of a running job (never lowers it, never touches a finished one)."""
    progress = max(0.0, min(1.0, progress))
    session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.status.not_in([s.value for s in TERMINAL]),
            Job.progress <= progress,
        )
        .values(progress=progress, updated_at=utcnow())
    )
