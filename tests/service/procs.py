"""Start the real service processes for end-to-end tests: uvicorn, celery workers, serve."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from zoopick.service.queue import worker_argv
from zoopick.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE = "from zoopick.service_cli import service_app; service_app()"
"""``zoopick serve`` from this checkout, as a child's ``python -c``."""


def start_serve(log_dir: Path, *args: str, **env: str) -> tuple[Proc, int]:
    """``zoopick serve --no-demo`` on a free port with ``args``, logging to ``log_dir``, and
    that port. Its environment is this process' less every ``ZOOPICK_*`` variable (the test's
    own settings), plus ``env`` (its ``ZOOPICK_DATA_DIR`` and whatever the test sets)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ZOOPICK_")}
    port = free_port()
    cmd = [sys.executable, "-c", SERVE, "serve", "--port", str(port), "--no-demo", *args]
    return Proc("serve", cmd, clean | env, log_dir), port


def env_for(settings: Settings, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ``settings.env()`` (every setting) plus ``extra`` values (a
    child that must differ from the test's own settings, e.g. a worker with another queue's
    limits)."""
    env = settings.env()
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    env.update(extra or {})
    return env


class Proc:
    """A child process in its own session, logging to a file; stopped with SIGTERM (then
    SIGKILL) on the whole group."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self._fh = self.log.open("wb")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=ROOT,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._fh.close()


def on_machine(settings: Settings, folder: Path) -> Settings:
    """``settings`` as a process on another machine has them: the same database, broker, key
    prefix and store, but its own data folder (and the storage and cache folders under it)."""
    local = {"data_dir", "storage_dir", "cache_dir"}
    same = {k: getattr(settings, k) for k in type(settings).model_fields if k not in local}
    return type(settings)(**same, data_dir=folder)


def start_worker(
    settings: Settings, queues: str, log_dir: Path, extra: dict[str, str] | None = None
) -> Proc:
    cmd = worker_argv(queues, 1, "prefork", "info") + ["--without-heartbeat"]
    return Proc(f"worker-{queues.replace(',', '-')}", cmd, env_for(settings, extra), log_dir)


def wait_worker_ready(worker: Proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not worker.alive():
            raise AssertionError(f"{worker.name} exited:\n{worker.tail()}")
        if "ready." in worker.log.read_text(errors="replace"):
            return
        time.sleep(0.3)
    raise AssertionError(f"{worker.name} not ready after {timeout}s:\n{worker.tail()}")


def start_api(
    settings: Settings, log_dir: Path, extra: dict[str, str] | None = None
) -> tuple[Proc, str]:
    """A uvicorn on a free port, up. The port is free when chosen, but another process may
    take it before uvicorn binds (an outgoing connection's ephemeral port: seen once in a
    full run): then the API starts again on another port, at most three times (the third
    try's failure, whatever it is, is the caller's)."""
    for _ in range(2):
        try:
            return _start_api_on(free_port(), settings, log_dir, extra)
        except AssertionError as exc:
            if "address already in use" not in str(exc):
                raise
    return _start_api_on(free_port(), settings, log_dir, extra)


def _start_api_on(
    port: int, settings: Settings, log_dir: Path, extra: dict[str, str] | None
) -> tuple[Proc, str]:
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "zoopick.app.main:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--http",  # the request-head caps zoopick serve runs with
        "zoopick.app.httpcaps:AutoProtocol",
    ]
    proc = Proc("api", cmd, env_for(settings, extra), log_dir)
    url = f"http://127.0.0.1:{port}"
    wait_http(proc, url + "/healthz")
    return proc, url


@contextmanager
def api_and_worker(
    settings: Settings,
    queues: str,
    token: str,
    extra: dict[str, str] | None = None,
    *,
    prefix: str = "",
) -> Iterator[tuple[httpx.Client, Proc]]:
    """A uvicorn and a ready Celery worker on ``queues`` (both with ``extra`` settings), and a
    client of ``base URL + prefix`` holding ``token``; both processes stop on exit."""
    worker = start_worker(settings, queues, settings.data_dir, extra)
    api, base = start_api(settings, settings.data_dir, extra)
    try:
        wait_worker_ready(worker)
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=base + prefix, headers=headers, timeout=60) as http:
            yield http, worker
    finally:
        api.stop()
        worker.stop()


def wait_http(proc: Proc, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not up after {timeout}s:\n{proc.tail()}")


def poll(fn, until, timeout: float, interval: float = 0.3, what: str = "condition"):
    """Call ``fn`` until ``until(value)``; returns the value (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout
    value = fn()
    while not until(value):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last value: {value}")
        time.sleep(interval)
        value = fn()
    return value


def rank_the_whole_zoo(http: httpx.Client, metric: str) -> dict:
    """Upload a small dataset to the service behind ``http``, wait for it to be ready, rank
    every zoo model on it by ``metric`` alone and wait for the job to end; the job."""
    from tests.service.datafiles import npz_bytes

    resp = http.post("/datasets", files={"file": ("d.npz", npz_bytes(), "x")})
    ds = resp.json()["id"]
    poll(lambda: http.get(f"/datasets/{ds}").json()["status"], lambda s: s == "ready", 60,
         what="dataset")  # fmt: skip
    body = {"dataset_id": ds, "models": "all", "metrics": [metric], "select_by": metric}
    resp = http.post("/jobs", json=body)
    assert resp.status_code == 202, resp.text
    return poll(
        lambda: http.get(f"/jobs/{resp.json()['id']}").json(),
        lambda j: j["status"] in ("succeeded", "failed"),
        120,
        what="the job",
    )


def create_token(settings: Settings, tenant: str, *, admin: bool = False) -> str:
    """A new API key for ``tenant`` in the database of ``settings``."""
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
    from zoopick.service.security import create_api_key

    engine = make_engine(settings.database_url)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            _, token = create_api_key(session, tenant=tenant, name=f"{tenant}-key", admin=admin)
    finally:
        engine.dispose()
    return token


@contextmanager
def dashboard_client(base: str, token: str) -> Iterator[httpx.Client]:
    """An HTTP client signed in to the dashboard of ``base`` with the API key ``token``, the
    way a browser does it (the login form with its CSRF token): the session cookie is the
    server's signed one, never the key."""
    import re

    with httpx.Client(base_url=base) as client:
        page = client.get("/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
        resp = client.post("/login", data={"api_key": token, "csrf": csrf, "next": "/jobs"})
        assert resp.status_code == 303, f"dashboard sign-in failed: {resp.status_code}"
        yield client


def deliveries(factory, key: str) -> int:
    """How many times the task keyed ``key`` (e.g. ``validate:<dataset id>``) was delivered
    to a worker, from the database's count."""
    from zoopick.service.db.models import TaskDelivery

    with factory() as session:
        row = session.get(TaskDelivery, key)
        return row.count if row is not None else 0
