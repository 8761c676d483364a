"""The rate limiter's store (Redis) down (issue 43): no request is answered 500; the limits
still hold, counted in the API process' memory, and the shared store is used again once it
answers. Real processes throughout: a port on 127.0.0.1 where nothing listens, and a
``redis-server`` of the test's own that is stopped and started again."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time

import pytest
from limits import parse

from tests.service.procs import free_port


@pytest.fixture
def app_without_redis(new_pg_database, tmp_path):
    """The API on PostgreSQL whose broker (and rate store) URL points at a closed port."""
    from zoopick.app.main import create_app
    from zoopick.service.db import migrate
    from zoopick.service.settings import Settings

    db = new_pg_database()
    migrate.upgrade(db)
    settings = Settings(
        data_dir=tmp_path,
        database_url=db,
        broker_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        validate_inline=True,
        sweep_interval_seconds=0,
        rate_uploads="2/minute",
    )
    return create_app(settings)


def test_a_rate_store_that_is_down_never_makes_a_500(app_without_redis, caplog):
    from fastapi.testclient import TestClient

    from zoopick.service.db.session import session_scope
    from zoopick.service.security import create_api_key

    app = app_without_redis
    with session_scope(app.state.sessionmaker) as session:
        _, token = create_api_key(session, tenant="t", name="k")
    auth = {"Authorization": f"Bearer {token}"}
    c = TestClient(app, client=("198.51.100.40", 4000), raise_server_exceptions=False)
    with caplog.at_level(logging.WARNING, logger="zoopick.app.ratelimit"):
        resp = c.get("/api/v1/jobs", headers=auth)
        assert resp.status_code == 200, resp.text
        # the upload limit (2 a minute) still holds, counted in memory
        files = {"file": ("a.npz", b"not an npz", "application/octet-stream")}
        codes = [c.post("/api/v1/datasets", files=files, headers=auth) for _ in range(3)]
        assert [r.status_code for r in codes] == [422, 422, 429], [r.text for r in codes]
        assert int(codes[-1].headers["retry-after"]) >= 1
        assert "ZOOPICK_RATE_UPLOADS" in codes[-1].json()["detail"]
        # and so does the failed-authentication one, which every authenticated request reads
        allowed = parse(app.state.settings.rate_auth_failures).amount
        wrong = [
            c.get("/api/v1/jobs", headers={"Authorization": f"Bearer zp_wrong{i}"}).status_code
            for i in range(allowed + 1)
        ]
        assert wrong == [401] * allowed + [429]
    warnings = [r.getMessage() for r in caplog.records if "rate limits" in r.getMessage()]
    assert len(warnings) == 1 and "failed" in warnings[0], warnings  # once per outage


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_the_shared_store_is_used_again_once_it_answers(tmp_path, monkeypatch):
    import redis

    from zoopick.app import ratelimit
    from zoopick.service.settings import Settings

    monkeypatch.setattr(ratelimit, "STORE_RETRY_SECONDS", 0.2)
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"

    def start() -> subprocess.Popen:
        cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, cwd=tmp_path)
        for _ in range(100):
            try:
                redis.Redis.from_url(url).ping()
                return proc
            except redis.ConnectionError:
                time.sleep(0.05)
        proc.kill()
        raise AssertionError("redis-server did not start")

    def stored() -> list[str]:
        """Who has a counter in the test's Redis."""
        keys = redis.Redis.from_url(url).keys("*zoopick-rate*")
        return sorted(key.decode().split("/")[2] for key in keys)  # .../jobs/<who>/3/1/minute

    settings = Settings(data_dir=tmp_path, broker_url=url, rate_jobs="3/minute")
    limits = ratelimit.RateLimits(settings)
    server = start()
    try:
        limits.check("jobs", "a", "jobs")
        assert stored() == ["a"]
        server.terminate()
        server.wait(10)
        limits.check("jobs", "b", "jobs")  # counted in memory: no error
        server = start()
        time.sleep(0.3)
        limits.check("jobs", "c", "jobs")
        assert stored() == ["c"]  # "a" went with the old server's memory, "b" never was there
    finally:
        server.terminate()
        server.wait(10)
