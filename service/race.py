"""A job's race in the database: planning it, the rung rows, who trains which candidate,
moving from one rung to the next, and what the API shows of it.

The race itself is ``training.race`` (plan, halving rule); the workers run its rungs
(``zoopick.workers.tasks.race_step``). Every change here is safe to run twice: a rung's rows
are inserted on their unique key (the task whose insert created them is the one that sends
their tasks), a candidate is claimed with a lease on its row, and the race ends with the job's
conditional transition, so a re-delivered task or a sweeper's re-queue cannot run a rung twice
or pick two winners.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from zoopick.service import pipeline
from zoopick.service.db.models import Dataset, Job, JobStatus, RaceEntry
from zoopick.service.db.types import utcnow
from zoopick.training import race
from zoopick.training.config import EpochRecord, FinetuneOptions

SETTLED = ("done", "failed", "cancelled")
RACE_SHARE = 0.3
"""Share of the progress bar the race takes after scoring when the job also fine-tunes."""


class RaceRefused(ValueError):
    """A race that cannot run on this dataset (a budget too small, too few images)."""


def race_options(job: Job) -> FinetuneOptions:
    """How every candidate trains: the job's fine-tune options (or the defaults when it only
    selects), on one worker each (candidates race in parallel, one per worker), with the dense
    all-reduce (nothing to compress on one worker). The stored options are not validated
    again (they were at submission), and these three changes need no check: one worker and
    no hook options suit every dataset and optimizer."""
    base = FinetuneOptions.stored(job.finetune) if job.finetune else FinetuneOptions()
    return base.model_copy(update={"workers": 1, "compressor": "dense", "hook_options": {}})


def plan_for(
    selection: race.SelectionOptions, options: FinetuneOptions, counts: dict[str, int]
) -> dict[str, Any]:
    """The race's plan on a dataset with these class ``counts``: steps per epoch of the race's
    training split, the budget in steps and the rungs (raises :class:`RaceRefused`)."""
    images = race.race_train_size(
        counts,
        test_fraction=options.test_fraction,
        validation_fraction=selection.validation_fraction,
        max_per_class=options.max_per_class,
    )
    epoch_steps = race.steps_per_epoch(images, options.batch_size)
    if epoch_steps < 1:
        raise RaceRefused(
            f"the dataset leaves {images} image(s) to race on after the test and validation "
            "splits: too few to train"
        )
    budget = race.budget_steps(selection.budget_epochs, epoch_steps)
    try:
        rungs = race.plan(selection.shortlist, budget)
    except race.BudgetTooSmall as exc:
        raise RaceRefused(
            f"selection.budget_epochs: {exc} (one epoch is {epoch_steps} step(s) of "
            f"{min(options.batch_size, images)} images here)"
        ) from None
    return {
        "train_images": images,
        "steps_per_epoch": epoch_steps,
        "budget_steps": budget,
        "rungs": [
            {"candidates": r.candidates, "steps_each": r.steps_each, "total_steps": r.total_steps}
            for r in rungs
        ],
    }


def rung_start(job: Job, rung: int) -> int:
    """The step ``rung`` starts at (what its candidates held after the rung before): where
    its learning rate starts to anneal (``FinetuneConfig.decay_from``)."""
    r = (job.race or {})["rungs"][rung]
    return int(r["total_steps"] - r["steps_each"])


def _insert_entries(session: Session, job_id: uuid.UUID, rung: int, models: list[str],
                    target: int) -> int:  # fmt: skip
    """Rows for one rung's candidates; returns how many this call created (0 when another
    task created them first)."""
    if not models:
        return 0
    now = utcnow()
    rows = [
        {
            "job_id": job_id,
            "model_id": m,
            "rung": rung,
            "status": "queued",
            "target_steps": target,
            "attempts": 0,
            "created_at": now,
            "updated_at": now,
        }
        for m in models
    ]
    stmt = pipeline._insert(session)(RaceEntry).values(rows).on_conflict_do_nothing()
    return session.execute(stmt).rowcount or 0


def start(session: Session, job: Job, ranked: list[str]) -> list[str]:
    """Stage 1 is over: shortlist the metric's best ``ranked`` models and open rung 1; returns
    the models whose rung tasks to send (none when this was already done). Fewer than two
    ranked models race nobody: the caller lets the metric pick."""
    selection = race.SelectionOptions.stored(job.selection)
    ds = session.get(Dataset, job.dataset_id) if job.dataset_id else None
    counts = dict((ds.counts if ds is not None else None) or {})
    shortlist = ranked[: selection.shortlist]
    plan = plan_for(selection.model_copy(update={"shortlist": len(shortlist)}),
                    race_options(job), counts)  # fmt: skip
    record = {**plan, "shortlist": shortlist, "rung": 0, "winner": None, "why": None}
    moved = pipeline.transition(session, job.id, JobStatus.racing, race=record)
    if not moved:
        return []
    first = plan["rungs"][0]["total_steps"]
    created = _insert_entries(session, job.id, 0, shortlist, first)
    return shortlist if created else []


def claim(session: Session, job_id: uuid.UUID, model: str, rung: int, owner: str,
          seconds: int) -> RaceEntry | None:  # fmt: skip
    """Take one candidate's rung: a queued one, or one whose trainer stopped renewing its lease
    (a killed worker: the new task resumes its checkpoint). None when it is settled or another
    live task trains it."""
    now = utcnow()
    stmt = (
        update(RaceEntry)
        .where(
            RaceEntry.job_id == job_id,
            RaceEntry.model_id == model,
            RaceEntry.rung == rung,
            or_(
                RaceEntry.status == "queued",
                (RaceEntry.status == "running")
                & or_(RaceEntry.lease_expires_at < now, RaceEntry.lease_owner == owner),
            ),
        )
        .values(
            status="running",
            lease_owner=owner,
            lease_expires_at=now + timedelta(seconds=seconds),
            attempts=RaceEntry.attempts + 1,
            updated_at=now,
        )
    )
    if session.execute(stmt).rowcount != 1:
        return None
    return session.scalar(
        select(RaceEntry).where(
            RaceEntry.job_id == job_id, RaceEntry.model_id == model, RaceEntry.rung == rung
        )
    )


def renew(session: Session, entry_id: int, owner: str, seconds: int) -> bool:
    stmt = (
        update(RaceEntry)
        .where(RaceEntry.id == entry_id, RaceEntry.lease_owner == owner)
        .values(lease_expires_at=utcnow() + timedelta(seconds=seconds))
    )
    return session.execute(stmt).rowcount == 1


def settle(session: Session, entry_id: int, status: str, *, record: EpochRecord | None = None,
           seconds: float | None = None, error: str | None = None) -> None:  # fmt: skip
    values: dict[str, Any] = {
        "status": status,
        "lease_owner": None,
        "lease_expires_at": None,
        "updated_at": utcnow(),
    }
    if record is not None:
        values.update(steps=record.steps, val_accuracy=record.val_accuracy, loss=record.loss)
    if seconds is not None:
        values["seconds"] = seconds
    if error is not None:
        values["error"] = error[:2000]
    session.execute(update(RaceEntry).where(RaceEntry.id == entry_id).values(**values))


def record_reached(session: Session, entry_id: int, owner: str, steps: int) -> None:
    """The candidate's trainer reached ``steps`` steps in all; written only while ``owner``
    (the task training it) holds its lease, so a task that lost it writes nothing."""
    session.execute(
        update(RaceEntry)
        .where(
            RaceEntry.id == entry_id,
            RaceEntry.lease_owner == owner,
            RaceEntry.status == "running",
        )
        .values(reached_steps=steps)
    )


def entries(session: Session, job_id: uuid.UUID, rung: int | None = None) -> list[RaceEntry]:
    stmt = select(RaceEntry).where(RaceEntry.job_id == job_id)
    if rung is not None:
        stmt = stmt.where(RaceEntry.rung == rung)
    return list(session.scalars(stmt.order_by(RaceEntry.rung, RaceEntry.id)))


def set_race_progress(session: Session, job: Job) -> None:
    """Rungs' candidates done over all the race's candidate-rungs, inside the race's share; a
    running candidate counts for the share of its rung's steps its trainer has reached."""
    plan = job.race or {}
    rungs = plan.get("rungs", [])
    total = sum(r["candidates"] for r in rungs) or 1
    done = 0.0
    for e in entries(session, job.id):
        if e.status in SETTLED:
            done += 1
        elif e.status == "running" and e.reached_steps is not None and e.rung < len(rungs):
            each = max(1, int(rungs[e.rung]["steps_each"]))
            done += min(max(e.reached_steps - (e.target_steps - each), 0), each) / each
    base = pipeline.SCORING_SHARE_WITH_TRAINING
    share = RACE_SHARE if job.finetune else 1.0 - base
    pipeline.set_progress(session, job.id, base + share * min(done, total) / total * 0.99)


@dataclass(frozen=True)
class Step:
    """What :func:`advance` decided: ``wait`` (candidates of the rung still train),
    ``next`` (send ``models`` for ``rung``), ``chosen`` (``model`` won; fine-tune it when the
    job asks), ``failed`` (why in ``error``), or ``nothing`` (another task moved on)."""

    action: str
    rung: int = 0
    models: tuple[str, ...] = ()
    model: str | None = None
    error: str | None = None


def advance(session: Session, job: Job, rung: int) -> Step:
    """After a candidate of ``rung`` settled: once every candidate of the rung has, keep the
    better half (or pick the winner on the last rung)."""
    plan = job.race or {}
    rungs = plan.get("rungs", [])
    if job.status != JobStatus.racing.value or rung >= len(rungs):
        return Step("nothing")
    current = entries(session, job.id, rung)
    if any(e.status not in SETTLED for e in current):
        return Step("wait")
    order = {m: i for i, m in enumerate(plan.get("shortlist", []))}
    results = [
        race.Result(
            e.model_id,
            e.val_accuracy if e.status == "done" else None,
            order.get(e.model_id, len(order)),
        )
        for e in current
    ]
    last = rung + 1 == len(rungs)
    keep = 1 if last else rungs[rung + 1]["candidates"]
    best = race.survivors(results, keep)
    if not best:
        errors = "; ".join(f"{e.model_id}: {e.error or e.status}" for e in current)
        return Step("failed", rung, error=f"every candidate of rung {rung + 1} failed ({errors})")
    if not last:
        target = rungs[rung + 1]["total_steps"]
        created = _insert_entries(session, job.id, rung + 1, best, target)
        if not created:
            return Step("nothing")
        _write_race(session, job, {**plan, "rung": rung + 1})
        return Step("next", rung + 1, tuple(best))
    winner = best[0]
    done = next(e for e in current if e.model_id == winner)
    outcome = {
        **plan,
        "winner": winner,
        "why": race.why_won(results, done.steps or 0),
        "spent_steps": spent_steps(session, job),
    }
    target = JobStatus.training if job.finetune else JobStatus.succeeded
    extra: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None}
    if job.finetune:
        extra["progress"] = pipeline.SCORING_SHARE_WITH_TRAINING + RACE_SHARE
    moved = pipeline.transition(session, job.id, target, chosen_model=winner, race=outcome, **extra)
    return Step("chosen", rung, model=winner) if moved else Step("nothing")


def _write_race(session: Session, job: Job, record: dict[str, Any]) -> None:
    session.execute(update(Job).where(Job.id == job.id).values(race=record, updated_at=utcnow()))


def spent_steps(session: Session, job: Job) -> int:
    """Optimizer steps the race's candidates hold in all (each candidate's last checkpoint)."""
    return _spent(entries(session, job.id))


def _spent(rows: list[RaceEntry]) -> int:
    latest: dict[str, int] = {}
    for e in rows:
        if e.steps is not None:
            latest[e.model_id] = max(latest.get(e.model_id, 0), e.steps)
    return sum(latest.values())


def view(session: Session, job: Job) -> dict[str, Any] | None:
    """What the API shows of the race: the plan, each rung's candidates with their steps and
    validation accuracies, the budget and what was spent, the winner and why."""
    if job.race is None:
        return None
    plan = dict(job.race)
    by_rung: dict[int, list[dict[str, Any]]] = {}
    rows = entries(session, job.id)  # once: the rungs and the steps spent read the same rows
    for e in rows:
        by_rung.setdefault(e.rung, []).append(
            {
                "model": e.model_id,
                "status": e.status,
                "steps": e.steps,
                "reached_steps": e.reached_steps,
                "target_steps": e.target_steps,
                "val_accuracy": e.val_accuracy,
                "loss": e.loss,
                "seconds": e.seconds,
                "attempts": e.attempts,
                "error": e.error,
            }
        )
    rungs = [
        {"index": i, **r, "entries": by_rung.get(i, [])}
        for i, r in enumerate(plan.get("rungs", []))
    ]
    return {
        "shortlist": plan.get("shortlist", []),
        "train_images": plan.get("train_images"),
        "steps_per_epoch": plan.get("steps_per_epoch"),
        "budget_steps": plan.get("budget_steps"),
        "spent_steps": _spent(rows),
        "rung": plan.get("rung", 0),
        "rungs": rungs,
        "winner": plan.get("winner"),
        "why": plan.get("why"),
    }
