"""A fine-tune's resumable checkpoint in the store (issue 40), so a re-delivered fine-tune
resumes on another machine.

The run folder is the training machine's own (its ``ZOOPICK_DATA_DIR``). While a run goes, an
:class:`Uploader` thread watches the folder's ``checkpoint.pt`` and, each time the trainer has
replaced it, puts it with the ranks' ``comm-state-rank<r>.pt`` beside it in the store as ONE
object (an uncompressed tar, :func:`stored_key`, under the job's prefix: deleting the job
deletes it). One object, so a reader never meets a checkpoint of one epoch with the residuals
of another in the store; newest wins (the next put replaces it). The follow loop never waits
on the store: the thread does the upload, one at a time, and a store that fails costs that
checkpoint only (logged), never the run.

A race's candidates keep theirs the same way (:func:`race_key`): each rung's checkpoint is put
there before the rung is settled, so a later rung or the winner's fine-tune taken by a gpu
worker on another machine continues from it instead of from the zoo's weights. On the Ray
backend a candidate's rungs continue from Ray Train's storage beside it
(:func:`candidate_prefix`), and a winner's fine-tune there names this object to its workers,
which fetch it on their own machines (``service.ray_inputs``).

A delivery whose run folder has no checkpoint first :func:`fetch`-es the store's into it, so
the trainer's ``--resume`` continues where the lost run stopped (its epoch, optimizer and
recipe state: ``training.finetune._restore``). A store that is down is tried again
(``storage.retrying``) and then :class:`~zoopick.service.storage.StoreUnavailable` is raised:
the task fails the job naming the store rather than start again from scratch, since a fresh
run would throw away the stored epochs and put its own over them.
"""

from __future__ import annotations

import logging
import os
import re
import tarfile
import threading
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from zoopick.service import storage
from zoopick.training.config import CHECKPOINT

log = logging.getLogger(__name__)

OBJECT_NAME = "checkpoint.tar"
WATCH_SECONDS = 2.0
"""How often the uploader looks at the run folder's checkpoint."""
_MEMBER = re.compile(r"checkpoint\.pt|comm-state-rank[0-9]+\.pt")
"""The files of a resumable checkpoint (``training.config.CHECKPOINT`` and ``COMM_STATE``):
nothing else is packed, and nothing else is unpacked."""


def stored_key(tenant_id: uuid.UUID, job_id: uuid.UUID) -> str:
    """Where a job's run checkpoint is kept: beside its log, under the job's prefix."""
    return storage.tenant_key(tenant_id, "jobs", str(job_id), "train", OBJECT_NAME)


def candidate_folder(model_id: str) -> str:
    """The folder name of a race candidate's run (fixed per model, so every rung resumes it)."""
    import hashlib

    return hashlib.sha256(model_id.encode()).hexdigest()[:16]


def candidate_prefix(tenant_id: uuid.UUID, job_id: uuid.UUID, model_id: str) -> str:
    """A race candidate's folder in the store, under the job's prefix: its last checkpoint
    (:func:`race_key`) and, on the Ray backend, its run's storage (``<prefix>/ray``, which
    every rung continues)."""
    return storage.tenant_key(tenant_id, "jobs", str(job_id), "race", candidate_folder(model_id))


def race_key(tenant_id: uuid.UUID, job_id: uuid.UUID, model_id: str) -> str:
    """Where a race candidate's last checkpoint is kept, under the job's prefix: a later rung,
    or the winner's fine-tune, taken by a worker on another machine starts from it."""
    return f"{candidate_prefix(tenant_id, job_id, model_id)}/{OBJECT_NAME}"


def members(folder: Path) -> list[Path]:
    """The checkpoint's files in ``folder`` (the checkpoint first), or none without one."""
    if not (folder / CHECKPOINT).is_file():
        return []
    states = sorted(
        p for p in folder.iterdir() if p.name != CHECKPOINT and _MEMBER.fullmatch(p.name)
    )
    return [folder / CHECKPOINT, *states]


def pack(folder: Path, into: Path) -> bool:
    """Write the checkpoint's files to the tar ``into``; False where there is no checkpoint.
    Each file is replaced whole by the trainer (written, then renamed), so each is read whole."""
    files = members(folder)
    if not files:
        return False
    with tarfile.open(into, "w") as tar:
        for path in files:
            # the size from the open file: the trainer renaming a new one over it is harmless
            with path.open("rb") as f:
                tar.addfile(tar.gettarinfo(arcname=path.name, fileobj=f), f)
    return True


def unpack(tar_path: Path, folder: Path) -> list[str]:
    """The checkpoint's files from ``tar_path`` into ``folder`` (regular files with the known
    names only; each written then renamed), the names written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(tar_path, "r") as tar:
        for member in tar.getmembers():
            if not member.isfile() or not _MEMBER.fullmatch(member.name):
                continue
            source = tar.extractfile(member)
            if source is None:
                continue
            tmp = folder / f".{member.name}.{uuid.uuid4().hex}.part"
            try:
                with source, tmp.open("wb") as out:
                    while chunk := source.read(storage.CHUNK):
                        out.write(chunk)
                os.replace(tmp, folder / member.name)
            finally:
                tmp.unlink(missing_ok=True)
            written.append(member.name)
    return written


def fetch(
    store: storage.Store, key: str, folder: Path, waits: Iterable[float] = storage.RETRY_WAITS
) -> bool:
    """The store's checkpoint into an empty run ``folder`` (one that has its own checkpoint is
    left as it is: it is this machine's newer or equal run); whether one was fetched. None in
    the store: False. A store that stays down: ``StoreUnavailable`` (after ``waits``)."""
    if (folder / CHECKPOINT).is_file():
        return False
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{OBJECT_NAME}.{uuid.uuid4().hex}.part"
    try:
        storage.retrying(lambda: store.get_to_file(key, tmp), waits)
    except storage.ObjectMissing:
        return False
    try:
        names = unpack(tmp, folder)
    finally:
        tmp.unlink(missing_ok=True)
    if CHECKPOINT not in names:
        return False
    log.info("resuming from the store's checkpoint %s (%s)", key, ", ".join(names))
    return True


PLACED = ("zoo", "data", "test_data", "init_from", "decoded", "out")
"""The run config's fields that name this machine's files (``FinetuneConfig._PATHS``, the
run folder and the decoded copy): the same job's inputs sit elsewhere on another machine."""


def rebase(folder: Path, config: dict[str, Any]) -> None:
    """Place a checkpoint fetched from another machine on this one: its config's file names
    become this delivery's ``config``'s (the same job's zoo entry and dataset, fetched here),
    so the trainer's check that a resume is the same run compares the run's settings, not the
    machines' folders. Written then renamed, as the trainer writes it."""
    import torch  # the worker's training dependency, loaded only to resume

    path = folder / CHECKPOINT
    blob = torch.load(path, map_location="cpu", weights_only=False)
    blob["config"] = {**blob.get("config", {}), **{k: config.get(k) for k in PLACED}}
    tmp = folder / f".{CHECKPOINT}.{uuid.uuid4().hex}.part"
    try:
        torch.save(blob, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Uploader:
    """Puts the run folder's checkpoint in the store each time the trainer replaced it, from a
    thread of its own (see the module's docstring). :meth:`close` stops it; an upload in flight
    is left to finish on its own (the put is atomic), never waited on past ``join_seconds``."""

    def __init__(
        self,
        store: storage.Store,
        key: str,
        folder: Path,
        every: float = WATCH_SECONDS,
        on_put: Callable[[storage.Stored], None] = lambda _: None,
    ) -> None:
        self.store, self.key, self.folder = store, key, folder
        self.every, self.on_put = every, on_put
        self.puts = 0
        self.failures = 0
        self._seen = self._stamp()  # a checkpoint already there (fetched or this run's) is stored
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpoint-upload", daemon=True)

    def start(self) -> Uploader:
        self._thread.start()
        return self

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = (self.folder / CHECKPOINT).stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.check()

    def check(self) -> bool:
        """Put the checkpoint if it changed since the last look; whether one was put."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return False
        self._seen = stamp
        tmp = self.folder / f".{OBJECT_NAME}.{uuid.uuid4().hex}.upload"
        try:
            if not pack(self.folder, tmp):
                return False
            stored = self.store.put_file(self.key, tmp)
        except (storage.StoreError, OSError) as exc:
            self.failures += 1
            log.warning("the run's checkpoint could not be put in the store: %s", exc)
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self.puts += 1
        self.on_put(stored)
        return True

    def close(self, join_seconds: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=join_seconds)
