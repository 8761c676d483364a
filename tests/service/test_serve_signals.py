"""Stopping ``zoopick serve`` stops everything it started: SIGTERM (what systemd, Docker and
``kill`` send, to the server process alone) or SIGINT (Ctrl-C) leaves no process of its local
worker, nor of that worker's pool, running."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tests.service.procs import Proc, free_port, poll, wait_http

SERVE = "from zoopick.service_cli import service_app; service_app()"


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (its children, theirs, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found and alive(child):
                found.add(child)
                todo.append(child)
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stopping_serve_stops_its_worker_and_the_pool(tmp_path, signum):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZOOPICK_")}
    env.update(ZOOPICK_DATA_DIR=str(tmp_path / "data"), OMP_NUM_THREADS="1")
    port = free_port()
    cmd = [sys.executable, "-c", SERVE, "serve", "--port", str(port), "--no-demo"]
    serve = Proc("serve", cmd + ["--concurrency", "2"], env, tmp_path)
    started: set[int] = set()
    try:
        wait_http(serve, f"http://127.0.0.1:{port}/readyz", timeout=90)
        # the worker's main process and its two pool processes
        started = poll(
            lambda: descendants(serve.proc.pid),
            lambda pids: len(pids) >= 3,
            timeout=90,
            what="the local worker and its pool",
        )
        os.kill(serve.proc.pid, signum)  # the server alone, as kill(1) or Docker would
        serve.proc.wait(timeout=90)
        left = poll(
            lambda: {p for p in started if alive(p)},
            lambda pids: not pids,
            timeout=30,
            what="the worker's processes to exit",
        )
        assert left == set()
    finally:  # whatever the outcome, leave nothing running
        started |= descendants(serve.proc.pid)
        serve.stop()
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
