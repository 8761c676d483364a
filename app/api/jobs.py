"""``/jobs``: submit a selection (and optionally fine-tuning) job, follow it, cancel it, and
download the fine-tuned model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from zoopick.app.api import pagination
from zoopick.app.api.deps import Caller, CallerDep, DispatcherDep, JobDep, SessionDep, SettingsDep
from zoopick.app.api.schemas import (
    EpochOut,
    JobCreate,
    JobOut,
    JobSummary,
    Page,
    RankedModel,
    TrainingOut,
    default_select_by,
)
from zoopick.app.problems import Problem, responses
from zoopick.service import pipeline, quotas, zoo_catalog
from zoopick.service.db.models import TERMINAL, Artefact, Dataset, DatasetStatus, Job, JobStatus
from zoopick.service.db.types import utcnow
from zoopick.service.dispatch import job_task_ids
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(prefix="/jobs", tags=["jobs"])

ERRORS = responses(400, 404, 409, 422)
STATUSES = "^(queued|scoring|training|succeeded|failed|cancelled)$"


def summary(job: Job) -> dict:
    return JobSummary(
        id=job.id,
        status=job.status,
        progress=job.progress,
        error=job.error,
        dataset_id=job.dataset_id,
        models=job.models,
        metrics=job.metrics,
        select_by=job.select_by,
        finetune=job.finetune,
        chosen_model=job.chosen_model,
        cancel_requested=job.cancel_requested,
        recoveries=job.recoveries or 0,
        model_errors=job.model_errors or {},
        created_at=job.created_at,
        updated_at=job.updated_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
    ).model_dump()


def detail(session: Session, job: Job, base: str) -> JobOut:
    # a scoring-only job never has a run: one statement fewer on every poll of it
    run = pipeline.latest_run(session, job.id) if job.finetune else None
    training = None
    if run is not None:
        training = TrainingOut(
            run_id=run.id,
            model=run.model_id,
            status=run.status,
            world_size=run.world_size,
            error=run.error,
            started_at=run.started_at,
            finished_at=run.finished_at,
            epochs=[EpochOut.model_validate(e) for e in run.epochs],
        )
    links = {"self": f"{base}/{job.id}", "cancel": f"{base}/{job.id}/cancel"}
    if job.finetune:
        links["model"] = f"{base}/{job.id}/model"
    return JobOut(
        **summary(job),
        ranking=[RankedModel(**r) for r in pipeline.ranking(session, job)],
        training=training,
        links=links,
    )


def accepted(session: Session, job: Job, base: str, settings: Settings) -> JSONResponse:
    body = detail(session, job, base).model_dump(mode="json")
    headers = {"Location": f"{base}/{job.id}"}
    if job.status not in TERMINAL:
        headers["Retry-After"] = str(settings.retry_after_seconds)
    return JSONResponse(body, status_code=202, headers=headers)


def resolve(session: Session, caller: Caller, body: JobCreate, settings: Settings) -> dict:
    """Check a submission against the tenant's datasets, the zoo and the metric registry;
    returns the job's columns or raises a 4xx problem naming what is wrong."""
    from zoopick.selection.metrics import available

    ds = session.get(Dataset, body.dataset_id)
    if ds is None or ds.tenant_id != caller.tenant_id:
        raise Problem(422, f"unknown dataset {str(body.dataset_id)!r}", kind="unknown-dataset")
    if ds.status != DatasetStatus.ready.value:
        why = f": {ds.error}" if ds.error else ""
        raise Problem(
            409,
            f"dataset {str(ds.id)!r} is {ds.status}, not ready{why}",
            kind="dataset-not-ready",
        )

    known = set(available())
    metrics = list(dict.fromkeys(body.metrics))
    unknown = [m for m in metrics if m not in known]
    if unknown:
        raise Problem(
            422,
            f"unknown metric(s) {', '.join(map(repr, unknown))}; available: "
            f"{', '.join(sorted(known))}",
            kind="unknown-metric",
        )
    select_by = default_select_by(metrics) if body.select_by is None else body.select_by
    if select_by not in metrics:
        raise Problem(
            422,
            f"select_by {select_by!r} must be one of the requested metrics {metrics}",
            kind="invalid-select-by",
        )

    zoo = zoo_catalog.all_ids(session)
    if body.models == "all":
        models = zoo
        if not models:
            raise Problem(422, "the zoo is empty: register a model first", kind="empty-zoo")
    else:
        models = list(dict.fromkeys(body.models))
        missing = [m for m in models if m not in set(zoo)]
        if not models:
            raise Problem(422, 'models: give at least one zoo id, or "all"', kind="no-models")
        if missing:
            raise Problem(
                422,
                f"unknown zoo model(s) {', '.join(map(repr, missing))}",
                kind="unknown-model",
            )
    if len(models) > settings.max_models_per_job:
        raise Problem(
            422,
            f"{len(models)} models requested; the limit is {settings.max_models_per_job}",
            kind="too-many-models",
        )
    finetune = body.finetune.model_dump() if body.finetune else None
    if finetune:
        check_finetune(finetune)
        if finetune["epochs"] > settings.max_epochs:
            raise Problem(
                422, f"finetune.epochs above the limit of {settings.max_epochs}", kind="limit"
            )
        if finetune["workers"] > settings.max_train_workers:
            raise Problem(
                422,
                f"finetune.workers above the limit of {settings.max_train_workers}",
                kind="limit",
            )
    return {
        "dataset_id": ds.id,
        "models": models,
        "metrics": metrics,
        "select_by": select_by,
        "finetune": finetune,
    }


def check_finetune(options: dict) -> None:
    """The hook, its density and its options as the trainer will build them (422 naming the
    bad one), so a job that could never train is refused before anything runs."""
    from zoopick.training.config import check_comm

    try:
        check_comm(options["compressor"], options["density"], options["hook_options"])
    except ValueError as exc:
        raise Problem(422, f"finetune: {exc}", kind="invalid-finetune") from None


def _by_key(session: Session, caller: Caller, key: str) -> Job | None:
    return session.scalar(
        select(Job).where(Job.tenant_id == caller.tenant_id, Job.idempotency_key == key)
    )


def _replay(session: Session, job: Job, request_body: dict, base: str, settings: Settings):
    if job.request != request_body:
        raise Problem(
            422,
            "this Idempotency-Key was already used with a different request body",
            kind="idempotency-key-reused",
        )
    return accepted(session, job, base, settings)


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses=ERRORS,
    summary="Submit a job",
)
def create_job(
    body: JobCreate,
    request: Request,
    caller: CallerDep,
    session: SessionDep,
    settings: SettingsDep,
    dispatcher: DispatcherDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            min_length=1,
            max_length=200,
            description="Retrying with the same key returns the job created first.",
        ),
    ] = None,
) -> JSONResponse:
    """Score the chosen zoo models on the dataset, pick the best by ``select_by`` and, when
    ``finetune`` is given, fine-tune it. Answers 202 with ``Location`` to poll."""
    base = str(request.url.path).rstrip("/")
    request_body = body.model_dump(mode="json")
    if idempotency_key:
        existing = _by_key(session, caller, idempotency_key)
        if existing is not None:
            return _replay(session, existing, request_body, base, settings)

    request.app.state.rate.check("jobs", str(caller.key_id), "job submissions")
    columns = resolve(session, caller, body, settings)
    try:
        # count and insert under the tenant's lock, or concurrent submits all pass the count
        with quotas.tenant_lock(session, caller.tenant_id):
            active = quotas.active_jobs(session, caller.tenant_id)
            if active >= settings.max_active_jobs_per_tenant:
                session.rollback()
                raise Problem(
                    429,
                    f"{active} jobs are still running; the limit is "
                    f"{settings.max_active_jobs_per_tenant}",
                    kind="too-many-jobs",
                    headers={"Retry-After": str(max(30, settings.retry_after_seconds))},
                )
            job = Job(
                tenant_id=caller.tenant_id,
                request=request_body,
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
        existing = _by_key(session, caller, idempotency_key) if idempotency_key else None
        if existing is None:
            raise
        return _replay(session, existing, request_body, base, settings)

    try:
        dispatcher.submit_job(job)
    except Exception as exc:  # noqa: BLE001 - the job must not sit queued forever
        log.exception("could not queue job %s", job.id)
        pipeline.fail(session, job.id, f"could not queue the job: {exc}")
        session.commit()
        raise Problem(503, f"could not queue the job: {exc}", kind="broker-unavailable") from None
    return accepted(session, job, base, settings)


@router.get("", response_model=Page[JobSummary], responses=ERRORS, summary="List jobs")
def list_jobs(
    caller: CallerDep,
    session: SessionDep,
    settings: SettingsDep,
    status: Annotated[str | None, Query(pattern=STATUSES)] = None,
    page_size: Annotated[int | None, Query(ge=1)] = None,
    page_token: str | None = None,
) -> dict:
    stmt = select(Job).where(Job.tenant_id == caller.tenant_id)
    if status:
        stmt = stmt.where(Job.status == status)
    return pagination.list_page(
        session,
        stmt,
        Job,
        token=page_token,
        page_size=page_size,
        settings=settings,
        out=summary,
    )


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS, summary="Show a job")
def get_job(job: JobDep, request: Request, session: SessionDep) -> Response:
    """The job, its ranking so far and its training curve: what a client polls."""
    base = str(request.url.path).rsplit("/", 1)[0]
    # serialised once, straight from the model built here (returning the model would have
    # FastAPI validate it a second time against ``response_model``: a third of the CPU of
    # the most frequent request)
    body = detail(session, job, base).model_dump_json()
    return Response(body, media_type="application/json")


@router.post(
    "/{job_id}/cancel",
    status_code=202,
    response_model=JobOut,
    responses=ERRORS,
    summary="Cancel a job",
)
def cancel_job(
    job: JobDep,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    dispatcher: DispatcherDep,
) -> JSONResponse:
    """A queued job is cancelled at once. A running one is flagged: its tasks stop at the next
    model or epoch (the response says ``cancel_requested``; poll until ``cancelled``).
    Queued tasks are revoked either way."""
    if job.status in TERMINAL:
        raise Problem(409, f"job already {job.status}", kind="job-finished")
    session.execute(
        update(Job).where(Job.id == job.id).values(cancel_requested=True, updated_at=utcnow())
    )
    was_queued = pipeline.finish_cancelled_if_queued(session, job.id)
    session.commit()
    # a running job keeps select/finetune queued: they see the flag and settle it as cancelled
    scoring = [t for t in job.task_ids if "-score-" in t]
    dispatcher.revoke(list(job.task_ids) if was_queued else scoring)
    session.refresh(job)
    base = str(request.url.path).rsplit("/", 2)[0]
    return accepted(session, job, base, settings)


@router.get(
    "/{job_id}/model",
    response_class=FileResponse,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "safetensors"},
        **ERRORS,
    },
    summary="Download the fine-tuned model",
)
def download_model(job: JobDep, session: SessionDep) -> FileResponse:
    if not job.finetune:
        raise Problem(404, "this job does not fine-tune a model", kind="no-model")
    if job.status != JobStatus.succeeded.value:
        raise Problem(
            409, f"job is {job.status}; the model exists once it succeeded", kind="model-not-ready"
        )
    art = session.scalar(
        select(Artefact).where(Artefact.job_id == job.id, Artefact.kind == "model")
    )
    if art is None or not Path(art.path).is_file():
        raise Problem(404, "the model file of this job is missing", kind="no-model")
    return FileResponse(
        art.path,
        media_type="application/octet-stream",
        filename=f"{job.chosen_model or 'model'}-{job.id}.safetensors",
        headers={"Digest": f"sha-256={art.digest}", "ETag": f'"{art.digest}"'},
    )
