"""Stopping ``zoopick serve`` stops everything it started: SIGTERM (what systemd, Docker and
``kill`` send, to the server process alone) or SIGINT (Ctrl-C) leaves no process of its local
worker, nor of that worker's pool, running. The local worker runs at a lower CPU priority than
the API (``serve --worker-nice``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.procs import poll, start_serve, wait_http
from zoopick.service.processes import LOCAL_WORKER_NICE


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] != "Z"


def niceness(pid: int) -> tuple[int, int | None]:
    """The nice value of ``pid`` (field 19 of /proc/<pid>/stat) and that of its session's
    scheduling group (Linux autogroup; None without)."""
    nice = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
    group = Path(f"/proc/{pid}/autogroup")
    return nice, int(group.read_text().split()[-1]) if group.exists() else None


def processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of ``/proc/<pid>/stat`` after the command's name: state, parent,
    process group, ...) of every process there is, from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        yield int(entry.name), fields


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (its children, theirs, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for child, fields in processes():
        parents.setdefault(int(fields[1]), []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found and alive(child):
                found.add(child)
                todo.append(child)
    return found


def webhook_consumer(pid: int) -> bool:
    """Whether ``pid`` is serve's consumer of webhook deliveries (its command line consumes
    ``webhooks`` alone; the local worker's pool processes share their worker's)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"--queues" in argv[:-1] and argv[argv.index(b"--queues") + 1] == b"webhooks"


def local_worker(pid: int) -> set[int]:
    """serve's (``pid``) local worker and its pool: its descendants less the webhook
    consumer that runs beside it."""
    return {p for p in descendants(pid) if not webhook_consumer(p)}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stopping_serve_stops_its_worker_and_the_pool(tmp_path, signum):
    data = str(tmp_path / "data")
    serve, port = start_serve(
        tmp_path, "--concurrency", "2", ZOOPICK_DATA_DIR=data, OMP_NUM_THREADS="1"
    )
    started: set[int] = set()
    try:
        # ready once the local worker beats: it runs niced (below), so on a loaded machine
        # its start (torch and timm imports) takes a while; a readiness wait, not a timing
        wait_http(serve, f"http://127.0.0.1:{port}/readyz", timeout=240)
        # the worker's main process and its two pool processes, and the webhook consumer
        poll(
            lambda: local_worker(serve.proc.pid),
            lambda pids: len(pids) >= 3,
            timeout=90,
            what="the local worker and its pool",
        )
        started = descendants(serve.proc.pid)
        assert len(started) >= 4 and any(map(webhook_consumer, started)), started
        # issue 21, item 14: the worker (its pool too) yields the cores to the API, also
        # where the kernel shares them between sessions first (the worker has its own)
        nice = min(19, niceness(serve.proc.pid)[0] + LOCAL_WORKER_NICE)
        group = None if niceness(serve.proc.pid)[1] is None else nice
        assert {niceness(p) for p in started} == {(nice, group)}
        os.kill(serve.proc.pid, signum)  # the server alone, as kill(1) or Docker would
        serve.proc.wait(timeout=90)
        left = poll(
            lambda: {p for p in started if alive(p)},
            lambda pids: not pids,
            timeout=30,
            what="the worker's processes to exit",
        )
        assert left == set()
        # issue 41: a stop is expected; the pool processes' SIGTERM is no error in the log
        log = serve.log.read_text(errors="replace")
        assert "exited with 'signal 15" not in log, log[-3000:]
    finally:  # whatever the outcome, leave nothing running
        started |= descendants(serve.proc.pid)
        serve.stop()
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_restarted_worker_busy_in_its_pool_dies_with_a_killed_serve(tmp_path):
    """Issue 21, item 13: serve restarts its local worker (the first one was killed), the new
    worker's pool process does not return (SIGSTOP: a task that runs for minutes), then
    serve's process group is SIGKILLed. The worker, in a session of its own, gets no signal
    from that kill, and a parent-death signal alone only starts a warm shutdown that waits for
    the pool: the worker must see that serve is gone and take its pool down with it."""
    serve, port = start_serve(
        tmp_path,
        *("--worker-nice", "0"),  # heartbeats timed in seconds (see test_serve_watch)
        *("--concurrency", "1"),
        ZOOPICK_DATA_DIR=str(tmp_path / "data"),
        OMP_NUM_THREADS="1",
        ZOOPICK_HEARTBEAT_SECONDS="0.5",
        ZOOPICK_HEARTBEAT_TIMEOUT_SECONDS="3",  # serve checks its worker every second
    )
    seen: set[int] = set()
    try:
        wait_http(serve, f"http://127.0.0.1:{port}/healthz", timeout=90)
        first = poll(lambda: local_worker(serve.proc.pid), lambda p: len(p) >= 2, 90,
                     what="the local worker and its pool")  # fmt: skip
        seen |= first
        os.kill(min(first), signal.SIGKILL)  # the worker's main process: serve restarts it
        restarted = poll(lambda: local_worker(serve.proc.pid) - first, lambda p: len(p) >= 2,
                         60, what="the restarted worker and its pool")  # fmt: skip
        seen |= restarted
        leader = min(restarted)
        assert os.getpgid(leader) == leader != os.getpgid(serve.proc.pid)
        for pid in restarted - {leader}:
            os.kill(pid, signal.SIGSTOP)
        os.killpg(serve.proc.pid, signal.SIGKILL)
        serve.proc.wait(timeout=30)
        left = poll(lambda: {p for p in seen if alive(p)}, lambda pids: not pids, 20,
                    what="the orphaned worker's processes to exit")  # fmt: skip
        assert left == set()
        assert "is gone: this worker and its pool stop now" in serve.log.read_text()
    finally:
        seen |= descendants(serve.proc.pid)
        serve.stop()
        for pid in seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_only_a_stopping_workers_pool_processes_end_by_sigterm_without_an_error(monkeypatch):
    """The filter behind the log check above: a pool process' SIGTERM is an info line once the
    worker is shutting down (Celery's flag is the exit code, 0); before that, or by another
    signal, it stays an error."""
    import logging

    from celery.worker import state

    from zoopick.workers.lognoise import POOL_LOGGER, StoppedPoolProcess

    def level(how: str) -> int:
        args = ("ForkPoolWorker-1", 7, how)
        record = logging.LogRecord(
            POOL_LOGGER, logging.ERROR, __file__, 1, "Process %r pid:%r exited with %r", args, None
        )
        assert StoppedPoolProcess().filter(record)
        return record.levelno

    monkeypatch.setattr(state, "should_stop", None)
    assert level("signal 15 (SIGTERM)") == logging.ERROR
    monkeypatch.setattr(state, "should_stop", 0)
    assert level("signal 15 (SIGTERM)") == logging.INFO
    assert level("signal 9 (SIGKILL)") == logging.ERROR
