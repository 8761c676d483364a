"""MLflow tracking: every finished job logged as one MLflow run (``zoopick[mlflow]``, on when
``ZOOPICK_MLFLOW_TRACKING_URI`` is set).

*When.* Logging must never fail or slow a job, so it happens after the job ended, on the cpu
queue, the way webhooks are sent (``zoopick.service.webhooks``): :func:`enqueue` is called
wherever a job reaches a terminal state (``pipeline.transition``, a cancel of a queued job,
the sweeper settling a lost one) and marks the job ``mlflow.status = "pending"`` in that same
transaction; once it commits, ``zoopick.log_mlflow`` is sent. Its one try (:func:`attempt`)
claims the job (:func:`claim`: pending, or a claim that went stale), builds the
:class:`RunRecord` from the database, hands it to ``tracking_client.log`` (bounded by
``mlflow_timeout_seconds`` per request and a deadline overall) and settles the outcome on the
job (:func:`settle`):
``logged`` with the run's id and page, or the server's error, tried again with a doubling
backoff up to ``mlflow_max_attempts``, then ``failed``. The job's own status never changes;
the API shows ``mlflow`` on the job and the dashboard on its page. The sweeper re-sends claims
left pending (:func:`resend_stale`).

*What.* One run per job (run name = job id; the tag ``zoopick.job_id`` finds it again, so a
redelivered task never makes a second run): tags (tenant, dataset, status, version), params
(metrics asked, select_by, fine-tune and selection options), every model's score per metric
(``score/<metric>/<model>``), its rank (``rank/<model>``) and the chosen model's scores
(``chosen/<metric>``), the fine-tune curve per epoch (``train_loss``, ``train_accuracy``,
``test_accuracy``, ``val_accuracy``, bytes and seconds; ``step`` = epoch) and the trainer's
sub-epoch points (``step/train_loss``, ``step/train_accuracy``; ``step`` = optimizer step),
the dataset as the run's input, and artifacts: ``model/model.safetensors`` with
``model/model.json`` (and ``model/model.onnx`` once exported) and ``zoopick/ranking.json``.
Every timestamp comes from the database, so logging the same job again writes the same
points. The run ends as FINISHED, FAILED or KILLED (cancelled).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import tempfile
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from zoopick.service import outbox
from zoopick.service.db.models import (
    TERMINAL,
    Artefact,
    Dataset,
    Job,
    JobStatus,
    Tenant,
    TrainingRun,
)
from zoopick.service.db.session import session_scope
from zoopick.service.db.types import utcnow
from zoopick.service.settings import Settings, get_settings
from zoopick.service.storage import StoreUnavailable

log = logging.getLogger(__name__)

RUN_STATUS = {
    JobStatus.succeeded.value: "FINISHED",
    JobStatus.failed.value: "FAILED",
    JobStatus.cancelled.value: "KILLED",
}
"""The MLflow run status a job's terminal state ends its run with."""
JOB_TAG = "zoopick.job_id"
"""The tag a job's run is found by (one run per job, whatever was delivered twice)."""
PENDING, LOGGING, LOGGED, FAILED = "pending", "logging", "logged", "failed"
STATUSES = (PENDING, LOGGING, LOGGED, FAILED)
"""Where logging a job to MLflow stands (``Job.mlflow["status"]``): the API's list of them."""
EPOCH_METRICS = {
    "loss": "train_loss",
    "train_accuracy": "train_accuracy",
    "test_accuracy": "test_accuracy",
    "bytes_sent": "bytes_sent",
    "compute_seconds": "compute_seconds",
    "select_seconds": "select_seconds",
    "comm_seconds": "comm_seconds",
}
"""``epoch_metrics`` columns and the MLflow metric each becomes (``step`` = epoch)."""
MAX_PARAM = 6000  # MLflow's longest param value
MAX_TAG = 5000  # below MLflow's 8000, whatever its backend store
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


# -- the record: what a job's run holds ----------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One metric value: MLflow's (key, value, timestamp in ms, step)."""

    key: str
    value: float
    timestamp: int
    step: int = 0


@dataclass(frozen=True)
class DatasetInput:
    """The job's dataset as the run's input (MLflow's dataset entity)."""

    name: str
    digest: str
    source: str
    profile: str


@dataclass(frozen=True)
class RunRecord:
    """Everything logged for one job, read from the database in one go (plain data: the
    client side needs no session)."""

    job_id: str
    experiment: str
    status: str
    start_ms: int
    end_ms: int
    tags: dict[str, str]
    params: dict[str, str]
    metrics: list[Point]
    artifacts: list[tuple[str, str]] = field(default_factory=list)
    """(local file, artifact folder) pairs."""
    stored: list[tuple[str, str]] = field(default_factory=list)
    """(store key, artifact folder) pairs: files of a remote store, fetched to a scratch
    folder for the upload (:func:`fetch_stored`) and added to ``artifacts``."""
    documents: dict[str, Any] = field(default_factory=dict)
    """Artifact path -> JSON document."""
    dataset: DatasetInput | None = None


def key_part(name: str) -> str:
    """``name`` as one segment of an MLflow metric key. MLflow allows letters, digits,
    ``_ - . /``, spaces and (except on Windows) ``:``, and treats ``/`` as a folder; we keep
    ASCII letters, digits and ``_ - .``: anything else (``/`` too, so that a hub id such as
    ``timm/vit`` stays one segment) becomes ``_``, and the key then ends with a short hash of
    the original name, so that two names never share a key."""
    safe = _UNSAFE.sub("_", name)[:100]
    if safe != name or safe in ("", ".", ".."):
        safe = f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:6]}"
    return safe


def _ms(when: datetime | None, default: datetime) -> int:
    return int((when or default).timestamp() * 1000)


def _text(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _options(prefix: str, options: dict[str, Any]) -> dict[str, str]:
    return {f"{prefix}.{k}": _text(v, MAX_PARAM) for k, v in options.items() if v is not None}


def build(session: Session, job: Job, settings: Settings) -> RunRecord:
    """The run of ``job`` as it is in the database now (a terminal job: nothing changes it)."""
    from zoopick import __version__
    from zoopick.service.exports import KIND, local_file
    from zoopick.service.pipeline import latest_run, ranking
    from zoopick.service.storage import open_store
    from zoopick.training.config import FINAL_CONFIG, FinetuneOptions
    from zoopick.training.race import SelectionOptions

    now = utcnow()
    end = job.finished_at or now
    tenant = session.get(Tenant, job.tenant_id)
    dataset = session.get(Dataset, job.dataset_id) if job.dataset_id else None
    ranked = ranking(session, job)
    run: TrainingRun | None = latest_run(session, job.id) if job.finetune else None

    tags = {
        JOB_TAG: str(job.id),
        "zoopick.tenant": tenant.name if tenant is not None else "",
        "zoopick.status": job.status,
        "zoopick.version": __version__,
        "zoopick.select_by": job.select_by,
        "zoopick.dataset_id": str(job.dataset_id) if job.dataset_id else "",
        "zoopick.dataset_name": dataset.name if dataset is not None else "",
        "mlflow.user": tenant.name if tenant is not None else "",
        "mlflow.source.name": "zoopick",
        "mlflow.note.content": _note(job, ranked),
    }
    if job.chosen_model:
        tags["zoopick.chosen_model"] = job.chosen_model
    if job.error:
        tags["zoopick.error"] = _text(job.error, MAX_TAG)
    if job.model_errors:
        tags["zoopick.skipped_models"] = _text(", ".join(job.model_errors), MAX_TAG)

    params = {
        "metrics": ",".join(job.metrics),
        "select_by": job.select_by,
        "models": _text(",".join(job.models), MAX_PARAM),
    }
    if job.finetune:
        params.update(_options("finetune", FinetuneOptions.stored(job.finetune).model_dump()))
    if job.selection:
        params.update(_options("selection", SelectionOptions.stored(job.selection).model_dump()))
    if run is not None:
        params.update({"training.backend": run.backend, "training.world_size": str(run.world_size)})

    stamp = _ms(end, now)
    points: list[Point] = []
    keys: dict[str, str] = {}
    for row in ranked:
        model = keys.setdefault(row["model"], key_part(row["model"]))
        points.append(Point(f"rank/{model}", float(row["rank"]), stamp))
        for metric, value in row["scores"].items():
            points.append(Point(f"score/{key_part(metric)}/{model}", float(value), stamp))
            if row["model"] == job.chosen_model:
                points.append(Point(f"chosen/{key_part(metric)}", float(value), stamp))
    artifacts: list[tuple[str, str]] = []
    stored: list[tuple[str, str]] = []
    if run is not None:
        points += _curve(run, now)
        store = open_store(settings.storage_url)
        for art in session.scalars(select(Artefact).where(Artefact.job_id == job.id)):
            path = local_file(store, art)
            if path is None:  # a remote store's: fetched when the run is written
                if art.kind == KIND["safetensors"]:
                    stored.append((art.path, "model"))
                    stored.append((f"{art.path.rsplit('/', 1)[0]}/{FINAL_CONFIG}", "model"))
                elif art.kind == KIND["onnx"]:
                    stored.append((art.path, "model"))
                continue
            if not path.is_file():
                continue
            if art.kind == KIND["safetensors"]:
                artifacts.append((str(path), "model"))
                config = path.with_name(FINAL_CONFIG)
                if config.is_file():
                    artifacts.append((str(config), "model"))
            elif art.kind == KIND["onnx"]:
                artifacts.append((str(path), "model"))
    documents = {
        "zoopick/ranking.json": {
            "job_id": str(job.id),
            "select_by": job.select_by,
            "chosen_model": job.chosen_model,
            "ranking": ranked,
            "model_errors": job.model_errors or {},
            "metric_keys": keys,
        }
    }
    return RunRecord(
        job_id=str(job.id),
        experiment=settings.mlflow_experiment,
        status=RUN_STATUS[job.status],
        start_ms=_ms(job.started_at or job.created_at, now),
        end_ms=stamp,
        tags={k: _text(v, MAX_TAG) for k, v in tags.items() if v != ""},
        params=params,
        metrics=points,
        artifacts=artifacts,
        stored=stored,
        documents=documents,
        dataset=_dataset(dataset),
    )


def _curve(run: TrainingRun, now: datetime) -> list[Point]:
    """The run's epoch curve (``step`` = epoch) and its sub-epoch points (``step`` = the
    optimizer step since the run started)."""
    points = []
    for epoch in run.epochs:
        stamp = _ms(epoch.created_at, now)
        for column, key in EPOCH_METRICS.items():
            value = getattr(epoch, column)
            if value is not None:
                points.append(Point(key, float(value), stamp, epoch.epoch))
        val = (epoch.extra or {}).get("val_accuracy")
        if val is not None:
            points.append(Point("val_accuracy", float(val), stamp, epoch.epoch))
    state = run.progress or {}
    steps = state.get("steps")
    if steps:
        stamp = _ms(run.started_at, now)
        by_step: dict[int, tuple[float | None, float | None]] = {}
        for x, loss, acc in state.get("points") or []:
            by_step[round(x * steps)] = (loss, acc)
        for step, (loss, acc) in sorted(by_step.items()):
            if loss is not None:
                points.append(Point("step/train_loss", float(loss), stamp, step))
            if acc is not None:
                points.append(Point("step/train_accuracy", float(acc), stamp, step))
    return points


def _dataset(dataset: Dataset | None) -> DatasetInput | None:
    if dataset is None:
        return None
    classes = list(dataset.classes or [])
    profile = {"num_samples": dataset.num_samples, "num_classes": len(classes)}
    return DatasetInput(
        name=dataset.name[:500],
        digest=(dataset.digest or dataset.file_sha256)[:16],
        source=json.dumps({"dataset_id": str(dataset.id), "filename": dataset.filename}),
        profile=json.dumps({**profile, "classes": classes[:2000]}),
    )


def _note(job: Job, ranked: list[dict[str, Any]]) -> str:
    """The run's description in the MLflow UI."""
    text = f"zoopick job {job.id}: {job.status}; {len(ranked)} model(s) ranked by {job.select_by}"
    if job.chosen_model:
        text += f", chose {job.chosen_model}"
        if job.finetune:
            text += " and fine-tuned it"
    return text + "."


# -- the outbox: marked in the move's transaction, sent once it commits ---------------------------


def _settings_of(session: Session) -> Settings:
    dispatcher = session.info.get(outbox.DISPATCHER_KEY)
    settings = getattr(dispatcher, "settings", None)
    return settings if isinstance(settings, Settings) else get_settings()


def enqueue(session: Session, job_id: uuid.UUID, status: JobStatus) -> bool:
    """Mark a job that just reached a terminal ``status`` to be logged to MLflow (when a
    tracking server is configured); the task goes out when the transaction commits."""
    if status not in TERMINAL or not _settings_of(session).mlflow_tracking_uri:
        return False
    state = {"status": PENDING, "attempts": 0, "updated_at": utcnow().isoformat()}
    session.execute(update(Job).where(Job.id == job_id).values(mlflow=state))
    outbox.send_after_commit(session, "the MLflow logging of job", job_id,
                             lambda d, i: d.log_mlflow(i))  # fmt: skip
    return True


# -- one try: claim, log (tracking_client), settle -------------------------------------------------


def stale_after(settings: Settings) -> float:
    """Seconds after which a pending or claimed logging nobody finished was lost (its
    message, or the worker that held it): longer than the whole backoff schedule and a
    bounded try."""
    return outbox.stale_after(
        settings.mlflow_backoff_seconds, settings.mlflow_max_attempts, deadline_seconds(settings)
    )


def deadline_seconds(settings: Settings) -> float:
    """The longest one try may take (``tracking_client`` stops between requests past it)."""
    return settings.mlflow_timeout_seconds * 6


def claim(session: Session, job_id: uuid.UUID, settings: Settings) -> RunRecord | None:
    """Take the job's logging for one try: it is pending, or a claim went stale (its
    worker died). Returns what to log, or None (logged, given up, or another task has it)."""
    job = session.get(Job, job_id, with_for_update=True, populate_existing=True)
    state = dict(job.mlflow or {}) if job is not None else {}
    if job is None or job.status not in TERMINAL or state.get("status") not in (PENDING, LOGGING):
        return None
    if state["status"] == LOGGING:
        since = datetime.fromisoformat(state["updated_at"])
        if utcnow() - since < timedelta(seconds=deadline_seconds(settings) + 60):
            return None  # another task is logging it now
    state.update(status=LOGGING, attempts=int(state.get("attempts") or 0) + 1,
                 updated_at=utcnow().isoformat())  # fmt: skip
    job.mlflow = state
    record = build(session, job, settings)
    session.flush()
    return record


@dataclass(frozen=True)
class Logged:
    """Where the job's run is on the tracking server."""

    run_id: str
    experiment_id: str
    url: str | None


def settle(
    session: Session,
    job_id: uuid.UUID,
    logged: Logged | None,
    error: str | None,
    settings: Settings,
) -> float | None:
    """Record how the try went on the job; seconds until the next try when there is one."""
    job = session.get(Job, job_id, with_for_update=True, populate_existing=True)
    if job is None:
        return None
    state = dict(job.mlflow or {})
    now = utcnow().isoformat()
    if logged is not None:
        state.update(status=LOGGED, error=None, run_id=logged.run_id,
                     experiment_id=logged.experiment_id, url=logged.url, logged_at=now,
                     updated_at=now)  # fmt: skip
        job.mlflow = state
        return None
    attempts = int(state.get("attempts") or 1)
    retry = attempts < settings.mlflow_max_attempts
    state.update(status=PENDING if retry else FAILED, error=_text(error or "unknown", 2000),
                 updated_at=now)  # fmt: skip
    job.mlflow = state
    return outbox.retry_in(settings.mlflow_backoff_seconds, attempts) if retry else None


@dataclass(frozen=True)
class Attempt:
    """How one try went: ``skipped`` (nothing to do), ``logged``, ``retry`` (in ``retry_in``
    seconds) or ``failed`` (given up)."""

    outcome: str
    logged: Logged | None = None
    error: str | None = None
    retry_in: float | None = None


def attempt(factory: Any, job_id: uuid.UUID, settings: Settings) -> Attempt:
    """One try of logging a finished job (the ``zoopick.log_mlflow`` task): claim it, write
    its run (``tracking_client``, no session held meanwhile), settle how it went. A server
    that fails is a warning, kept on the job; whatever it did, the job stays as it ended."""
    from zoopick.service import tracking_client

    with session_scope(factory) as session:
        record = claim(session, job_id, settings)
    if record is None:
        return Attempt("skipped")
    logged, error = None, None
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlflow-", dir=settings.data_dir) as scratch:
        try:
            logged = tracking_client.log(fetch_stored(record, settings, Path(scratch)), settings)
        except StoreUnavailable as exc:  # the log names the store; the job's warning not
            log.warning("could not log job %s to MLflow: %s", job_id, exc)
            error = "the server's file store, which holds the model, is unavailable"
        except Exception as exc:  # noqa: BLE001 - any failure is the job's warning
            error = tracking_client.describe(exc, settings)
            log.warning("could not log job %s to MLflow: %s", job_id, error)
    with session_scope(factory) as session:
        retry_in = settle(session, job_id, logged, error, settings)
    if logged is not None:
        return Attempt("logged", logged=logged)
    return Attempt("retry" if retry_in is not None else "failed", error=error, retry_in=retry_in)


def fetch_stored(record: RunRecord, settings: Settings, scratch: Path) -> RunRecord:
    """``record`` with its files kept in a remote store copied into ``scratch`` (this
    machine's, gone once the run is written) and listed in its ``artifacts`` under their own
    names; one the store does not hold (a recipe a run did not write) is left out.
    ``StoreUnavailable``: the try fails, as a server that is down does, and is retried."""
    from zoopick.service.storage import ObjectMissing, open_store

    if not record.stored:
        return record
    store = open_store(settings.storage_url)
    artifacts = list(record.artifacts)
    for key, folder in record.stored:
        dest = scratch / folder / key.rsplit("/", 1)[-1]
        try:
            store.get_to_file(key, dest)
        except ObjectMissing:
            continue
        artifacts.append((str(dest), folder))
    return dataclasses.replace(record, artifacts=artifacts, stored=[])


def resend_stale(factory: Any, dispatcher: Any, settings: Settings) -> list[str]:
    """Send again the loggings left pending or claimed too long (the recovery sweep calls
    this): their message was lost, or the worker died mid-try."""
    if not settings.mlflow_tracking_uri:
        return []
    cutoff = utcnow() - timedelta(seconds=stale_after(settings))
    waiting = Job.mlflow["status"].as_string().in_([PENDING, LOGGING])
    with factory.begin() as session:
        jobs = list(session.scalars(select(Job).where(waiting, Job.updated_at < cutoff).limit(100)))
        for job in jobs:  # touched: the next sweep waits a whole period again
            job.mlflow = {**(job.mlflow or {}), "status": PENDING, "updated_at": utcnow()
                          .isoformat()}  # fmt: skip
        ids = [str(j.id) for j in jobs]
    for job_id in ids:
        dispatcher.log_mlflow(job_id)
    return ids
