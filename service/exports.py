"""Downloadable formats of a job's fine-tuned model, as the API sees them (no torch here).

``safetensors`` is what the trainer writes (the job's ``model`` artefact). ``timm`` (a tar of
the Hugging Face Hub folder timm loads) and ``onnx`` are made from it on first request by a
worker (``zoopick.export_model``, which calls ``zoopick.training.export``), stored beside it in
``export/`` and recorded as the artefacts ``model-timm`` and ``model-onnx``; an export that
fails leaves ``export/<format>.error`` saying why, which the API reports instead of waiting,
until a request asks for it again (``retry``: the cause, say ``onnx`` missing on the workers,
may have been fixed since). While an export is being made, ``export/<format>.pending`` says
so: the requests that come meanwhile get their 202 without sending another task (30 parallel
requests queued 30 exports of one model ahead of every other tenant's work).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from zoopick.service.db.models import Artefact, Job

FORMATS = ("safetensors", "timm", "onnx")
KIND = {"safetensors": "model", "timm": "model-timm", "onnx": "model-onnx"}
SUFFIX = {"safetensors": ".safetensors", "timm": ".tar", "onnx": ".onnx"}
MEDIA_TYPE = {
    "safetensors": "application/octet-stream",
    "timm": "application/x-tar",
    "onnx": "application/octet-stream",
}


def export_dir(model_path: str | Path) -> Path:
    """Where a model's exports live: beside the trainer's file."""
    return Path(model_path).parent / "export"


def error_file(model_path: str | Path, fmt: str) -> Path:
    return export_dir(model_path) / f"{fmt}.error"


def artefact(session: Session, job: Job, fmt: str) -> Artefact | None:
    """The job's file in ``fmt`` if it exists (on disk too)."""
    art = session.scalar(
        select(Artefact).where(Artefact.job_id == job.id, Artefact.kind == KIND[fmt])
    )
    return art if art is not None and Path(art.path).is_file() else None


@dataclass(frozen=True)
class ExportState:
    ready: Artefact | None = None
    error: str | None = None


def state(session: Session, job: Job, model: Artefact, fmt: str) -> ExportState:
    """Whether ``fmt`` of ``job``'s ``model`` is ready, failed (why), or neither yet."""
    art = artefact(session, job, fmt)
    if art is not None:
        return ExportState(ready=art)
    failed = error_file(model.path, fmt)
    if failed.is_file():
        return ExportState(error=failed.read_text(errors="replace")[:2000])
    return ExportState()


def forget_failure(model: Artefact, fmt: str) -> bool:
    """Drop the record of a failed ``fmt`` export of ``model`` so that the next request makes
    it again; whether there was one."""
    try:
        error_file(model.path, fmt).unlink()
    except FileNotFoundError:
        return False
    return True


PENDING_SECONDS = 900.0
"""How long a sent export is taken to be in the making: past it (its worker died, its message
was lost) the next request sends it again. More than an ONNX export of a large model takes."""


def pending_file(model_path: str | Path, fmt: str) -> Path:
    return export_dir(model_path) / f"{fmt}.pending"


def claim_export(model: Artefact, fmt: str) -> bool:
    """Whether this request is the one to send ``fmt``'s export task: no export of it is in
    the making (or the one sent is older than :data:`PENDING_SECONDS`). The marker is made
    with ``O_EXCL``, so of requests arriving together one sends the task."""
    marker = pending_file(model.path, fmt)
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        try:
            age = time.time() - marker.stat().st_mtime
        except FileNotFoundError:  # settled just now: the next request sees its outcome
            return False
        if age <= PENDING_SECONDS:
            return False
        os.utime(marker)  # taken over: a later request waits for this one's task
        return True


def export_settled(model_path: str | Path, fmt: str) -> None:
    """The export task ended (made, failed or given up): requests may send it again."""
    pending_file(model_path, fmt).unlink(missing_ok=True)
