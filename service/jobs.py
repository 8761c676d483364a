"""A job's use cases: submit, show, list, cancel. The REST router (``app/api/jobs.py``) and the
dashboard (``app/dashboard/pages.py``) are thin adapters over these functions, so both check a
submission the same way, in one place.

A refused input raises :class:`Rejected` with a ``kind`` (the HTTP face maps kinds to status
codes: this module knows no HTTP) and a message naming what is wrong. The fine-tune options are
``training.config.FinetuneOptions``: validated once, when the body is parsed (without torch),
and stored as they are.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints
from sqlalchemy import Select, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from zoopick.service import pipeline, quotas, zoo_catalog
from zoopick.service.db.models import (
    TERMINAL,
    Dataset,
    DatasetStatus,
    Job,
    JobStatus,
    TrainingRun,
)
from zoopick.service.db.types import utcnow
from zoopick.service.dispatch import Dispatcher, job_task_ids
from zoopick.service.inputs import NoNulModel, quoted
from zoopick.service.settings import Settings
from zoopick.service.webhooks import WebhookOptions, check_url
from zoopick.training import comm_options
from zoopick.training.config import FinetuneOptions
from zoopick.training.race import SelectionOptions

log = logging.getLogger(__name__)

DEFAULT_METRICS = ["fsms", "logme", "sms", "isms"]
DEFAULT_SELECT_BY = "fsms"
"""The metric that picks when a job names none: the best of the transfer benchmark
(`benchmarks/results/transfer.md`: highest mean weighted tau over its six targets)."""

STATUSES = tuple(s.value for s in JobStatus)
"""Every job status, in the order a job goes through them (the dashboard's filter lists it)."""
COMPRESSORS = tuple(comm_options.HOOKS)
"""The comm hooks a fine-tune may use (the dashboard's choice list)."""


def default_select_by(metrics: list[str]) -> str:
    """The metric that picks when a job names none (see ``DEFAULT_SELECT_BY``)."""
    return DEFAULT_SELECT_BY if DEFAULT_SELECT_BY in metrics else metrics[0]


JobName = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=200)]
Tag = Annotated[str, StringConstraints(strip_whitespace=True, pattern=r"^[^\s,\"\\]{1,40}$")]
Tags = Annotated[list[Tag], Field(max_length=20)]
Notes = Annotated[str, StringConstraints(max_length=10_000)]
TAGS_DESCRIPTION = (
    "Up to 20 tags of 1 to 40 characters, no spaces, commas or quotes; the list's `tag` "
    "filter matches one exactly."
)


class JobCreate(NoNulModel):
    """A job submission. Strict JSON types (no coercion of ``"2"`` to 2 or of a number to a
    string); ``dataset_id`` is a UUID string."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dataset_id: uuid.UUID = Field(strict=False)
    models: list[str] | Literal["all"] = Field(
        "all", description='Zoo model ids to score, or "all".'
    )
    metrics: list[str] = Field(
        default_factory=lambda: list(DEFAULT_METRICS), min_length=1, max_length=32
    )
    select_by: str | None = Field(
        None,
        description=f"The metric that picks the model to fine-tune. Default: {DEFAULT_SELECT_BY} "
        "when it is among the requested metrics, else the first requested metric.",
    )
    finetune: FinetuneOptions | None = Field(
        None,
        description="Fine-tune the chosen model with these options (unset ones take the "
        "trainer's defaults); without it the job only ranks.",
    )
    selection: SelectionOptions | None = Field(
        None,
        description="Two-stage selection: the metric's `shortlist` best models race short "
        "fine-tunes (successive halving on a validation split of the training data, within "
        "`budget_epochs`) and the race's winner is chosen (and fine-tuned from its race "
        "checkpoint). Without it the metric alone picks.",
    )
    webhook: WebhookOptions | None = Field(
        None,
        description="Call this URL (signed POST of the job's summary) when the job finishes, "
        "and on phase changes with `phases`; default: the tenant's webhook (`PUT /webhook`).",
    )
    name: JobName | None = Field(None, description="The job's name (the list searches it).")
    tags: Tags = Field(default_factory=list, description=TAGS_DESCRIPTION)
    notes: Notes | None = Field(None, description="Free text: what the job is for, findings.")


class Rejected(Exception):
    """A use case refused its input. ``kind`` names the problem class (e.g.
    ``unknown-dataset``); ``retry_after`` (seconds) is set where waiting helps."""

    def __init__(
        self, kind: str, detail: str, *, retry_after: int | None = None, field: str | None = None
    ) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.retry_after = retry_after
        self.field = field  # the body field at fault (e.g. "finetune.epochs"), where one is


def options_of(job: Job) -> FinetuneOptions | None:
    """The job's fine-tune options as they were stored at submission (not checked again)."""
    return FinetuneOptions.stored(job.finetune) if job.finetune else None


# -- submit -----------------------------------------------------------------------------------


def _resolve(session: Session, tenant_id: uuid.UUID, body: JobCreate, settings: Settings) -> dict:
    """Check a submission against the tenant's datasets, the zoo, the metric registry and the
    deployment's limits; returns the job's columns."""
    from zoopick.selection.metrics import available

    if body.webhook is not None:  # an address the server may not call: no job at all
        refused = check_url(body.webhook.url, settings)
        if refused:
            raise Rejected("invalid-webhook", f"webhook.url: {refused}")
    ds = session.get(Dataset, body.dataset_id)
    if ds is None or ds.tenant_id != tenant_id:
        raise Rejected("unknown-dataset", f"unknown dataset {str(body.dataset_id)!r}")
    if ds.status != DatasetStatus.ready.value:
        why = f": {ds.error}" if ds.error else ""
        raise Rejected(
            "dataset-not-ready", f"dataset {str(ds.id)!r} is {ds.status}, not ready{why}"
        )

    known = set(available())
    metrics = list(dict.fromkeys(body.metrics))
    unknown = [m for m in metrics if m not in known]
    if unknown:
        raise Rejected(
            "unknown-metric",
            f"unknown metric(s) {quoted(unknown)}; available: {', '.join(sorted(known))}",
        )
    select_by = default_select_by(metrics) if body.select_by is None else body.select_by
    if select_by not in metrics:
        raise Rejected(
            "invalid-select-by",
            f"select_by {select_by!r} must be one of the requested metrics {metrics}",
        )

    zoo = zoo_catalog.all_ids(session)
    if body.models == "all":
        models = zoo
        if not models:
            raise Rejected("empty-zoo", "the zoo is empty: register a model first")
    else:
        models = list(dict.fromkeys(body.models))
        if not models:
            raise Rejected("no-models", 'models: give at least one zoo id, or "all"')
        in_zoo = set(zoo)  # once: not a set per requested id
        missing = [m for m in models if m not in in_zoo]
        if missing:
            raise Rejected("unknown-model", f"unknown zoo model(s) {quoted(missing)}")
    if len(models) > settings.max_models_per_job:
        raise Rejected(
            "too-many-models",
            f"{len(models)} models requested; the limit is {settings.max_models_per_job}",
        )
    options = body.finetune
    if options is not None:
        if options.epochs is not None and options.epochs > settings.max_epochs:
            raise Rejected(
                "limit",
                f"finetune.epochs above the limit of {settings.max_epochs}",
                field="finetune.epochs",
            )
        if options.max_workers > settings.max_train_workers:
            raise Rejected(
                "limit",
                f"finetune.workers above the limit of {settings.max_train_workers}",
                field="finetune.workers",
            )
        if options.batch_size > settings.max_batch_size:
            raise Rejected(
                "limit",
                f"finetune.batch_size above the limit of {settings.max_batch_size} "
                "(ZOOPICK_MAX_BATCH_SIZE)",
                field="finetune.batch_size",
            )
        problem = options.feeding_problem((ds.counts or {}).values())
        if problem is not None:  # else it failed after scoring, once its workers started
            raise Rejected("invalid-finetune", f"finetune: {problem}")
    selection = body.selection
    if selection is not None:
        _check_race(session, ds, selection, options, models, settings)
    return {
        "dataset_id": ds.id,
        "models": models,
        "metrics": metrics,
        "select_by": select_by,
        "finetune": options.model_dump(mode="json") if options is not None else None,
        "selection": selection.model_dump(mode="json") if selection is not None else None,
        "webhook": body.webhook.model_dump(mode="json") if body.webhook is not None else None,
        "name": body.name,
        "tags": list(dict.fromkeys(body.tags)),
        "notes": body.notes,
    }


def _check_race(
    session: Session,
    ds: Dataset,
    selection: SelectionOptions,
    options: FinetuneOptions | None,
    models: list[str],
    settings: Settings,
) -> None:
    """A race must have two models to race, stay within the deployment's training limit and
    give every candidate of every rung at least one step on this dataset."""
    from zoopick.service import race

    if len(models) < 2:
        raise Rejected(
            "invalid-selection", "selection: a race needs at least 2 models; this job has 1"
        )
    if selection.budget_epochs > settings.max_epochs:
        raise Rejected(
            "limit",
            f"selection.budget_epochs above the limit of {settings.max_epochs}",
            field="selection.budget_epochs",
        )
    shortlist = min(selection.shortlist, len(models))
    try:
        race.plan_for(
            selection.model_copy(update={"shortlist": shortlist}),
            options or FinetuneOptions(),
            dict(ds.counts or {}),
        )
    except race.RaceRefused as exc:
        raise Rejected("invalid-selection", str(exc)) from None


IDEMPOTENCY_KEY_MAX = 200
"""Longest ``Idempotency-Key`` (the column's width), whichever face it came through."""


def check_idempotency_key(key: str | None) -> None:
    """The API's rules for an idempotency key, for every face (the dashboard's form sends it
    in a hidden field, where any text can be put): 1 to 200 printable characters."""
    if key is None:
        return
    if not 1 <= len(key) <= IDEMPOTENCY_KEY_MAX:
        raise Rejected(
            "invalid-idempotency-key",
            f"the Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_MAX} characters, not {len(key)}",
        )
    if not key.isprintable():
        raise Rejected(
            "invalid-idempotency-key",
            "the Idempotency-Key may hold printable characters only (no NUL or control codes)",
        )


def same_request(request: dict[str, Any]) -> dict[str, Any]:
    """A stored or submitted body in the form a replay compares: ``metrics`` and ``models``
    without repeats (the job runs each once, see ``_resolve``), and ``select_by`` as the job
    resolves it when the body names none, so a pipeline that re-sends ``fsms,fsms`` as
    ``fsms``, or names the default ``select_by`` it had left out, gets its job back under its
    key, not a conflict."""
    out = dict(request)
    for name in ("metrics", "models"):
        if isinstance(out.get(name), list):
            out[name] = list(dict.fromkeys(out[name]))
    metrics = out.get("metrics")
    if out.get("select_by") is None and isinstance(metrics, list) and metrics:
        out["select_by"] = default_select_by(metrics)
    return out


def replay(session: Session, tenant_id: uuid.UUID, key: str | None, body: JobCreate) -> Job | None:
    """The job an earlier submission with this ``Idempotency-Key`` created, or None; the
    same key with another body is refused."""
    if not key:
        return None
    job = session.scalar(select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key))
    if job is not None and same_request(job.request) != same_request(body.model_dump(mode="json")):
        raise Rejected(
            "idempotency-key-reused",
            "this Idempotency-Key was already used with a different request body",
        )
    return job


def _still_there(session: Session, dataset_id: uuid.UUID) -> None:
    """The job's dataset, read again under the tenant's lock just before the job is inserted:
    a deletion commits under the same lock (``DELETE /datasets/{id}``), so one that came
    after ``_resolve`` read it is seen here (422), not left to a foreign key (a 500) or to
    ``ON DELETE SET NULL`` (a job that fails later on a deleted dataset)."""
    if session.scalar(select(Dataset.id).where(Dataset.id == dataset_id)) is None:
        session.rollback()
        raise Rejected("unknown-dataset", f"unknown dataset {str(dataset_id)!r}")


def submit(
    session: Session,
    tenant_id: uuid.UUID,
    body: JobCreate,
    settings: Settings,
    dispatcher: Dispatcher,
    *,
    idempotency_key: str | None = None,
    admit: Callable[[], None] = lambda: None,
) -> Job:
    """Create the job and queue its tasks, or return the one this ``idempotency_key``
    created. ``admit`` runs before a new job is checked (the faces' rate limit: a replay does
    not count)."""
    check_idempotency_key(idempotency_key)
    existing = replay(session, tenant_id, idempotency_key, body)
    if existing is not None:
        return existing
    admit()
    columns = _resolve(session, tenant_id, body, settings)
    try:
        # count and insert under the tenant's lock, or concurrent submits all pass the count
        with quotas.tenant_lock(session, tenant_id):
            _still_there(session, body.dataset_id)
            active = quotas.active_jobs(session, tenant_id)
            if active >= settings.max_active_jobs_per_tenant:
                session.rollback()
                raise Rejected(
                    "too-many-jobs",
                    f"{active} jobs are still running; the limit is "
                    f"{settings.max_active_jobs_per_tenant}",
                    retry_after=max(30, settings.retry_after_seconds),
                )
            job = Job(
                tenant_id=tenant_id,
                request=body.model_dump(mode="json"),
                idempotency_key=idempotency_key,
                status=JobStatus.queued.value,
                progress=0.0,
                **columns,
            )
            session.add(job)
            session.flush()
            job.task_ids = job_task_ids(job)
            session.commit()
    except IntegrityError:  # the same key raced us: answer with the winner
        session.rollback()
        winner = replay(session, tenant_id, idempotency_key, body)
        if winner is None:
            _still_there(session, body.dataset_id)  # deleted by another process meanwhile
            raise
        return winner

    try:
        dispatcher.submit_job(job)
    except Exception as exc:  # noqa: BLE001 - the job must not sit queued forever
        log.exception("could not queue job %s", job.id)
        pipeline.fail(session, job.id, f"could not queue the job: {exc}")
        session.commit()
        raise Rejected("broker-unavailable", f"could not queue the job: {exc}") from None
    return job


# -- show, list -------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobView:
    """What showing a job reads: the row, its ranking so far, its latest training run and
    that run's epochs (plain rows, ``pipeline.epoch_rows``)."""

    job: Job
    options: FinetuneOptions | None
    ranking: list[dict[str, Any]]
    run: TrainingRun | None
    epochs: list[dict[str, Any]] = field(default_factory=list)


def show(session: Session, job: Job) -> JobView:
    # a scoring-only job never has a run: one statement fewer on every poll of it
    run = pipeline.latest_run(session, job.id) if job.finetune else None
    epochs = pipeline.epoch_rows(session, run.id) if run is not None else []
    return JobView(job, options_of(job), pipeline.ranking(session, job), run, epochs)


def listing(tenant_id: uuid.UUID, status: str | None = None) -> Select[tuple[Job]]:
    """The tenant's jobs (newest first once paginated), optionally of one status."""
    if status is not None and status not in STATUSES:
        raise Rejected("unknown-status", f"unknown status {status!r}; one of {', '.join(STATUSES)}")
    stmt = select(Job).where(Job.tenant_id == tenant_id)
    if status:
        stmt = stmt.where(Job.status == status)
    return stmt


# -- cancel -----------------------------------------------------------------------------------


def cancel(session: Session, job: Job, dispatcher: Dispatcher) -> Job:
    """A queued job is cancelled at once. A running one is flagged: its tasks stop at the
    next model or epoch (``cancel_requested``). Queued tasks are revoked either way."""
    if job.status in TERMINAL:
        raise Rejected("job-finished", f"job already {job.status}")
    session.execute(
        update(Job).where(Job.id == job.id).values(cancel_requested=True, updated_at=utcnow())
    )
    was_queued = pipeline.finish_cancelled_if_queued(session, job.id)
    session.commit()
    # a running job keeps select/finetune queued: they see the flag and settle it as cancelled
    scoring = [t for t in job.task_ids if "-score-" in t]
    dispatcher.revoke(list(job.task_ids) if was_queued else scoring)
    session.refresh(job)
    return job
