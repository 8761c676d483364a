"""Run the trainer as a subprocess and follow it.

The trainer (``training.launch`` under ``torchrun --standalone``: one process per GPU, or CPU
processes with gloo) runs in its own process session and prints one JSON line per epoch on
stdout; a failing rank prints ``{"error": ..., "rank": r}``. :func:`run` hands each epoch record
to a callback as it arrives, asks ``keep_going()`` between records and at least every
``poll`` seconds (lease renewal, cancellation), and stops the whole process group when told to
or when the task itself is interrupted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FINAL_WEIGHTS = "model.safetensors"
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
STOP_GRACE_SECONDS = 15.0


@dataclass
class Result:
    returncode: int
    stopped: bool = False
    error: str | None = None
    stderr_tail: list[str] = field(default_factory=list)
    records: int = 0


def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """``preexec_fn`` for the trainer: the kernel sends it SIGTERM if the task's process dies
    (a worker killed by its hard time limit or out of memory), so an orphaned trainer cannot
    keep a GPU busy or write into the run a re-queued task resumes. Linux only (None
    elsewhere); ``prctl`` is looked up here, so the forked child only makes the call."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return set_pdeathsig


def spawn(*, zoo: Path, model: str, data: str, out: Path, spec: dict[str, Any]):
    """Start the trainer for one job (the one place the service calls into ``training``):
    ``torchrun --standalone`` as ``training.launch.spawn_local`` starts it, in its own process
    session, and tied to this process' life."""
    from training.finetune import CHECKPOINT, FinetuneConfig
    from training.launch import spawn_local

    cfg = FinetuneConfig(
        zoo=str(zoo),
        model=model,
        data=str(data),
        out=str(out),
        epochs=int(spec.get("epochs", 3)),
        lr=float(spec.get("lr", 0.01)),
        compressor=str(spec.get("compressor", "dense")),
        density=float(spec.get("density", 0.01)),
        resume=(out / CHECKPOINT).exists(),  # a re-delivered task continues the same run
    )
    out.mkdir(parents=True, exist_ok=True)
    workers = int(spec.get("workers", 2))
    # the trainer also dies with its worker (Linux; only a prctl call, fork-safe)
    return spawn_local(cfg, workers, preexec_fn=_die_with_parent(os.getpid()))


def _pump(stream, sink: Callable[[Any], None], eof: bool = False) -> None:
    for line in stream:
        sink(line.rstrip("\n"))
    stream.close()
    if eof:
        sink(None)


def _json(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM the trainer's process group (torchrun and every rank), then SIGKILL whatever
    of the group is left: torchrun past ``grace`` seconds, or a rank that outlived it (one
    that ignored the signal or missed torchrun's own teardown). Nothing keeps running."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    # right after torchrun's exit (or still alive): the group id stays reserved while any
    # member lives, so this reaches our ranks and no stranger
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run(
    start: Callable[[], subprocess.Popen],
    *,
    on_record: Callable[[dict[str, Any]], None],
    keep_going: Callable[[], bool],
    poll: float = 5.0,
) -> Result:
    proc = start()
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
    tail: deque[str] = deque(maxlen=50)
    errors: list[str] = []

    def from_stderr(line: str) -> None:
        if line.strip():
            tail.append(line)
        rec = _json(line)
        if rec and "error" in rec:
            errors.append(f"rank {rec.get('rank', '?')}: {rec['error']}")

    def from_stdout(line: str | None) -> None:
        lines.put(("eof", None) if line is None else ("out", line))

    threads = [
        threading.Thread(target=_pump, args=(proc.stdout, from_stdout, True)),
        threading.Thread(target=_pump, args=(proc.stderr, from_stderr)),
    ]
    for t in threads:
        t.daemon = True
        t.start()

    result = Result(returncode=0)
    last_check = time.monotonic()
    try:
        while True:
            try:
                kind, line = lines.get(timeout=poll)
            except queue.Empty:
                kind, line = "idle", None
            if kind == "eof":  # the trainer closed its stdout: it is exiting
                while proc.poll() is None:
                    try:
                        proc.wait(timeout=poll)
                    except subprocess.TimeoutExpired:
                        if not result.stopped and not keep_going():
                            result.stopped = True
                            stop(proc)
                break
            check = line is None or time.monotonic() - last_check >= poll
            if line is not None:
                rec = _json(line)
                if rec and "error" in rec:
                    errors.append(f"rank {rec.get('rank', '?')}: {rec['error']}")
                elif rec and "epoch" in rec:
                    on_record(rec)
                    result.records += 1
                    check = True  # between epochs
            if check and not result.stopped and proc.poll() is None:
                last_check = time.monotonic()
                if not keep_going():
                    result.stopped = True
                    stop(proc)
    finally:
        stop(proc)  # the task was interrupted (time limit, worker shutdown): take it down
        # the group is gone, so both pipes are at EOF: read them to the end (a failing
        # rank's error line may still be in the stderr pipe behind torchrun's traceback)
        for t in threads:
            t.join(timeout=30)
    result.returncode = proc.returncode if proc.returncode is not None else -1
    result.stderr_tail = list(tail)
    if result.returncode != 0 and not result.stopped:
        result.error = "; ".join(dict.fromkeys(errors)) or (
            " | ".join(list(tail)[-5:]) or f"exit code {result.returncode}"
        )
    return result


def file_digest(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size
