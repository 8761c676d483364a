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

What a tenant reads of a failure names no server path (the zoo hides checkpoint paths from
tenants the same way): the worker's log keeps the exception as it was, the error file holds
:func:`public_text` of it, and the failure's kind says whose fault it was: ``export-failed``
(the export could not be made from this job, say its dataset was deleted) or
``model-file-damaged`` (the trainer's file on the server cannot be read: the server's fault).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from zoopick.service import storage
from zoopick.service.db.models import Artefact, Job

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "timm", "onnx")
"""The download formats of a fine-tuned model, the API's ``format`` and the run page's."""
DESCRIPTIONS = {
    "safetensors": ("safetensors", "the weights (a timm state dict), as the trainer wrote them"),
    "timm": ("timm folder", "a tar of config.json and model.safetensors, which timm loads"),
    "onnx": ("ONNX", "for ONNX Runtime and other inference engines; batch size dynamic"),
}
"""Each format's label and one line on what it is; the timm folder and ONNX are made on
first request."""
KIND = {"safetensors": "model", "timm": "model-timm", "onnx": "model-onnx"}
SUFFIX = {"safetensors": ".safetensors", "timm": ".tar", "onnx": ".onnx"}
MEDIA_TYPE = {
    "safetensors": "application/octet-stream",
    "timm": "application/x-tar",
    "onnx": "application/octet-stream",
}


STORED_NAME = {
    "safetensors": "model.safetensors",
    "timm": "model-timm.tar",
    "onnx": "model.onnx",
}
"""A job's model files in the store, under its tenant's ``jobs/<job id>/`` (the trainer's
recipe, ``model.json``, beside the weights)."""


def store_key(tenant_id: object, job_id: object, name: str) -> str:
    """The key of one of a job's files in the store: under its tenant's prefix."""
    return storage.tenant_key(tenant_id, "jobs", str(job_id), name)


def in_store(art: Artefact) -> bool:
    """Whether ``art.path`` is a store key (made since issue 40) rather than the absolute path
    of a file in the storage folder (made before: still served from there)."""
    return not Path(art.path).is_absolute()


def anchor(art: Artefact, storage_dir: Path) -> Path:
    """The local path a worker makes ``art``'s exports beside (in :func:`export_dir`): the
    file itself for a model made before the store, else the job's run folder in this
    machine's storage folder."""
    if not in_store(art):
        return Path(art.path)
    return job_anchor(storage_dir, art.job_id)


def job_anchor(storage_dir: Path, job_id: object) -> Path:
    """:func:`anchor` of a job's model kept in the store."""
    return storage_dir / "jobs" / str(job_id) / "train" / STORED_NAME["safetensors"]


def local_file(store: storage.Store, art: Artefact) -> Path | None:
    """``art``'s file on this machine, if it is one: a path made before the store, or the
    object of a local-folder store; None for a remote store's object."""
    if not in_store(art):
        return Path(art.path)
    return store.local_path(art.path)


def export_dir(model_path: str | Path) -> Path:
    """Where a model's exports are made and their markers kept: beside the trainer's file
    (or :func:`anchor`)."""
    return Path(model_path).parent / "export"


def error_file(model_path: str | Path, fmt: str) -> Path:
    return export_dir(model_path) / f"{fmt}.error"


def artefact(session: Session, job: Job, fmt: str, store: storage.Store) -> Artefact | None:
    """The job's file in ``fmt`` if it exists (on disk or in the store too).
    :class:`storage.StoreUnavailable` if the store cannot say."""
    art = session.scalar(
        select(Artefact).where(Artefact.job_id == job.id, Artefact.kind == KIND[fmt])
    )
    if art is None:
        return None
    found = store.exists(art.path) if in_store(art) else Path(art.path).is_file()
    return art if found else None


EXPORT_FAILED = "export-failed"
"""A failure's kind: the export could not be made (the request's or the job's doing)."""
MODEL_FILE_DAMAGED = "model-file-damaged"
"""A failure's kind: a model file stored on the server cannot be read, or is not the one
recorded (the server's fault, not the request's)."""
MODEL_FILE = "the fine-tuned model file"
"""What a tenant reads for the trainer's file, in place of its server path."""
SERVER_FILE = "a server file"
"""What a tenant reads for any other absolute path on the server."""
MAX_ERROR_CHARS = 2000

_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/-])/[^\s'\"`,;:()\[\]{}<>]+")
"""An absolute POSIX path in an exception's text (not the slash of ``and/or`` or ``1/2``)."""


def public_text(text: str, model_path: str | Path) -> str:
    """``text`` (an exception's message) with no server path left in it: the trainer's file
    is named :data:`MODEL_FILE`, any other absolute path :data:`SERVER_FILE`. Where the
    service keeps its files is the server's business, as a zoo checkpoint's path is."""
    model = Path(model_path)
    for path in sorted({str(model), str(model.resolve())}, key=len, reverse=True):
        text = text.replace(path, MODEL_FILE)
    return _ABSOLUTE_PATH.sub(SERVER_FILE, text)[:MAX_ERROR_CHARS]


def record_failure(model_path: str | Path, fmt: str, kind: str, detail: str) -> None:
    """Remember why ``fmt``'s export of the model at ``model_path`` failed, as a tenant may
    read it (:func:`public_text`), for :func:`state` to report until :func:`forget_failure`."""
    record = {"kind": kind, "detail": public_text(detail, model_path)}
    error_file(model_path, fmt).write_text(json.dumps(record))


@dataclass(frozen=True)
class ExportState:
    ready: Artefact | None = None
    error: str | None = None
    kind: str = EXPORT_FAILED
    """Whose fault ``error`` is: :data:`EXPORT_FAILED` or :data:`MODEL_FILE_DAMAGED`."""


def _failure(model_path: Path, fmt: str) -> ExportState | None:
    """The recorded failure of ``fmt``'s export, if any. An error file of an earlier version
    is plain text that may quote server paths: it is cleaned the same way on the way out."""
    try:
        text = error_file(model_path, fmt).read_text(errors="replace")
    except FileNotFoundError:
        return None
    return _parsed_failure(text, model_path)


def _parsed_failure(text: str, model_path: str | Path) -> ExportState:
    try:
        record = json.loads(text)
        kind, detail = str(record["kind"]), str(record["detail"])
    except (ValueError, TypeError, KeyError):
        kind, detail = EXPORT_FAILED, text
    if kind not in (EXPORT_FAILED, MODEL_FILE_DAMAGED):
        kind = EXPORT_FAILED
    return ExportState(error=public_text(detail, model_path), kind=kind)


def state(
    session: Session, job: Job, model: Artefact, fmt: str, store: storage.Store
) -> ExportState:
    """Whether ``fmt`` of ``job``'s ``model`` is ready, failed (why), or neither yet."""
    art = artefact(session, job, fmt, store)
    if art is not None:
        return ExportState(ready=art)
    return Markers.of(store, model).failure(fmt) or ExportState()


class DamagedFile(Exception):
    """A stored model file is not the one recorded when it was made."""


def served_stat(art: Artefact, path: Path | None = None) -> os.stat_result:
    """The stat of ``art``'s file, which is about to be sent with the digest recorded when it
    was made: a file whose size differs (truncated, replaced) would arrive with a digest it
    does not match, so it raises :class:`DamagedFile` instead (one stat, which the response
    reuses; a same-sized replacement is left to the client's digest check). The path and
    both sizes go to the server log only. ``FileNotFoundError`` if it was removed."""
    st = os.stat(path or art.path)
    _check_size(art, st.st_size)
    return st


def stored_size(store: storage.Store, art: Artefact) -> int:
    """:func:`served_stat` for an object of a remote store: its size, checked against the one
    recorded. ``FileNotFoundError`` if there is none, ``StoreUnavailable`` if the store
    cannot say."""
    size = store.size(art.path)
    if size is None:
        raise FileNotFoundError(art.path)
    _check_size(art, size)
    return size


def _check_size(art: Artefact, size: int) -> None:
    if size != art.size_bytes:
        log.error(
            "job %s: stored model file %s is %d bytes, %d recorded when it was made (%s)",
            art.job_id, art.path, size, art.size_bytes, art.kind,
        )  # fmt: skip
        raise DamagedFile(art.kind)


def keep(store: storage.Store, job: Job, fmt: str, path: Path) -> storage.Stored:
    """The file at ``path`` (the trainer's, or an export just made) moved into the store as
    ``job``'s ``fmt`` file, under its tenant's prefix: recorded by the caller with the key,
    size and SHA-256 returned. The worker's copy is removed once stored (a model is not kept
    twice; a local store links it into place). For the trainer's weights, its recipe
    (``model.json``) goes beside it, where MLflow's record of the run reads it (copied: the
    run's record reads it from the run folder too)."""
    if fmt == "safetensors":
        recipe = path.with_name("model.json")
        if recipe.is_file():
            store.put_file(store_key(job.tenant_id, job.id, recipe.name), recipe)
    return store.put_file(store_key(job.tenant_id, job.id, STORED_NAME[fmt]), path, move=True)


def forget_failure(model_path: str | Path, fmt: str) -> bool:
    """Drop the record of a failed ``fmt`` export of the model at ``model_path`` (or
    :func:`anchor`) so that the next request makes it again; whether there was one."""
    try:
        error_file(model_path, fmt).unlink()
    except FileNotFoundError:
        return False
    return True


PENDING_SECONDS = 900.0
"""How long a sent export is taken to be in the making: past it (its worker died, its message
was lost) the next request sends it again. More than an ONNX export of a large model takes."""


def pending_file(model_path: str | Path, fmt: str) -> Path:
    return export_dir(model_path) / f"{fmt}.pending"


def claim_export(model_path: str | Path, fmt: str) -> bool:
    """Whether this request is the one to send ``fmt``'s export task: no export of it is in
    the making (or the one sent is older than :data:`PENDING_SECONDS`). The marker is made
    with ``O_EXCL``, so of requests arriving together one sends the task."""
    marker = pending_file(model_path, fmt)
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


@dataclass(frozen=True)
class Markers:
    """Where the progress markers of a model's exports live (``<fmt>.pending`` while one is
    in the making, ``<fmt>.error`` once one failed), so that the API and the workers see the
    same ones wherever they run: in the store beside a model kept there
    (``tenants/<tenant>/jobs/<job>/export/``), as files beside a model made before the store
    (the functions above). Built with :meth:`of`; its methods may raise
    ``StoreUnavailable``."""

    store: storage.Store | None
    """None: a model made before the store, whose markers are files beside it."""
    where: str
    """The folder key in the store, or the model file's path."""

    @classmethod
    def of(cls, store: storage.Store, model: Artefact) -> Markers:
        if in_store(model):
            return cls(store, model.path.rsplit("/", 1)[0] + "/export")
        return cls(None, model.path)

    def _key(self, fmt: str, what: str) -> str:
        return f"{self.where}/{fmt}.{what}"

    def claim(self, fmt: str) -> bool:
        """:func:`claim_export`: whether this request is the one to send ``fmt``'s export
        (a conditional create in the store: one of racing requests, on any machine, wins)."""
        if self.store is None:
            return claim_export(self.where, fmt)
        key = self._key(fmt, "pending")
        if self.store.create(key, b""):
            return True
        made = self.store.modified(key)
        if made is None:  # settled just now: the next request sees its outcome
            return False
        if time.time() - made <= PENDING_SECONDS:
            return False
        self.store.delete(key)  # taken over (two takers at once send it twice: harmless)
        return self.store.create(key, b"")

    def settle(self, fmt: str) -> None:
        """:func:`export_settled`."""
        if self.store is None:
            export_settled(self.where, fmt)
        else:
            self.store.delete(self._key(fmt, "pending"))

    def record_failure(self, fmt: str, kind: str, detail: str, model_path: str | Path) -> None:
        """:func:`record_failure`, the detail cleaned of ``model_path`` (the file the worker
        read) and of every other server path."""
        if self.store is None:
            record_failure(self.where, fmt, kind, detail)
            return
        record = {"kind": kind, "detail": public_text(detail, model_path)}
        self.store.put(self._key(fmt, "error"), [json.dumps(record).encode()])

    def failure(self, fmt: str) -> ExportState | None:
        """The recorded failure of ``fmt``'s export, if any."""
        if self.store is None:
            return _failure(Path(self.where), fmt)
        try:
            text = b"".join(self.store.get(self._key(fmt, "error"))).decode(errors="replace")
        except storage.ObjectMissing:
            return None
        return _parsed_failure(text, MODEL_FILE)

    def forget(self, fmt: str) -> bool:
        """:func:`forget_failure`."""
        if self.store is None:
            return forget_failure(self.where, fmt)
        if not self.store.exists(self._key(fmt, "error")):
            return False
        self.store.delete(self._key(fmt, "error"))
        return True
