"""A training run's log, kept in its run folder: what the trainer printed (torchrun's and the
libraries' messages, tracebacks, the epoch lines), for the job page's tail and its download.

Bounded: the current file is rotated once to ``train.log.1`` when it passes ``MAX_BYTES``,
so a run that prints without end holds at most twice that on disk, and the download (both
files, oldest first) is bounded the same way.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

LOG_NAME = "train.log"
MAX_BYTES = 4 << 20
"""Bytes of the current log file before it is rotated (the download is at most twice this)."""
MAX_LINE = 4000
"""Characters kept of one line (a progress bar redrawn without newlines is one long line)."""


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
            fh.seek(max(0, size - (256 << 10)))
            chunk = fh.read().decode("utf-8", errors="replace")
        out.extend(chunk.splitlines()[-lines:])
    return list(out)


def chunks(folder: str | Path, size: int = 64 << 10) -> Iterator[bytes]:
    """The whole log, oldest first, in pieces (for a streamed download)."""
    for path in log_files(folder):
        with path.open("rb") as fh:
            yield from iter(lambda: fh.read(size), b"")
