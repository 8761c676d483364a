"""A training run's log, kept in its run folder: what the trainer printed (torchrun's and the
libraries' messages, tracebacks, the epoch lines), for the job page's tail and its download.

Bounded: the current file is rotated once to ``train.log.1`` when it passes ``MAX_BYTES``,
so a run that prints without end holds at most twice that on disk, and the download (both
files, oldest first) is bounded the same way.

The run folder is the training machine's own (its ``ZOOPICK_DATA_DIR``), so the worker also
puts the log in the store (:func:`push`: both files as one object, ``stored_key``), during the
run every ``PUSH_SECONDS`` and once at its end; :func:`for_run` reads the run folder where this
machine has it and the store's copy elsewhere (an API on another machine).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from zoopick.service import storage

log = logging.getLogger(__name__)

LOG_NAME = "train.log"
MAX_BYTES = 4 << 20
"""Bytes of the current log file before it is rotated (the download is at most twice this)."""
MAX_LINE = 4000
"""Characters kept of one line (a progress bar redrawn without newlines is one long line)."""
PUSH_SECONDS = 30.0
"""How often a running fine-tune's log is put in the store (and once more at its end)."""
TAIL_BYTES = 256 << 10
"""Bytes read from a log's end for its tail."""


class LogWriter:
    """Appends lines from the trainer's two pipes (two threads) to the run's log."""

    def __init__(self, folder: Path, max_bytes: int = MAX_BYTES) -> None:
        self.path = folder / LOG_NAME
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8", errors="replace")

    def write(self, stream: str, line: str) -> None:
        text = f"[{stream}] {line[:MAX_LINE]}\n"
        with self._lock:
            if self._fh.closed:
                return
            self._fh.write(text)
            self._fh.flush()
            if self._fh.tell() > self.max_bytes:
                self._fh.close()
                self.path.replace(self.path.with_name(LOG_NAME + ".1"))
                self._fh = self.path.open("a", encoding="utf-8", errors="replace")

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def log_files(folder: str | Path) -> list[Path]:
    """The run's log files that exist, oldest first."""
    base = Path(folder)
    return [p for p in (base / (LOG_NAME + ".1"), base / LOG_NAME) if p.is_file()]


def tail(folder: str | Path, lines: int = 40) -> list[str]:
    """The last ``lines`` lines of the run's log (reading at most 256 KiB of it)."""
    out: deque[str] = deque(maxlen=lines)
    for path in log_files(folder):
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - TAIL_BYTES))
            chunk = fh.read().decode("utf-8", errors="replace")
        out.extend(chunk.splitlines()[-lines:])
    return list(out)


def chunks(folder: str | Path, size: int = 64 << 10) -> Iterator[bytes]:
    """The whole log, oldest first, in pieces (for a streamed download)."""
    for path in log_files(folder):
        with path.open("rb") as fh:
            yield from iter(lambda: fh.read(size), b"")


def stored_key(tenant_id: uuid.UUID, job_id: uuid.UUID) -> str:
    """The key of a job's training log in the store (under the job's prefix, so deleting the
    job deletes it)."""
    return storage.tenant_key(tenant_id, "jobs", str(job_id), "train", LOG_NAME)


def push(store: storage.Store, key: str, folder: str | Path) -> bool:
    """Put the run's log (both files, oldest first: at most twice ``MAX_BYTES``) in the store
    under ``key``, replacing the copy there. Tried once: a store that fails costs this copy
    only (logged), never the run; the next push or the end's brings it up to date."""
    if not log_files(folder):
        return False
    try:
        store.put(key, chunks(folder))
    except storage.StoreError as exc:
        log.warning("the training log could not be put in the store: %s", exc)
        return False
    return True


def restore(store: storage.Store, key: str, folder: str | Path) -> bool:
    """The store's copy of the log into a run folder that has none (a run resumed on another
    machine: its log goes on from the lost run's instead of starting again, and the next push
    keeps both). Tried once: a failure costs the earlier lines here (logged), never the run."""
    if log_files(folder):
        return False
    try:
        store.get_to_file(key, Path(folder) / LOG_NAME)
    except storage.ObjectMissing:
        return False
    except storage.StoreError as exc:
        log.warning("the training log could not be fetched from the store: %s", exc)
        return False
    return True


class Pusher:
    """:func:`push` at most every ``every`` seconds (called from a run's follow loop)."""

    def __init__(self, store: storage.Store, key: str, folder: Path, every: float = PUSH_SECONDS):
        self.store, self.key, self.folder, self.every = store, key, folder, every
        self._last = time.monotonic()

    def maybe(self) -> None:
        if time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            push(self.store, self.key, self.folder)

    def final(self) -> None:
        push(self.store, self.key, self.folder)


@dataclass(frozen=True)
class RunLog:
    """A run's log as the API reads it: the run folder's files on this machine, else the
    store's copy. ``exists`` is False for neither."""

    folder: Path
    store: storage.Store
    key: str

    @property
    def local(self) -> bool:
        return bool(log_files(self.folder))

    @property
    def exists(self) -> bool:
        return self.local or self.store.size(self.key) is not None

    def tail(self, lines: int = 40) -> list[str]:
        if self.local:
            return tail(self.folder, lines)
        size = self.store.size(self.key)
        if size is None:
            return []
        data = b"".join(self.store.get(self.key))[-TAIL_BYTES:]
        return data.decode("utf-8", errors="replace").splitlines()[-lines:]

    def chunks(self) -> Iterator[bytes]:
        return chunks(self.folder) if self.local else self.store.get(self.key)


def for_run(
    folder: str | Path, store: storage.Store, tenant_id: uuid.UUID, job_id: uuid.UUID
) -> RunLog:
    return RunLog(Path(folder), store, stored_key(tenant_id, job_id))
