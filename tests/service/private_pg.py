"""A PostgreSQL server of a test's (or a benchmark's) own, which it may stop and start again.

The machine's PostgreSQL serves everything else (other benchmarks, the rest of the suite), so
a database outage (``tests/service/test_faults.py``, the fault benchmark's
``database-stopped-scoring``) is never made by stopping it: this runs ``initdb`` into a temporary
folder and ``pg_ctl`` on a free port of 127.0.0.1 with trust authentication. The server's
binaries are Debian's (``/usr/lib/postgresql/<version>/bin``); PostgreSQL refuses to run as
root, so as root they run as the ``postgres`` user (``runuser``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.service.procs import free_port


def available() -> str | None:
    """None when a private server can be made here, else why not (a test skips with it)."""
    try:
        _bin()
    except RuntimeError as exc:
        return str(exc)
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root, and no postgres user to run the server as"
    return None


def _bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not found:
        raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
    return found[-1].parent


class PrivateCluster:
    """``start()``, ``stop()`` (a fast shutdown: sessions are ended, as an operator's stop
    does), ``url`` (its ``postgres`` database, for creating the deployment's), ``remove()``."""

    def __init__(self) -> None:
        self.bin = _bin()
        self.root = Path(tempfile.mkdtemp(prefix="zoopick-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as_root = os.geteuid() == 0
        if self._as_root:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bin / tool), *args]
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed: {done.stderr.strip() or done.stdout.strip()}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        log = str(self.root / "server.log")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", log, "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError):  # not running
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
