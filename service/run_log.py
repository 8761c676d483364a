"""A training run's log, kept in its run folder: what the trainer printed (torchrun's and the
libraries' messages, tracebacks, the epoch lines), for the job page's tail and its download.

Bounded: the current file is rotated once to ``train.log.1`` when it passes ``MAX_BYTES``,
so a run that prints without end holds at most twice that on disk, and the download (both
files, oldest first) is bounded the same way.

The run folder is the training machine's own (its ``ZOOPICK_DATA_DIR``), so the worker also
puts the log in the store (:func:`push`: both files as one object, ``stored_key``), during the
run every ``PUSH_SECONDS`` and after each checkpoint stored, and once at its end (one push at a
time: :class:`Pusher`); :func:`for_run` reads the run folder where this
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
    under ``key``, replacing the copy there. Tried once: a store that fails, or a log file
    rotated away while it is read, costs this copy only (logged), never the run; the next
    push or the end's brings it up to date."""
    if not log_files(folder):
        return False
    try:
        store.put(key, chunks(folder))
    except (storage.StoreError, OSError) as exc:
        log.warning("the training log could not be put in the store: %s", exc)
        return False
    return True


def restore(store: storage.Store, key: str, folder: str | Path) -> bool:
    """The store's copy of the log into the run folder of a run that continues from the
    store's checkpoint (a run lost on another machine, resumed here: call it after that
    checkpoint was fetched): its log goes on from the lost run's instead of starting again,
    and the next push keeps both. Whether the store had one.

    The store's log is the history that checkpoint came from; the folder's own lines have no
    checkpoint behind them (a checkpoint here would have been resumed instead) and are older:
    that run's pushed part begins the store's log (the other machine restored it), and the
    rest were lost with it. So the log becomes the folder's lines, then the store's after the
    lines both begin with (:func:`_joined`): every line once, in the order they were written.
    Tried once: a failure costs the earlier lines here (logged), never the run."""
    try:
        stored = b"".join(store.get(key))
    except storage.ObjectMissing:
        return False
    except storage.StoreError as exc:
        log.warning("the training log could not be fetched from the store: %s", exc)
        return False
    _write_log(Path(folder), _joined(b"".join(chunks(folder)), stored))
    return True


def _joined(older: bytes, newer: bytes) -> bytes:
    """``older``, then ``newer`` after the whole lines it begins with in common with ``older``
    (a log pushed and restored elsewhere begins with the lines pushed). Lines are told apart
    by their text only: two runs that began with the very same lines show them once."""
    common = 0
    for a, b in zip(_lines(older), _lines(newer), strict=False):
        if a != b:
            break
        common += len(a)
    if older and not older.endswith(b"\n"):
        older += b"\n"  # a line cut short by the lost run: the next begins its own
    return older + newer[common:]


def _lines(data: bytes) -> list[bytes]:
    """``data``'s whole lines, each with its ``\\n`` (a ``\\r`` of a progress bar is no end)."""
    return [line + b"\n" for line in data.split(b"\n")[:-1]]


def _write_log(folder: Path, data: bytes) -> None:
    """``data`` as the run's log files, as a :class:`LogWriter` leaves them: at most
    ``MAX_BYTES`` (whole lines) in the current file, the older rest in the rotated one, and
    the oldest lines past twice that left out. Each written then renamed; called before the
    run's writer opens the log."""
    if len(data) > 2 * MAX_BYTES:
        data = data[data.find(b"\n", len(data) - 2 * MAX_BYTES - 1) + 1 :]
    cut = max(0, len(data) - MAX_BYTES)
    if cut:
        cut = data.find(b"\n", cut - 1) + 1 or len(data)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in ((LOG_NAME + ".1", data[:cut]), (LOG_NAME, data[cut:])):
        path = folder / name
        if name != LOG_NAME and not part:
            path.unlink(missing_ok=True)
            continue
        tmp = folder / f".{name}.{uuid.uuid4().hex}.part"
        try:
            tmp.write_bytes(part)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)


FINAL_WAIT_SECONDS = 10.0
"""How long a run's final push waits for a push of its log in flight (then it is left to the
thread in flight: see :class:`Pusher`)."""


class Pusher:
    """Pushes one run's log: :meth:`maybe` at most every ``every`` seconds (the follow loop),
    :meth:`now` (after each checkpoint stored, from the uploader's thread), :meth:`final` at
    the run's end.

    Pushes of the log never overlap. Each replaces the whole object, so two at once could
    land in either order, and one that read the log before the run's last lines, landing
    after the final push, would cut them from the store's copy. Rather than stamp each push
    and make the store refuse an older one (no conditional put is common to S3 and the
    folder store), a push asked while another is in flight is never started beside it: the
    thread in flight pushes once more when its push is done, reading the log then. So the
    last push to land is always the last to read the log, and no thread waits on another's
    push, except :meth:`final`, at most ``final_wait`` seconds (a store that hangs delays the
    end of the run by that, never more; the push still lands after, from the thread in
    flight). Once :meth:`final` is asked, later asks are skipped: the run's log is complete.
    """

    def __init__(
        self,
        store: storage.Store,
        key: str,
        folder: Path,
        every: float = PUSH_SECONDS,
        final_wait: float = FINAL_WAIT_SECONDS,
    ) -> None:
        self.store, self.key, self.folder = store, key, folder
        self.every, self.final_wait = every, final_wait
        self._last = time.monotonic()
        self._cond = threading.Condition()
        self._asked = 0  # pushes asked so far
        self._read = 0  # the asks covered by the last push that ended (it read the log after)
        self._busy = False  # a thread is pushing
        self._ended = False  # final() was asked

    def maybe(self) -> None:
        if time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            self.now()

    def now(self) -> None:
        """Push the log now, or leave it to the push in flight (see the class's docstring)."""
        self._ask(ending=False)

    def final(self) -> bool:
        """The run's last push; whether it was done within ``final_wait`` seconds (if not, the
        thread whose push was in flight does it when that one ends)."""
        ticket = self._ask(ending=True)
        with self._cond:
            done = self._cond.wait_for(lambda: self._read >= ticket, timeout=self.final_wait)
        if not done:
            log.warning("the training log's final push waits for a push in flight: it lands "
                        "in the store after that one")  # fmt: skip
        return done

    def _ask(self, ending: bool) -> int:
        """Register a push (its ticket: the number of asks so far) and, unless a push is in
        flight, push until every ask is covered."""
        with self._cond:
            if self._ended:
                return self._asked
            if ending:
                self._ended = True
            self._asked += 1
            ticket = self._asked
            if self._busy:
                return ticket  # the thread in flight pushes again when its push ends
            self._busy = True
        try:
            while True:
                with self._cond:
                    covers = self._asked  # every ask so far: this push reads the log after it
                push(self.store, self.key, self.folder)
                with self._cond:
                    self._read = covers
                    self._cond.notify_all()
                    if self._asked == covers:
                        self._busy = False
                        return ticket
        except BaseException:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            raise


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
