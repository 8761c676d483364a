"""A real ``mlflow server`` for ``test_mlflow.py``: 127.0.0.1 on a free port, a SQLite
backend store and a local artifact folder under the session's temporary folder.

Its start (MLflow's imports and database migrations: 6 to 20 s on this machine) would be the
dearest part of that module, so when a test that needs it was collected, the shared live
stack's fixture (``conftest.live_server``: no stack of its own) starts it first and starts the
stack with its URI; it gets ready while the stack starts and the stack's other tests run, the
module's tests wait for it (``take``), and ``pytest_sessionfinish`` stops it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.service.procs import Proc, free_port

USERS = ("test_mlflow.py",)
"""Test modules whose tests use the server through the ``mlflow_stack`` fixture: when one of
those tests was collected, the shared live stack (``conftest.live_server``) starts the server
and logs its jobs there."""


def wanted(items: list[pytest.Item]) -> bool:
    return any(
        item.path.name in USERS and "mlflow_stack" in getattr(item, "fixturenames", ())
        for item in items
    )


@dataclass
class Server:
    proc: Proc
    uri: str
    root: Path


def missing() -> str | None:
    """Why the server cannot run here, or None."""
    if importlib.util.find_spec("mlflow") is None:
        return "the mlflow extra (zoopick[mlflow]) is not installed"
    if importlib.util.find_spec("flask") is None:
        return "the full mlflow package (the dev extra) runs the tracking server"
    return None


def start(root: Path) -> Server:
    """``mlflow server`` as a user runs it (job execution off: its seven queue consumers
    would only compete for the machine's cores)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", str(root / "artifacts"), "--workers", "1"]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return Server(Proc("mlflow", cmd, env, root), f"http://127.0.0.1:{port}", root)


def start_early(config: pytest.Config) -> None:
    if getattr(config, "_mlflow_server", None) is None and missing() is None:
        root = config._tmp_path_factory.mktemp("mlflow-server")  # type: ignore[attr-defined]
        config._mlflow_server = start(root)  # type: ignore[attr-defined]


def settings(config: pytest.Config) -> dict[str, object]:
    """The live stack's MLflow settings: the session's server when one was started, with
    short retries (a job that ends before the server is up is retried once, then given up);
    none otherwise."""
    server = getattr(config, "_mlflow_server", None)
    if server is None:
        return {}
    return {
        "mlflow_tracking_uri": server.uri,
        "mlflow_timeout_seconds": 5,
        "mlflow_max_attempts": 2,
        "mlflow_backoff_seconds": 0.5,
    }


def take(config: pytest.Config) -> Server:
    """The session's server, ready."""
    from tests.service.procs import wait_http

    reason = missing()
    if reason:
        pytest.skip(reason)
    start_early(config)
    server = config._mlflow_server  # type: ignore[attr-defined]
    wait_http(server.proc, server.uri + "/health", timeout=90)
    return server


def stop(config: pytest.Config) -> None:
    server = getattr(config, "_mlflow_server", None)
    if server is not None:
        server.proc.stop()
