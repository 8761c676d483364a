"""Run the trainer as a subprocess and follow it.

The trainer (``zoopick.training.launch`` under ``torchrun --standalone``: one process per GPU, or
CPU processes with gloo; or the Ray driver of ``zoopick.training.ray_driver``) runs in its own
process session and prints one JSON line per epoch on
stdout and a failing rank an error line on stderr (both read with ``training.config.parse_line``).
:func:`run` hands each epoch record
to a callback as it arrives, asks ``keep_going()`` between records and at least every
``poll`` seconds (lease renewal, cancellation), and stops the whole process group when told to
or when the task itself is interrupted. Run events (started, resumed, the live progress) go to
``on_event``; everything else the trainer prints is kept in the run folder's ``train.log``
(``service.run_log``, bounded) when ``log`` names the folder.

:func:`follow_run` is how a task follows its run (the fine-tune's and each of the race's
rungs): :func:`run` with the database check between records, which renews the task's lease,
notes a lease another task took over, and honours the job's cancel.
"""

from __future__ import annotations

import hashlib
import queue
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy.orm import Session, sessionmaker

from zoopick.service.db.models import Job
from zoopick.service.db.session import session_scope
from zoopick.service.processes import die_with_parent, lowered_priority, stop_group
from zoopick.service.run_log import LogWriter
from zoopick.training.backends import Backend
from zoopick.training.config import (
    EpochRecord,
    FinetuneConfig,
    RunEvent,
    TrainerError,
    parse_line,
)


@dataclass
class Result:
    returncode: int
    stopped: bool = False
    error: str | None = None
    stderr_tail: list[str] = field(default_factory=list)
    records: int = 0
    lease_lost: bool = False
    """Stopped because another task holds the lease now (:func:`follow_run`): the run, its
    rows and its folder are that task's, so this one settles nothing."""


def spawn(cfg: FinetuneConfig, backend: Backend) -> subprocess.Popen[str]:
    """Start one job's run on the deployment's backend (the one place the service calls into
    ``training``): ``torchrun --standalone`` here, or the Ray driver for a cluster, in its own
    process session and tied to this process' life (it gets SIGTERM if this worker dies;
    Linux)."""
    from zoopick.training.backends import spawn as start

    # the trainer's session is as nice as its worker (a local worker of serve yields the
    # cores to the API: zoopick.service.processes.LOCAL_WORKER_NICE)
    return start(cfg, backend, preexec_fn=lowered_priority(0, die_with_parent()))


def _pump(stream, sink: Callable[[Any], None], eof: bool = False) -> None:
    for line in stream:
        sink(line.rstrip("\n"))
    stream.close()
    if eof:
        sink(None)


def run(
    start: Callable[[], subprocess.Popen],
    *,
    on_record: Callable[[EpochRecord], None],
    keep_going: Callable[[], bool],
    on_event: Callable[[RunEvent], None] = lambda _: None,
    poll: float = 5.0,
    log: Path | None = None,
    stop_note: Callable[[], str] = lambda: "stopped by the service",
) -> Result:
    """``log``: the run folder whose ``train.log`` keeps what the trainer prints (progress
    events left out: the database holds where the run is). Once this stops the run, what
    the trainer prints as it goes down (torchrun's traceback of the signal, naming the
    server's paths) is left out of the log, which ends with ``stop_note()`` instead."""
    writer = LogWriter(log) if log is not None else None
    result = Result(returncode=0)
    proc = start()
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
    tail: deque[str] = deque(maxlen=50)
    errors: list[str] = []

    def from_stderr(line: str) -> None:
        if writer is not None and not result.stopped:
            writer.write("stderr", line)
        if line.strip():
            tail.append(line)
        rec = parse_line(line)
        if isinstance(rec, TrainerError):
            errors.append(rec.describe())

    def from_stdout(line: str | None) -> None:
        lines.put(("eof", None) if line is None else ("out", line))

    threads = [
        threading.Thread(target=_pump, args=(proc.stdout, from_stdout, True)),
        threading.Thread(target=_pump, args=(proc.stderr, from_stderr)),
    ]
    for t in threads:
        t.daemon = True
        t.start()

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
                            stop_group(proc)
                break
            check = line is None or time.monotonic() - last_check >= poll
            if line is not None:
                rec = parse_line(line)
                if (
                    writer is not None
                    and not result.stopped
                    and not (isinstance(rec, RunEvent) and rec.event == "progress")
                ):
                    writer.write("stdout", line)
                if isinstance(rec, TrainerError):
                    errors.append(rec.describe())
                elif isinstance(rec, EpochRecord):
                    on_record(rec)
                    result.records += 1
                    check = True  # between epochs
                elif isinstance(rec, RunEvent):
                    on_event(rec)
            if check and not result.stopped and proc.poll() is None:
                last_check = time.monotonic()
                if not keep_going():
                    result.stopped = True
                    stop_group(proc)
    finally:
        stop_group(proc)  # the task was interrupted (time limit, worker shutdown): take it down
        # the group is gone, so both pipes are at EOF: read them to the end (a failing
        # rank's error line may still be in the stderr pipe behind torchrun's traceback)
        for t in threads:
            t.join(timeout=30)
        if writer is not None:
            if result.stopped:
                writer.write("zoopick", stop_note())
            writer.close()
    result.returncode = proc.returncode if proc.returncode is not None else -1
    result.stderr_tail = list(tail)
    if result.returncode != 0 and not result.stopped:
        result.error = "; ".join(dict.fromkeys(errors)) or (
            " | ".join(list(tail)[-5:]) or f"exit code {result.returncode}"
        )
    return result


CANCELLED_NOTE = "cancelled: the run was stopped at the job's cancel request"
LEASE_LOST_NOTE = "stopped: another task took this run over (its lease was lost)"


def follow_run(
    start: Callable[[], subprocess.Popen],
    sessions: sessionmaker[Session],
    job_id: uuid.UUID,
    *,
    renew: Callable[[Session], bool],
    on_time_limit: Callable[[Session], None],
    on_record: Callable[[EpochRecord], None],
    on_event: Callable[[RunEvent], None] = lambda _: None,
    poll: float = 5.0,
    log: Path | None = None,
) -> Result:
    """Run a task's trainer (:func:`run`) and, between records and at least every ``poll``
    seconds, keep it going only while ``renew(session)`` renews the task's lease (False: a
    sweeper gave the work to a new task, so the run stops with ``lease_lost``) and the job is
    there without a cancel requested (it stops with ``stopped``). The task's soft time limit
    stops the run and ``on_time_limit(session)`` records it before the exception goes on."""
    lost: list[bool] = []

    def keep_going() -> bool:
        """Heartbeat between epochs/polls: renew the lease, honour a cancel."""
        with session_scope(sessions) as session:
            if not renew(session):
                lost.append(True)  # a sweeper gave the work to a new task
                return False
            job = session.get(Job, job_id)
            return job is not None and not job.cancel_requested

    try:
        result = run(
            start, on_record=on_record, keep_going=keep_going, on_event=on_event, poll=poll,
            log=log, stop_note=lambda: LEASE_LOST_NOTE if lost else CANCELLED_NOTE,
        )  # fmt: skip
    except SoftTimeLimitExceeded:
        with session_scope(sessions) as session:
            on_time_limit(session)
        raise
    result.lease_lost = result.stopped and bool(lost)
    return result


def file_digest(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size
