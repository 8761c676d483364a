"""The dashboard's pages: server-rendered HTML over the API's own functions.

Every page calls the same functions the REST routes are made of (``app.api.jobs``,
``app.api.datasets``, ``app.api.zoo``, ``deps.get_owned``) with the caller of the session
cookie, so tenants, validation and errors are exactly the API's; a :class:`Problem` becomes
an HTML page or a message beside the form field it names. Scripts only enhance: live
updates poll an HTML fragment of the same template, uploads report their progress.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.datastructures import FormData

from zoopick.app.api import datasets as datasets_api
from zoopick.app.api import jobs as jobs_api
from zoopick.app.api import webhooks as webhooks_api
from zoopick.app.api import zoo as zoo_api
from zoopick.app.api.deps import Caller, SessionDep, get_owned, zoo_model
from zoopick.app.api.schemas import JobOut, ZooModelIn
from zoopick.app.dashboard import auth, figures
from zoopick.app.problems import Problem, problem_response
from zoopick.app.uploads import UNCAPPED_BODY
from zoopick.service import exports, job_records, jobs, metric_notes, storage, zoo_admin
from zoopick.service.datasets import admission, store
from zoopick.service.db.models import TERMINAL, Dataset, Job, Score, ZooModel
from zoopick.service.liveness import worker_status
from zoopick.service.security import authenticate

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=Path(__file__).parent / "templates")

PAGE_SIZE = 20


def age(when: datetime | None, now: datetime | None = None) -> str:
    """``when`` as a short age: "12 s", "5 min", "3 h", "2 d"."""
    if when is None:
        return ""
    now = now or datetime.now(UTC)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    s = max(0, int((now - when).total_seconds()))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h"
    return f"{s // 86400} d"


def sig(value: float | None, digits: int = 4) -> str:
    """``value`` to ``digits`` significant digits, trailing zeros kept (0.5000, 12.00), so a
    column's numbers line up and read alike."""
    if value is None:
        return ""
    text = f"{value:#.{digits}g}"
    return text.rstrip(".") if "e" not in text else text


def duration(seconds: float | None) -> str:
    """``seconds`` as "4.2 s", "3 min 05 s" or "2 h 01 min"."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def between(start: datetime | None, end: datetime | None) -> str:
    """The duration from ``start`` to ``end`` (or to now, "so far"), blank without a start."""
    if start is None:
        return ""
    start = start if start.tzinfo else start.replace(tzinfo=UTC)
    end = end if end is None or end.tzinfo else end.replace(tzinfo=UTC)
    if end is None:
        return duration((datetime.now(UTC) - start).total_seconds()) + " so far"
    return duration((end - start).total_seconds())


def when(value: datetime | None) -> str:
    if value is None:
        return ""
    value = value if value.tzinfo else value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


templates.env.filters["age"] = age
templates.env.filters["sig"] = sig
templates.env.filters["duration"] = duration
templates.env.filters["when"] = when
templates.env.globals["between"] = between


def render(request: Request, name: str, code: int = 200, **context: Any) -> Response:
    context.setdefault("signed_in", False)
    context["csrf"] = auth.csrf_token(request)
    context["path"] = request.url.path
    response = templates.TemplateResponse(request, name, context, status_code=code)
    return auth.keep_csrf(request, response)


def fragment_error(problem: Problem) -> Response:
    """A live fragment's error, as plain text: the pages' script only inserts a fragment that
    came with a 2xx, and the detail quotes what the request gave (``no job '<img ...>'``),
    which served as HTML was script run by a link."""
    return PlainTextResponse(str(problem.detail), status_code=problem.status)


def error_page(request: Request, problem: Problem) -> Response:
    return render(request, "error.html", code=problem.status, problem=problem, signed_in=True)


def _session_caller(request: Request, session) -> Caller:
    return auth.require_caller(request, session)


# -- sign in / out -------------------------------------------------------------------------


async def read_form(request: Request) -> FormData:
    """The posted form, read before the session dependency (FastAPI solves dependencies in
    the order of the parameters): a client that drip-feeds its body holds no database
    connection slot meanwhile."""
    return await request.form()


FormDep = Annotated[FormData, Depends(read_form)]


@router.get("/")
def home(request: Request, session: SessionDep) -> Response:
    signed_in = auth.caller_or_none(request, session) is not None
    return RedirectResponse("/jobs" if signed_in else "/login", status_code=303)


def _safe_next(target: str | None) -> str:
    """Only local paths: a sign-in link must not send the user to another site."""
    if not target or not target.startswith("/") or target.startswith("//"):
        return "/jobs"
    return target


@router.get("/login")
def login_form(request: Request, next: str | None = None) -> Response:
    return render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login")
async def login(request: Request, form: FormDep, session: SessionDep) -> Response:
    auth.check_csrf(request, form.get(auth.CSRF_FIELD))
    token = str(form.get("api_key") or "").strip()
    target = _safe_next(str(form.get("next") or ""))
    try:  # the API's failed-authentication limit, per address, shared with the API
        auth.sign_in_allowed(request)
    except Problem as p:
        response = render(request, "login.html", code=429, next=target, error=p.detail)
        response.headers.update(p.headers)
        return response
    key = await run_in_threadpool(authenticate, session, token) if token else None
    if key is None:
        auth.sign_in_failed(request)
        error = "Enter your API key." if not token else "That API key is not valid (or revoked)."
        return render(request, "login.html", code=401, next=target, error=error)
    response = RedirectResponse(target, status_code=303)
    auth.sign_in(response, request, key)
    return response


@router.post("/logout")
async def logout(request: Request, form: FormDep, session: SessionDep) -> Response:
    auth.check_csrf(request, form.get(auth.CSRF_FIELD))
    response = RedirectResponse("/login", status_code=303)
    await run_in_threadpool(auth.sign_out, request, response, session)
    return response


# -- jobs ----------------------------------------------------------------------------------


def _dataset_names(session, caller: Caller, ids: set) -> dict[str, str]:
    names = {}
    for ds_id in ids:
        try:
            names[str(ds_id)] = get_owned(session, caller, Dataset, str(ds_id), "dataset").name
        except Problem:
            names[str(ds_id)] = "(deleted)"
    return names


def _chosen_scores(session, items: list[dict[str, Any]]) -> dict[str, float]:
    """The chosen model's score under the metric it was chosen by, per job id of the page
    (one query): the list's metric column, as MLflow's run list shows a metric's value."""
    chosen = {
        (str(j["id"]), j["chosen_model"], j["select_by"]) for j in items if j.get("chosen_model")
    }
    if not chosen:
        return {}
    rows = session.execute(
        select(Score.job_id, Score.model_id, Score.metric, Score.value).where(
            Score.job_id.in_({uuid.UUID(jid) for jid, _, _ in chosen}),
            Score.model_id.in_({model for _, model, _ in chosen}),
            Score.metric.in_({metric for _, _, metric in chosen}),
        )
    )
    found = {(str(jid), model, metric): value for jid, model, metric, value in rows}
    return {key[0]: found[key] for key in chosen if key in found}


def _jobs_page(request: Request, session) -> dict[str, Any]:
    caller = _session_caller(request, session)
    status = request.query_params.get("status") or None  # an unknown one: the API's 400
    q = (request.query_params.get("q") or "").strip()[:200] or None
    tag = (request.query_params.get("tag") or "").strip()[:40] or None
    order = request.query_params.get("order") or None  # an unknown one: the API's 400
    token = request.query_params.get("page_token") or None
    size = request.query_params.get("page_size", "")
    # ASCII digits only, and few ("²".isdigit() is true; 5,000 digits overflow int()): a 500
    page_size = int(size) if size.isascii() and size.isdigit() and len(size) <= 4 else 0
    page_size = page_size or PAGE_SIZE
    page = jobs_api.list_jobs(
        caller=caller,
        session=session,
        settings=request.app.state.settings,
        status=status,
        page_size=page_size,
        page_token=token,
        q=q,
        tag=tag,
        order=order,
    )
    ids = {j["dataset_id"] for j in page["items"] if j["dataset_id"]}
    searched = {"status": status, "q": q, "tag": tag, "order": order}
    query = {k: v for k, v in searched.items() if v}
    if page_size != PAGE_SIZE:
        query["page_size"] = str(page_size)
    next_url = _next_page_url("/jobs", page, query)
    return {
        "jobs": page["items"],
        "names": _dataset_names(session, caller, ids),
        "scores": _chosen_scores(session, page["items"]),
        "status": status,
        "statuses": jobs.STATUSES,
        "next_url": next_url,
        "first_page": token is None,
        "first_url": "/jobs" + (f"?{urlencode(query)}" if query else ""),
        "q": q or "",
        "tag": tag or "",
        "order": order or "newest",
        "orders": job_records.ORDERS,
        "rows_url": "/jobs/rows" + (f"?{request.url.query}" if request.url.query else ""),
        "workers": worker_status(session, request.app.state.settings),
    }


@router.get("/jobs")
def jobs_list(request: Request, session: SessionDep) -> Response:
    try:
        context = _jobs_page(request, session)
    except Problem as p:
        return error_page(request, p)
    message = auth.read_note(request, "message")
    return render(request, "jobs.html", signed_in=True, message=message, **context)


@router.get("/jobs/rows")
def jobs_rows(request: Request, session: SessionDep) -> Response:
    """The jobs table's rows alone: what the list page polls to stay live."""
    try:
        context = _jobs_page(request, session)
    except Problem as p:
        return fragment_error(p)
    return render(request, "_job_rows.html", **context)


def _job_context(request: Request, session, job_id: str) -> dict[str, Any]:
    caller = _session_caller(request, session)
    row = get_owned(session, caller, Job, job_id, "job")
    job: JobOut = jobs_api.detail(session, row, "/api/v1/jobs")
    ranking = job.ranking
    ranks = [r.rank for r in ranking]
    tied = {r for r in ranks if ranks.count(r) > 1}
    dataset_name = None
    if job.dataset_id:
        dataset_name = _dataset_names(session, caller, {job.dataset_id})[str(job.dataset_id)]
    return {
        "job": job,
        "tied": tied,
        "metric_charts": figures.metric_charts(job),
        "training_charts": figures.training_charts(job),
        "race_chart": figures.race_chart(job),
        "dataset_name": dataset_name,
        "done": job.status in TERMINAL,
        "has_model": bool(job.finetune) and job.status == "succeeded",
        "formats": FORMATS,
        "why": why_chosen(job, tied),
        "log_tail": (
            jobs_api.log_tail(session, row, request.app.state.settings) if job.training else []
        ),
        "metric_notes": metric_notes.coincidences(job.metrics, _heads(session, job)),
    }


def _heads(session, job: JobOut) -> dict[str, int]:
    """The scored models' head sizes (outputs), from their zoo rows."""
    scored = [r.model for r in job.ranking]
    if not scored:
        return {}
    rows = session.execute(select(ZooModel.id, ZooModel.num_classes).where(ZooModel.id.in_(scored)))
    return {mid: n for mid, n in rows}


def why_chosen(job: JobOut, tied: set[int]) -> str | None:
    """One sentence on why the chosen model won (the race says its own why)."""
    if job.race is not None and job.race.why:
        return job.race.why
    top = next((r for r in job.ranking if r.model == job.chosen_model), None)
    if top is None:
        return None
    value = top.scores.get(job.select_by)
    text = (
        f"{top.model} has the highest {job.select_by} ({sig(value)}) of the "
        f"{len(job.ranking)} model(s) scored"
    )
    if top.rank in tied:
        text += "; it ties with others and was listed first in the request"
    return text + "."


@router.get("/jobs/{job_id}")
def job_page(request: Request, job_id: str, session: SessionDep) -> Response:
    try:
        context = _job_context(request, session, job_id)
    except Problem as p:
        return error_page(request, p)
    message = auth.read_note(request, "message")
    error = auth.read_note(request, "error")
    # the webhook's delivery log, as the page loads (not polled with the live part)
    deliveries = webhooks_api.job_deliveries(session.get(Job, context["job"].id), session)
    return render(
        request, "job.html", signed_in=True, message=message, error=error,
        deliveries=deliveries, **context,
    )  # fmt: skip


@router.get("/jobs/{job_id}/live")
def job_live(request: Request, job_id: str, session: SessionDep) -> Response:
    """The job page's changing part alone: polled while the job runs."""
    try:
        context = _job_context(request, session, job_id)
    except Problem as p:
        return fragment_error(p)
    return render(request, "_job_live.html", **context)


@router.get("/jobs/{job_id}/cancel")
def job_cancel_confirm(request: Request, job_id: str, session: SessionDep) -> Response:
    """The job page's Cancel button leads here: a page that asks before the cancel is posted
    (no script needed; a cancelled job cannot be taken back). A finished job goes back to
    its page, saying so."""
    try:
        caller = _session_caller(request, session)
        row = get_owned(session, caller, Job, job_id, "job")
    except Problem as p:
        return error_page(request, p)
    if row.status in TERMINAL:
        note = auth.note_query(request, "message", f"This job is already {row.status}.")
        return RedirectResponse(f"/jobs/{row.id}?" + urlencode(note), 303)
    return render(request, "cancel.html", signed_in=True, job=row)


@router.post("/jobs/{job_id}/cancel")
async def job_cancel(request: Request, job_id: str, form: FormDep, session: SessionDep) -> Response:
    auth.check_csrf(request, form.get(auth.CSRF_FIELD))

    def cancel() -> str:
        caller = _session_caller(request, session)
        row = get_owned(session, caller, Job, job_id, "job")
        try:
            jobs.cancel(session, row, request.app.state.dispatcher)
        except jobs.Rejected as exc:
            return exc.detail
        return "Cancel requested."

    try:
        message = await run_in_threadpool(cancel)
    except Problem as p:
        if p.status == 404:
            return error_page(request, p)
        message = p.detail
    note = auth.note_query(request, "message", message)
    return RedirectResponse(f"/jobs/{job_id}?" + urlencode(note), 303)


FORMATS = exports.DESCRIPTIONS
"""The download formats the run page offers (the API's ``format``), with their labels."""
EXPORT_KINDS = frozenset({exports.EXPORT_FAILED, exports.MODEL_FILE_DAMAGED})


def _format_of(request: Request, fmt: str | None) -> str:
    """The asked format, or a 400 naming the ones there are (the dashboard's link takes
    ``?format=``, as the API's route does: it was ignored, and ONNX came as safetensors)."""
    fmt = fmt or "safetensors"
    if fmt not in FORMATS:
        raise Problem(400, f"no download format {fmt!r}; one of: {', '.join(FORMATS)}")
    return fmt


def _download(request: Request, session, job_id: str, fmt: str, retry: bool, head: bool):
    """The API's own download of ``fmt`` (``head``: asked as ``HEAD``, so nothing is read
    or streamed: what the export page asks to learn the export's state)."""
    caller = _session_caller(request, session)
    row = get_owned(session, caller, Job, job_id, "job")
    if head:
        request = Request({**request.scope, "method": "HEAD"}, request.receive)
    return row, jobs_api.download_model(row, session, request, format=fmt, retry=retry)


@router.get("/jobs/{job_id}/model")
def job_model(
    request: Request,
    job_id: str,
    session: SessionDep,
    format: str | None = None,  # noqa: A002
    retry: bool = False,
) -> Response:
    """The model in the format asked. An export not made yet (the timm folder, ONNX: made
    on first request, which took 38 s for ONNX with nothing shown) leads to the export's
    page, which follows it and offers the file once made."""
    try:
        fmt = _format_of(request, format)
        _, response = _download(request, session, job_id, fmt, retry, head=False)
    except Problem as p:
        if p.kind in EXPORT_KINDS and format not in (None, "safetensors"):  # an export's
            return RedirectResponse(f"/jobs/{job_id}/export/{format}", 303)  # page says it
        return error_page(request, p)
    if response.status_code == 202:
        since = int(datetime.now(UTC).timestamp())
        return RedirectResponse(f"/jobs/{job_id}/export/{fmt}?since={since}", 303)
    return response


def _export_context(request: Request, session, job_id: str, fmt: str) -> dict[str, Any]:
    """Where ``fmt``'s export of the job stands: ``being-made`` (since when the page was
    first shown), ``ready`` (with its size), or ``failed`` (why; a retry link)."""
    fmt = _format_of(request, fmt)
    since = request.query_params.get("since", "")
    started = int(since) if since.isascii() and since.isdigit() and len(since) <= 12 else None
    context: dict[str, Any] = {"fmt": fmt, "label": FORMATS[fmt][0], "what": FORMATS[fmt][1]}
    try:
        row, response = _download(request, session, job_id, fmt, retry=False, head=True)
    except Problem as p:
        if p.kind not in EXPORT_KINDS:
            raise
        row = get_owned(session, _session_caller(request, session), Job, job_id, "job")
        context.update(job=row, state="failed", error=p.detail, done=True)
        return context
    context.update(job=row, done=response.status_code != 202)
    if response.status_code == 202:
        elapsed = None if started is None else max(0, datetime.now(UTC).timestamp() - started)
        context.update(state="being-made", elapsed=elapsed)
    else:
        size = response.headers.get("content-length", "")
        context.update(state="ready", size=int(size) if size.isdigit() else None)
    query = f"?since={started}" if started is not None else ""
    context["live_url"] = f"/jobs/{row.id}/export/{fmt}/live{query}"
    return context


@router.get("/jobs/{job_id}/export/{fmt}")
def job_export(request: Request, job_id: str, fmt: str, session: SessionDep) -> Response:
    """An export's page: being made (how long so far, live), ready (the download link), or
    failed (why, and a link that makes it again)."""
    try:
        context = _export_context(request, session, job_id, fmt)
    except Problem as p:
        return error_page(request, p)
    return render(request, "export.html", signed_in=True, **context)


@router.get("/jobs/{job_id}/export/{fmt}/live")
def job_export_live(request: Request, job_id: str, fmt: str, session: SessionDep) -> Response:
    try:
        context = _export_context(request, session, job_id, fmt)
    except Problem as p:
        return fragment_error(p)
    return render(request, "_export_live.html", **context)


@router.get("/jobs/{job_id}/log")
def job_log(request: Request, job_id: str, session: SessionDep) -> Response:
    """The training run's whole log, as the API serves it (tenant-scoped, bounded)."""
    try:
        caller = _session_caller(request, session)
        row = get_owned(session, caller, Job, job_id, "job")
        return jobs_api.download_log(row, session, request.app.state.settings)
    except Problem as p:
        return error_page(request, p)


@router.post("/jobs/{job_id}/edit")
async def job_edit(request: Request, job_id: str, form: FormDep, session: SessionDep) -> Response:
    """The job page's name, tags and notes form: the API's ``PATCH`` (a refusal, say a tag
    with a space, said on the page)."""
    auth.check_csrf(request, form.get(auth.CSRF_FIELD))
    fields = {k: str(form.get(k) or "") for k in ("name", "tags", "notes")}
    body = {
        "name": fields["name"].strip() or None,
        "tags": fields["tags"].replace(",", " ").split(),
        "notes": fields["notes"] if fields["notes"].strip() else None,
    }

    def edit() -> tuple[str, str]:
        row = get_owned(session, _session_caller(request, session), Job, job_id, "job")
        try:
            patch = job_records.JobPatch.model_validate(body)
        except ValidationError as exc:
            e = exc.errors()[0]
            where = ".".join(str(p) for p in e["loc"])
            return "error", f"Not saved: {where}: {e['msg']}"
        job_records.update(session, row, patch)
        return "message", "Saved."

    try:
        name, text = await run_in_threadpool(edit)
    except Problem as p:
        return error_page(request, p)
    note = auth.note_query(request, name, text)
    return RedirectResponse(f"/jobs/{job_id}?" + urlencode(note), 303)


@router.get("/jobs/{job_id}/delete")
def job_delete_confirm(request: Request, job_id: str, session: SessionDep) -> Response:
    """Delete asks first, on a page of its own; a job still running goes back to its page,
    saying to cancel it first."""
    try:
        row = get_owned(session, _session_caller(request, session), Job, job_id, "job")
    except Problem as p:
        return error_page(request, p)
    if row.status not in TERMINAL:
        text = f"This job is {row.status}: cancel it first, then delete it."
        return RedirectResponse(
            f"/jobs/{row.id}?" + urlencode(auth.note_query(request, "message", text)), 303
        )
    what = f"job {row.name or str(row.id)[:8]}"
    return render(
        request, "delete.html", signed_in=True, what=what, action=f"/jobs/{row.id}/delete",
        back=f"/jobs/{row.id}",
        consequence="Its ranking, runs, logs, the fine-tuned model and its exports go with it; "
        "its dataset stays.",
    )  # fmt: skip


async def _delete_owned(
    request: Request,
    form: FormData,
    session: Session,
    model: type[Job] | type[Dataset],
    row_id: str,
    remove: Callable[[Session, Any, Any], None],
) -> str | None | Response:
    """A delete form's common part: the CSRF check, the caller's own row, the service's use
    case (``remove``). Returns None when it is gone, the use case's refusal as text, or the
    error page of a row the caller cannot reach."""
    auth.check_csrf(request, form.get(auth.CSRF_FIELD))
    settings = request.app.state.settings
    what = "job" if model is Job else "dataset"

    def delete() -> str | None:
        row = get_owned(session, _session_caller(request, session), model, row_id, what)
        try:
            remove(session, row, settings)
        except jobs.Rejected as exc:
            return exc.detail
        return None

    try:
        return await run_in_threadpool(delete)
    except Problem as p:
        return error_page(request, p)


@router.post("/jobs/{job_id}/delete")
async def job_delete(request: Request, job_id: str, form: FormDep, session: SessionDep) -> Response:
    refused = await _delete_owned(request, form, session, Job, job_id, job_records.delete)
    if isinstance(refused, Response):
        return refused
    if refused:
        note = auth.note_query(request, "message", refused)
        return RedirectResponse(f"/jobs/{job_id}?" + urlencode(note), 303)
    note = auth.note_query(request, "message", f"Job {job_id[:8]} deleted.")
    return RedirectResponse("/jobs?" + urlencode(note), 303)


MAX_COMPARE = 6
"""Jobs one compare page shows side by side (each is a full job poll)."""


@router.get("/compare")
def compare(request: Request, session: SessionDep) -> Response:
    """Two or more jobs side by side: facts, rankings and training curves."""
    caller = _session_caller(request, session)
    ids = list(dict.fromkeys(request.query_params.getlist("jobs")))
    if not 2 <= len(ids) <= MAX_COMPARE:
        return _compare_refused(request, session, ids)
    try:
        rows = [get_owned(session, caller, Job, job_id, "job") for job_id in ids]
    except Problem as p:
        return error_page(request, p)
    views = [jobs_api.detail(session, row, "/api/v1/jobs") for row in rows]
    names = _dataset_names(session, caller, {v.dataset_id for v in views if v.dataset_id})
    return render(
        request, "compare.html", signed_in=True, jobs=views, names=names,
        charts=figures.compare_charts(views),
    )  # fmt: skip


def _compare_refused(request: Request, session, ids: list[str]) -> Response:
    """Compare with fewer than two jobs ticked (or too many): the jobs list again (400), the
    ticks kept and a line above it saying what to do, where a bare "Bad Request" page was."""
    try:
        context = _jobs_page(request, session)
    except Problem as p:
        return error_page(request, p)
    context["rows_url"] = "/jobs/rows"  # the list's own rows, not the compare query's
    ticked = f"{len(ids) or 'none'} ticked"
    message = (
        f"To compare, pick 2 to {MAX_COMPARE} jobs: tick them in the list below, then press "
        f"Compare selected jobs again ({ticked})."
    )
    return render(
        request, "jobs.html", code=400, signed_in=True, compare_error=message,
        ticked=set(ids), **context,
    )  # fmt: skip


# -- submit --------------------------------------------------------------------------------


def _whole_zoo(session, caller: Caller, settings) -> list[Any]:
    """Every zoo model, through the API's own pages (at most ``page_size_max`` a page): the
    form offers all of them, where one page of 100 left the rest of a larger zoo unseen and
    unpickable. A submission reads every zoo id anyway (``service.jobs``), so this costs a
    form what submitting it costs."""
    models: list[Any] = []
    token = None
    while True:
        page = zoo_api.list_zoo(
            caller=caller, session=session, settings=settings,
            page_size=settings.page_size_max, page_token=token,
        )  # fmt: skip
        models.extend(page["items"])
        token = page["next_page_token"]
        if token is None:
            return models


def _submit_choices(request: Request, session, caller: Caller) -> dict[str, Any]:
    settings = request.app.state.settings
    ready = datasets_api.list_datasets(
        caller=caller, session=session, settings=settings, page_size=100, page_token=None,
        status="ready",
    )  # fmt: skip
    return {
        "datasets": ready["items"],
        "zoo": _whole_zoo(session, caller, settings),
        "max_models": settings.max_models_per_job,
        "compressors": jobs.COMPRESSORS,
        "metric_choices": metric_notes.choices(),
    }


DEFAULT_FORM = {
    "metrics": list(jobs.DEFAULT_METRICS),
    "select_by": jobs.DEFAULT_SELECT_BY,
    "finetune": False,
    "recipe": jobs.FinetuneOptions().recipe,
    "epochs": "",  # blank: the recipe's length
    "compressor": jobs.FinetuneOptions().compressor,
    "density": jobs.FinetuneOptions().density,
    "workers": jobs.FinetuneOptions().workers,
    "race": False,
    "shortlist": jobs.SelectionOptions().shortlist,
    "budget_epochs": jobs.SelectionOptions().budget_epochs,
    "models": [],
    "name": "",
    "tags": "",
    "notes": "",
}
FORM_FIELDS = frozenset(DEFAULT_FORM) | {"dataset_id"}
"""The submit form's fields: an error whose body field is one of them shows beside it."""

FIELD_OF_KIND = {
    "unknown-dataset": "dataset_id",
    "dataset-not-ready": "dataset_id",
    "unknown-metric": "metrics",
    "invalid-select-by": "select_by",
    "unknown-model": "models",
    "too-many-models": "models",
    "no-models": "models",
    "empty-zoo": "models",
    "invalid-selection": "budget_epochs",
    "invalid-finetune": "workers",
}


@router.get("/submit")
def submit_form(request: Request, session: SessionDep) -> Response:
    caller = _session_caller(request, session)
    form = dict(DEFAULT_FORM, dataset_id=request.query_params.get("dataset", ""))
    return render(
        request, "submit.html", signed_in=True, form=form, errors={},
        idem=str(uuid.uuid4()), **_submit_choices(request, session, caller),
    )  # fmt: skip


def _split(text: str) -> list[str]:
    return [m.strip() for m in text.replace(";", ",").split(",") if m.strip()]


def _labels(form: dict[str, Any]) -> dict[str, Any]:
    """The form's name, tags (split at commas or spaces) and notes as the job body takes
    them; blank ones left out."""
    labels: dict[str, Any] = {"tags": form["tags"].replace(",", " ").split()}
    if form["name"].strip():
        labels["name"] = form["name"]
    if form["notes"].strip():
        labels["notes"] = form["notes"]
    return labels


def _field_of(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    if parts[:1] in (["finetune"], ["selection"]) and len(parts) > 1:
        return parts[1]
    return parts[0] if parts else "__all__"


_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _form_number(text: str, kind: type[int] | type[float]) -> int | float | str | None:
    """A form field as the JSON number the API takes (a form sends text, and the job body's
    types are strict), or the text itself when it is no such number, so that the API's own
    message ("Input should be a valid integer") shows beside the field."""
    text = text.strip()
    if not text:
        return None
    pattern = _INT if kind is int else _FLOAT
    if not pattern.fullmatch(text):  # plain ASCII notation, as a JSON body would take it
        return text  # (Python's int() and float() also take "1_0", "１", "nan", "inf")
    return kind(text)


@router.post("/submit")
async def submit(request: Request, raw: FormDep, session: SessionDep) -> Response:
    auth.check_csrf(request, raw.get(auth.CSRF_FIELD))
    form = {
        "dataset_id": str(raw.get("dataset_id") or ""),
        "models": [str(m) for m in raw.getlist("models")],
        # ticked boxes, one a metric; a comma-separated value (a script's post) is split
        "metrics": [m for v in raw.getlist("metrics") for m in _split(str(v))],
        "select_by": str(raw.get("select_by") or "").strip(),
        "finetune": raw.get("finetune") == "on",
        "recipe": str(raw.get("recipe") or "").strip(),
        "epochs": str(raw.get("epochs") or ""),
        "compressor": str(raw.get("compressor") or "").strip(),
        "density": str(raw.get("density") or ""),
        "workers": str(raw.get("workers") or ""),
        "race": raw.get("race") == "on",
        "shortlist": str(raw.get("shortlist") or ""),
        "budget_epochs": str(raw.get("budget_epochs") or ""),
        "name": str(raw.get("name") or ""),
        "tags": str(raw.get("tags") or ""),
        "notes": str(raw.get("notes") or ""),
    }
    idem = str(raw.get("idempotency_key") or uuid.uuid4())

    def create() -> tuple[str | None, dict[str, str]]:
        caller = _session_caller(request, session)
        body: dict[str, Any] = {
            "dataset_id": form["dataset_id"] or None,
            "models": form["models"] or "all",
            "metrics": form["metrics"],
            "select_by": form["select_by"] or None,  # blank: the API's default
            **_labels(form),
        }
        if form["finetune"]:
            finetune = {
                "recipe": form["recipe"] or None,
                "epochs": _form_number(form["epochs"], int),
                "compressor": form["compressor"] or None,
                "density": _form_number(form["density"], float),
                "workers": _form_number(form["workers"], int),
            }  # a blank field: the trainer's default, as the API's
            body["finetune"] = {k: v for k, v in finetune.items() if v is not None}
        if form["race"]:
            race = {
                "shortlist": _form_number(form["shortlist"], int),
                "budget_epochs": _form_number(form["budget_epochs"], float),
            }
            body["selection"] = {k: v for k, v in race.items() if v is not None}
        try:
            job_in = jobs.JobCreate.model_validate(body)
        except ValidationError as exc:
            errors: dict[str, str] = {}
            for e in exc.errors():
                errors.setdefault(_field_of(tuple(e["loc"])), e["msg"])
            return None, errors
        try:
            job = jobs.submit(
                session,
                caller.tenant_id,
                job_in,
                request.app.state.settings,
                request.app.state.dispatcher,
                idempotency_key=idem,
                admit=lambda: request.app.state.rate.check(
                    "jobs", str(caller.key_id), "job submissions"
                ),
            )
        except jobs.Rejected as exc:
            field = FIELD_OF_KIND.get(exc.kind, "__all__")
            if exc.field is not None:  # the body field at fault, where the form has it
                name = exc.field.rsplit(".", 1)[-1]
                field = name if name in FORM_FIELDS else "__all__"
            return None, {field: exc.detail}
        except Problem as p:  # the rate limit
            return None, {"__all__": p.detail}
        return str(job.id), {}

    job_id, errors = await run_in_threadpool(create)
    if job_id:
        return RedirectResponse(f"/jobs/{job_id}", status_code=303)
    caller = _session_caller(request, session)
    return render(
        request, "submit.html", code=422, signed_in=True, form=form, errors=errors,
        idem=str(uuid.uuid4()), **_submit_choices(request, session, caller),
    )  # fmt: skip


# -- datasets and zoo ----------------------------------------------------------------------


def _next_page_url(path: str, page: dict, query: dict[str, str] | None = None) -> str | None:
    """The link to a list's next page (its token, and ``query`` kept), or None on the last."""
    token = page["next_page_token"]
    if not token:
        return None
    return f"{path}?" + urlencode({"page_token": token, **(query or {})})


@router.get("/datasets")
def datasets_page(request: Request, session: SessionDep) -> Response:
    caller = _session_caller(request, session)
    try:
        page = datasets_api.list_datasets(
            caller=caller, session=session, settings=request.app.state.settings,
            page_size=PAGE_SIZE, page_token=request.query_params.get("page_token") or None,
            status=None,
        )  # fmt: skip
    except Problem as p:
        return error_page(request, p)
    next_url = _next_page_url("/datasets", page)
    return render(
        request, "datasets.html", signed_in=True, datasets=page["items"], next_url=next_url,
        error=auth.read_note(request, "error"), message=auth.read_note(request, "message"),
    )  # fmt: skip


def _wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


@router.post("/datasets/upload", max_body_size=UNCAPPED_BODY)
async def datasets_upload(request: Request, session: SessionDep) -> Response:
    """The upload form posts here (the page's script with progress, or a plain form post):
    the API's own receiving of the file, then the same admission use case
    (``service.datasets.admission``)."""
    caller = await run_in_threadpool(_session_caller, request, session)
    auth.check_csrf(request, request.query_params.get(auth.CSRF_FIELD))
    try:
        admitted = await datasets_api.receive_and_admit(
            request, caller, session, request.app.state.settings, request.app.state.dispatcher
        )
    except Problem as p:
        if _wants_json(request):
            return problem_response(request, p.status, p.detail, kind=p.kind, title=p.title)
        note = auth.note_query(request, "error", str(p.detail))
        return RedirectResponse("/datasets?" + urlencode(note), status_code=303)
    ds_id = str(admitted.dataset.id)
    if _wants_json(request):
        return JSONResponse({"id": ds_id, "url": f"/datasets/{ds_id}"}, status_code=201)
    return RedirectResponse(f"/datasets/{ds_id}", status_code=303)


@router.get("/datasets/{dataset_id}")
async def dataset_page(request: Request, dataset_id: str, session: SessionDep) -> Response:
    def load() -> tuple[Any, Any]:
        caller = _session_caller(request, session)
        row = get_owned(session, caller, Dataset, dataset_id, "dataset")
        return row, datasets_api.get_dataset(row)

    try:
        row, ds = await run_in_threadpool(load)
    except Problem as p:
        return error_page(request, p)
    thumbs, thumb_error = {}, None
    if ds.status == "ready":
        settings = request.app.state.settings
        try:
            thumbs = await run_in_threadpool(store.thumbnails_of, settings, row)
        except storage.StoreUnavailable as exc:  # the log names the store, the page does not
            thumb_error = jobs_api.store_down(exc, settings).detail
        except Exception as exc:  # noqa: BLE001 - a page without thumbnails still helps
            thumb_error = f"thumbnails could not be made: {exc}"
    return render(
        request, "dataset.html", signed_in=True, ds=ds, thumbs=thumbs, thumb_error=thumb_error,
        done=ds.status in ("ready", "invalid"), error=auth.read_note(request, "error"),
    )  # fmt: skip


@router.get("/datasets/{dataset_id}/delete")
def dataset_delete_confirm(request: Request, dataset_id: str, session: SessionDep) -> Response:
    try:
        row = get_owned(session, _session_caller(request, session), Dataset, dataset_id, "dataset")
    except Problem as p:
        return error_page(request, p)
    return render(
        request, "delete.html", signed_in=True, what=f"dataset {row.name}",
        action=f"/datasets/{row.id}/delete", back=f"/datasets/{row.id}",
        consequence="Its file goes. Finished jobs on it keep their results; a job still "
        "running on it keeps it (cancel the job first).",
    )  # fmt: skip


@router.post("/datasets/{dataset_id}/delete")
async def dataset_delete(
    request: Request, dataset_id: str, form: FormDep, session: SessionDep
) -> Response:
    """The dataset page's delete: the API's own use case (``admission.delete``)."""
    refused = await _delete_owned(request, form, session, Dataset, dataset_id, admission.delete)
    if isinstance(refused, Response):
        return refused
    if refused:
        note = auth.note_query(request, "error", f"Not deleted: {refused}.")
        return RedirectResponse(f"/datasets/{dataset_id}?" + urlencode(note), 303)
    note = auth.note_query(request, "message", "Dataset deleted.")
    return RedirectResponse("/datasets?" + urlencode(note), 303)


@router.get("/datasets/{dataset_id}/thumbs/{file}")
def dataset_thumb(request: Request, dataset_id: str, file: str, session: SessionDep) -> Response:
    try:
        caller = _session_caller(request, session)
        row = get_owned(session, caller, Dataset, dataset_id, "dataset")
    except Problem as p:
        return error_page(request, p)
    settings = request.app.state.settings
    try:
        found = store.thumbnail_of(settings, row, file)
    except storage.StoreUnavailable as exc:
        return error_page(request, jobs_api.store_down(exc, settings))
    headers = {"Cache-Control": "private"}
    if isinstance(found, bytes):  # from a remote store
        return Response(found, media_type="image/png", headers=headers)
    if found is None or not found.is_file():
        return error_page(request, Problem(404, f"no thumbnail {file!r}"))
    return FileResponse(found, media_type="image/png", headers=headers)


ZOO_PAGE_SIZE = 100
"""Zoo models on one page of the zoo page (a row each, no pictures: more than other lists)."""


def _zoo_page(
    request: Request, session, caller: Caller, code: int = 200, **context: Any
) -> Response:
    """The zoo page: a page of models with the caller's jobs that used each, and for an
    admin the add form and a Remove link a row (``context``: the form as posted, its error)."""
    token = request.query_params.get("page_token") or None
    try:
        page = zoo_api.list_zoo(
            caller=caller, session=session, settings=request.app.state.settings,
            page_size=ZOO_PAGE_SIZE, page_token=token,
        )  # fmt: skip
    except Problem as p:  # a mangled page token: the API's 400, as a page
        return error_page(request, p)
    models = page["items"]
    used = zoo_admin.jobs_using(session, caller.tenant_id, (m.id for m in models))
    context.setdefault("form", {})
    return render(
        request, "zoo.html", code=code, signed_in=True, models=models, used=used,
        next_url=_next_page_url("/zoo", page), first_page=token is None, admin=caller.admin,
        error=auth.read_note(request, "error"), message=auth.read_note(request, "message"),
        **context,
    )  # fmt: skip


@router.get("/zoo")
def zoo_page(request: Request, session: SessionDep) -> Response:
    """The zoo, a page at a time with a link to the next, as the other lists (one page of 100
    and no link hid the rest of a larger zoo)."""
    return _zoo_page(request, session, _session_caller(request, session))


def _admin_caller(request: Request, session) -> Caller:
    """The session's caller if an admin's key signed in; the API's 403 otherwise."""
    caller = _session_caller(request, session)
    if not caller.admin:
        raise Problem(403, "this needs an admin API key", kind="forbidden")
    return caller


ZOO_TEXT_FIELDS = ("id", "arch", "weights", "interpolation", "crop_mode", "source")
ZOO_LIST_FIELDS = {"input_size": int, "mean": float, "std": float}


def _zoo_body(form: dict[str, str]) -> dict[str, Any]:
    """The zoo form as ``POST /zoo``'s body: blank fields left out, numbers as JSON numbers
    (or the text, for the API's own message), lists split on commas or spaces."""
    body: dict[str, Any] = {k: form[k].strip() for k in ZOO_TEXT_FIELDS if form[k].strip()}
    for name, kind in (("num_classes", int), ("crop_pct", float)):
        if (value := _form_number(form[name], kind)) is not None:
            body[name] = value
    for name, kind in ZOO_LIST_FIELDS.items():
        if items := form[name].replace(",", " ").split():
            body[name] = [_form_number(item, kind) for item in items]
    body["tags"] = form["tags"].replace(",", " ").split()
    return body


@router.post("/zoo/add")
async def zoo_add(request: Request, raw: FormDep, session: SessionDep) -> Response:
    """The zoo page's add form (admins): the API's body model, then the same use case as
    ``POST /zoo`` (``service.zoo_admin.register``). A refusal is said above the form, which
    keeps what was typed."""
    auth.check_csrf(request, raw.get(auth.CSRF_FIELD))
    names = (*ZOO_TEXT_FIELDS, "num_classes", "crop_pct", *ZOO_LIST_FIELDS, "tags")
    form = {k: str(raw.get(k) or "") for k in names}

    def add() -> tuple[Caller, str | None, str | None]:
        caller = _admin_caller(request, session)
        try:
            body = ZooModelIn.model_validate(_zoo_body(form))
        except ValidationError as exc:
            e = exc.errors()[0]
            where = ".".join(str(p) for p in e["loc"])
            return caller, None, f"{where}: {e['msg']}"
        try:
            row = zoo_admin.register(session, body.model_dump(exclude_none=True))
        except jobs.Rejected as exc:
            return caller, None, exc.detail
        return caller, row.id, None

    try:
        caller, added, refused = await run_in_threadpool(add)
    except Problem as p:
        return error_page(request, p)
    if refused:
        return await run_in_threadpool(
            lambda: _zoo_page(request, session, caller, 422, form=form, form_error=refused)
        )
    note = auth.note_query(request, "message", f"Model {added} added.")
    return RedirectResponse("/zoo?" + urlencode(note), 303)


@router.get("/zoo/{model_id}/remove")
def zoo_remove_confirm(request: Request, model_id: str, session: SessionDep) -> Response:
    """Remove asks first, on a page of its own (admins)."""
    try:
        caller = _admin_caller(request, session)
        row = zoo_model(model_id, session, caller)
    except Problem as p:
        return error_page(request, p)
    return render(
        request, "delete.html", signed_in=True, what=f"zoo model {row.id}",
        action=f"/zoo/{row.id}/remove", back="/zoo", verb="remove",
        consequence="No new job may name it. Past jobs that used it keep their ranking, "
        "their fine-tuned model and its downloads; its id stays taken.",
        final="A removed model cannot be added back under the same id.",
    )  # fmt: skip


@router.post("/zoo/{model_id}/remove")
async def zoo_remove(
    request: Request, model_id: str, form: FormDep, session: SessionDep
) -> Response:
    """The confirmation's post: the use case of ``DELETE /zoo/{id}``
    (``service.zoo_admin.remove``)."""
    auth.check_csrf(request, form.get(auth.CSRF_FIELD))

    def remove() -> str:
        caller = _admin_caller(request, session)
        row = zoo_model(model_id, session, caller)
        zoo_admin.remove(session, row)
        return row.id

    try:
        removed = await run_in_threadpool(remove)
    except Problem as p:
        return error_page(request, p)
    note = auth.note_query(request, "message", f"Model {removed} removed.")
    return RedirectResponse("/zoo?" + urlencode(note), 303)
