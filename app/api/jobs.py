"""``/jobs``: submit a selection (and optionally fine-tuning) job, follow it, cancel it, and
download the fine-tuned model. A thin adapter over the service core's use cases
(``zoopick.service.jobs``): HTTP in, a use case, a response model out."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from sqlalchemy.orm import Session

from zoopick.app.api import pagination
from zoopick.app.api.deps import (
    CallerDep,
    Creds,
    DispatcherDep,
    JobDep,
    SessionDep,
    SettingsDep,
    owned_job,
)
from zoopick.app.api.schemas import (
    JobCreate,
    JobOut,
    JobSummary,
    MlflowOut,
    Page,
    TrainingOut,
    pattern_of,
)
from zoopick.app.api.settled import SettledViews
from zoopick.app.problems import Problem, responses
from zoopick.service import (
    exports,
    job_records,
    jobs,
    pipeline,
    progress,
    race,
    run_log,
    storage,
)
from zoopick.service.db.models import TERMINAL, Artefact, Job, JobStatus
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(prefix="/jobs", tags=["jobs"])

ERRORS = responses(400, 404, 409, 422)
STATUSES = pattern_of(JobStatus)

STATUS_OF_KIND = {
    "dataset-not-ready": 409,
    "job-finished": 409,
    "too-many-jobs": 429,
    "broker-unavailable": 503,
    "unknown-status": 400,
    "unknown-order": 400,
    "job-not-finished": 409,
    "empty-patch": 422,
}
"""HTTP status of each ``jobs.Rejected`` kind; every other kind is a 422 (the body names
something that cannot be used)."""


def problem(exc: jobs.Rejected) -> Problem:
    """A use case's refusal as the API's problem document."""
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
    return Problem(STATUS_OF_KIND.get(exc.kind, 422), exc.detail, kind=exc.kind, headers=headers)


def summary_fields(job: Job) -> dict[str, Any]:
    """A job's ``JobSummary`` fields as its row holds them: the stored options are read, not
    validated again (``schemas.JobSummary._as_stored``)."""
    return {
        "id": job.id,
        "status": job.status,
        "progress": job.progress,
        "error": job.error,
        "dataset_id": job.dataset_id,
        "models": job.models,
        "metrics": job.metrics,
        "select_by": job.select_by,
        "finetune": jobs.options_of(job),
        "selection": job.selection,
        "chosen_model": job.chosen_model,
        "cancel_requested": job.cancel_requested,
        "recoveries": job.recoveries or 0,
        "model_errors": job.model_errors or {},
        "created_at": job.created_at,
        "updated_at": job.updated_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "name": job.name,
        "tags": job.tags or [],
        "notes": job.notes,
    }


def summary(job: Job) -> dict:
    return JobSummary(**summary_fields(job)).model_dump()


def detail(session: Session, job: Job, base: str) -> JobOut:
    view = jobs.show(session, job)
    training = None
    if view.run is not None:
        run = view.run
        training = TrainingOut(
            run_id=run.id,
            model=run.model_id,
            status=run.status,
            world_size=run.world_size,
            backend=run.backend,
            backend_ref=run.backend_ref,
            resumes=run.resumes or 0,
            error=run.error,
            started_at=run.started_at,
            finished_at=run.finished_at,
            epochs=view.epochs,  # plain rows: validated once, with the rest of the model
            options={k: v for k, v in (run.config or {}).items() if k in OPTION_FIELDS},
            progress=progress.run_view(run.progress, run.started_at, run.finished_at),
            recipe=run.recipe,
        )
    links = {"self": f"{base}/{job.id}", "cancel": f"{base}/{job.id}/cancel"}
    if job.finetune:
        links["model"] = f"{base}/{job.id}/model"
        links["log"] = f"{base}/{job.id}/log"
    scoring = progress.scoring_view(
        job.models,
        [r["model"] for r in view.ranking],
        job.model_errors or {},
        job.status in TERMINAL,
    )
    return JobOut(
        **summary_fields(job),  # not a dumped JobSummary: that validated its options again
        ranking=view.ranking,
        race=race.view(session, job),
        training=training,
        scoring=scoring,
        mlflow=MlflowOut.model_validate(job.mlflow) if job.mlflow else None,
        links=links,
    )


OPTION_FIELDS = frozenset(jobs.FinetuneOptions.model_fields)
"""What of a run's stored config is its fine-tune options (the rest says where its files are,
which is the server's business)."""


def accepted(session: Session, job: Job, base: str, settings: Settings) -> JSONResponse:
    body = detail(session, job, base).model_dump(mode="json")
    headers = {"Location": f"{base}/{job.id}"}
    if job.status not in TERMINAL:
        headers["Retry-After"] = str(settings.retry_after_seconds)
    return JSONResponse(body, status_code=202, headers=headers)


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
    try:
        job = jobs.submit(
            session,
            caller.tenant_id,
            body,
            settings,
            dispatcher,
            idempotency_key=idempotency_key,
            admit=lambda: request.app.state.rate.check(
                "jobs", str(caller.key_id), "job submissions"
            ),
        )
    except jobs.Rejected as exc:
        raise problem(exc) from None
    return accepted(session, job, base, settings)


@router.get("", response_model=Page[JobSummary], responses=ERRORS, summary="List jobs")
def list_jobs(
    caller: CallerDep,
    session: SessionDep,
    settings: SettingsDep,
    status: Annotated[str | None, Query(pattern=STATUSES)] = None,
    page_size: Annotated[int | None, Query(ge=1)] = None,
    page_token: str | None = None,
    q: Annotated[
        str | None,
        Query(max_length=200, description="Jobs whose name or a tag contains this (any case)."),
    ] = None,
    tag: Annotated[
        str | None, Query(max_length=40, description="Jobs that carry this tag exactly.")
    ] = None,
    order: Annotated[str | None, Query(description="newest (the default) or oldest first.")] = None,
) -> dict:
    try:
        stmt = job_records.search(jobs.listing(caller.tenant_id, status), q, tag)
        oldest_first = job_records.ordered(order) == "oldest"
    except jobs.Rejected as exc:
        raise problem(exc) from None
    return pagination.list_page(
        session,
        stmt,
        Job,
        token=page_token,
        page_size=page_size,
        settings=settings,
        out=summary,
        oldest_first=oldest_first,
    )


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS, summary="Show a job")
async def get_job(job_id: str, request: Request, session: SessionDep, creds: Creds) -> Response:
    """The job, its ranking so far and its training curve: what a client polls."""
    base = str(request.url.path).rsplit("/", 1)[0]

    views: SettledViews = request.app.state.settled_views

    def poll() -> str:
        job = owned_job(job_id, request, session, creds)
        # a job whose work is over answers the JSON it answered before (settled.py)
        body = views.get(job, base)
        if body is None:
            # serialised once, straight from the model built here (returning the model would
            # have FastAPI validate it a second time against ``response_model``: a third of
            # the CPU of the most frequent request)
            out = detail(session, job, base)
            body = out.model_dump_json()
            views.put(job, base, out, body)
        session.close()  # the read transaction ends here, not in a thread of its own
        return body

    # the most frequent request makes one trip to the thread pool, not three (the key and
    # the job, the view, giving the connection back): each trip wakes a thread and then the
    # event loop, and on cores shared with other work (a local worker) every wake-up may
    # wait its turn (issue 21, item 14)
    body = await run_in_threadpool(poll)
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
    try:
        job = jobs.cancel(session, job, dispatcher)
    except jobs.Rejected as exc:
        raise problem(exc) from None
    base = str(request.url.path).rsplit("/", 2)[0]
    return accepted(session, job, base, settings)


@router.get(
    "/{job_id}/model",
    response_class=FileResponse,
    responses={
        200: {
            "content": {"application/octet-stream": {}, "application/x-tar": {}},
            "description": "safetensors, a tar of the timm folder, or ONNX",
        },
        202: {"description": "The export to this format is being made: ask again"},
        **responses(400, 404, 409, 422, 500),
    },
    summary="Download the fine-tuned model",
)
def download_model(
    job: JobDep,
    session: SessionDep,
    request: Request = None,  # type: ignore[assignment] - FastAPI always passes it
    format: Annotated[  # noqa: A002 - the query parameter's name
        Literal[exports.FORMATS],  # type: ignore[valid-type] - the one list
        Query(
            description="safetensors: the weights (timm state dict); timm: a tar of a folder "
            "(config.json + model.safetensors) that timm.create_model loads; onnx: ONNX, "
            "batch size dynamic. timm and onnx are made on first request (202 until ready)."
        ),
    ] = "safetensors",
    retry: Annotated[
        bool,
        Query(
            description="make a failed timm or onnx export again (once its cause is fixed, "
            "e.g. onnx installed on the workers): 202 and a new export instead of the 422 "
            "(or 500) that reports the failure; no effect on an export that has not failed"
        ),
    ] = False,
) -> Response:
    """The job's model file, with its SHA-256 as ``Digest`` and ``ETag`` (``HEAD``: the same
    headers, no body). A failed export answers 422 (``export-failed``: it cannot be made from
    this job, say its dataset was deleted) or 500 (``model-file-damaged``: a model file stored
    on the server cannot be read, or its size is not the one recorded, so the digest sent with
    it would not match). A damaged file is the server's fault, not the request's, and asking
    again does not mend it, hence a 500 and not a 4xx, nor a 503 that clients retry on their
    own. Neither names a server path; the server log has the details."""
    if not job.finetune:
        raise Problem(404, "this job does not fine-tune a model", kind="no-model")
    if job.status != JobStatus.succeeded.value:
        raise Problem(
            409, f"job is {job.status}; the model exists once it succeeded", kind="model-not-ready"
        )
    settings: Settings = request.app.state.settings
    store = storage.open_store(settings.storage_url)
    try:
        art = exports.artefact(session, job, "safetensors", store)
        if art is None:
            raise Problem(404, "the model file of this job is missing", kind="no-model")
        if format != "safetensors":
            marks = exports.Markers.of(store, art)
            export = exports.state(session, job, art, format, store)
            if export.error and retry and marks.forget(format):
                export = exports.ExportState()
            if export.error:
                raise export_failure(format, export)
            if export.ready is None:
                return _exporting(job, marks, format, request)
            art = export.ready
        filename = f"{job.chosen_model or 'model'}-{job.id}{exports.SUFFIX[format]}"
        headers = {"Digest": f"sha-256={art.digest}", "ETag": f'"{art.digest}"'}
        local = exports.local_file(store, art)
        if local is not None:
            return FileResponse(
                local,
                media_type=exports.MEDIA_TYPE[format],
                filename=filename,
                headers=headers,
                stat_result=_intact(art, local),
            )
        return _streamed(store, art, request, exports.MEDIA_TYPE[format], filename, headers)
    except storage.StoreUnavailable as exc:
        raise store_down(exc, settings) from None


def export_failure(fmt: str, export: exports.ExportState) -> Problem:
    """A recorded failure of ``fmt``'s export as the API answers it (see ``download_model``)."""
    again = "once the cause is fixed, ask again with retry=true"
    if export.kind == exports.MODEL_FILE_DAMAGED:
        return Problem(
            500,
            f"the {fmt} export failed: {export.error}. The model file stored on the server is "
            f"damaged: the server's fault, not the request's; report it to the service's "
            f"operators ({again})",
            kind=exports.MODEL_FILE_DAMAGED,
        )
    return Problem(
        422, f"the {fmt} export failed: {export.error} ({again})", kind=exports.EXPORT_FAILED
    )


def _streamed(
    store: storage.Store,
    art: Artefact,
    request: Request,
    media_type: str,
    filename: str,
    headers: dict[str, str],
) -> Response:
    """``art``'s object from a remote store, streamed through (``HEAD``: its headers only),
    after its size is checked against the recorded one (see ``exports.stored_size``)."""
    try:
        size = exports.stored_size(store, art)
    except FileNotFoundError:
        raise Problem(404, "the model file of this job is missing", kind="no-model") from None
    except exports.DamagedFile:
        raise _damaged() from None
    headers = {
        **headers,
        "Content-Length": str(size),
        "Content-Disposition": f'attachment; filename="{filename}"',
    }
    if request.method == "HEAD":
        return Response(media_type=media_type, headers=headers)
    return StreamingResponse(store.get(art.path), media_type=media_type, headers=headers)


def store_down(exc: storage.StoreUnavailable, settings: Settings) -> Problem:
    """503 for a store that is down or refuses: the server's trouble, for a while; the log
    names the store and why, the tenant reads neither."""
    log.error("%s", exc)
    return Problem(
        503,
        "the server's file store is unavailable for now; ask again later",
        kind="store-unavailable",
        headers={"Retry-After": str(settings.retry_after_seconds)},
    )


def _exporting(job: Job, marks: exports.Markers, fmt: str, request: Request) -> JSONResponse:
    """202 while ``fmt``'s export is made (this request sends it unless one is in the
    making). ``Location`` is this URL without ``retry``: a client that follows it polls the
    export this request started, where keeping ``retry=true`` made it start the export again
    on every poll once it failed, and never see the failure."""
    state = request.app.state
    if marks.claim(fmt):  # else one is in the making
        try:
            state.dispatcher.export_model(str(job.id), fmt)
        except BaseException:
            marks.settle(fmt)  # not sent: the next one sends
            raise
    return JSONResponse(
        {"status": "exporting", "format": fmt},
        status_code=202,
        headers={
            "Retry-After": str(state.settings.retry_after_seconds),
            "Location": str(request.url.remove_query_params("retry")),
        },
    )


def _intact(art: Artefact, path: Path) -> os.stat_result:
    """The stat of the file about to be sent, checked against its recorded size (see
    ``exports.served_stat``)."""
    try:
        return exports.served_stat(art, path)
    except FileNotFoundError:
        raise Problem(404, "the model file of this job is missing", kind="no-model") from None
    except exports.DamagedFile:
        raise _damaged() from None


def _damaged() -> Problem:
    return Problem(
        500,
        "the model file stored on the server for this job is damaged: its size is not "
        "the one recorded when it was made, so it is not sent (it would not match its "
        "digest). This is the server's fault, not the request's; report it to the "
        "service's operators",
        kind=exports.MODEL_FILE_DAMAGED,
    )


router.add_api_route(
    "/{job_id}/model", download_model, methods=["HEAD"], include_in_schema=False
)  # HEAD: the GET's headers without its body (FileResponse sends none for a HEAD)


def _run_log(session: Session, job: Job, settings: Settings) -> run_log.RunLog:
    """The job's latest training run's log: its folder where this machine has it, else the
    copy the worker put in the store."""
    run = pipeline.latest_run(session, job.id) if job.finetune else None
    if run is None:
        raise Problem(404, "this job has no training run (yet)", kind="no-training-log")
    files = storage.open_store(settings.storage_url)
    return run_log.for_run(run.output_dir, files, job.tenant_id, job.id)


def log_tail(session: Session, job: Job, settings: Settings, lines: int = 40) -> list[str]:
    """The last lines of the job's training log (the dashboard's tail); empty without one,
    or while the store that holds it is unavailable."""
    try:
        return _run_log(session, job, settings).tail(lines)
    except (Problem, storage.StoreError):
        return []


@router.get(
    "/{job_id}/log",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/plain": {}}, "description": "the log"}, **ERRORS},
    summary="Download the training run's log",
)
def download_log(
    job: JobDep,
    session: SessionDep,
    settings: SettingsDep,
    request: Request = None,  # type: ignore[assignment] - FastAPI always passes it
) -> StreamingResponse:
    """What the trainer printed (bounded: ``service.run_log.MAX_BYTES`` twice at most).
    ``HEAD``: the same headers, and the log is not read."""
    found = _run_log(session, job, settings)
    try:
        if not found.exists:
            raise Problem(404, "the training run has written no log yet", kind="no-training-log")
    except storage.StoreUnavailable as exc:
        raise store_down(exc, settings) from None
    head = request is not None and request.method == "HEAD"
    return StreamingResponse(
        iter(()) if head else found.chunks(),
        media_type="text/plain; charset=utf-8",
        headers={"Content-Disposition": f'attachment; filename="train-{job.id}.log"'},
    )


router.add_api_route("/{job_id}/log", download_log, methods=["HEAD"], include_in_schema=False)


@router.patch(
    "/{job_id}", response_model=JobSummary, responses=ERRORS, summary="Edit a job's words"
)
def patch_job(job: JobDep, body: job_records.JobPatch, session: SessionDep) -> dict:
    """Replace the fields given of the job's name, tags and notes (``null`` clears a name or
    notes, ``[]`` the tags); any job, running or finished."""
    try:
        return summary(job_records.update(session, job, body))
    except jobs.Rejected as exc:
        raise problem(exc) from None


@router.delete("/{job_id}", status_code=204, responses=ERRORS, summary="Delete a finished job")
def delete_job(job: JobDep, session: SessionDep, settings: SettingsDep) -> Response:
    """Delete a finished job (succeeded, failed or cancelled) with its files: its scores, its
    runs and their logs, the model and its exports. 409 (``job-not-finished``) while it runs:
    cancel it first. Its dataset stays."""
    try:
        job_records.delete(session, job, settings)
    except jobs.Rejected as exc:
        raise problem(exc) from None
    return Response(status_code=204)
