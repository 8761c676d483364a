"""A database or broker outage (issue 43): every API operation answers 503 with Retry-After
and a problem body naming the dependency, never a 500; ``/readyz`` names it; the dashboard
shows a page saying the service is unavailable; once the dependency is back, requests work
again. The outage is real as the API sees it: its PostgreSQL and its Redis are reached through
forwarders the test cuts (``tests/service/tcpcut``), so connections in the pool are reset and
new ones refused, without stopping the servers other tests share."""

from __future__ import annotations

import re
import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from tests.service.datafiles import npz_bytes
from tests.service.tcpcut import CuttableLink


def _linked(url: str) -> tuple[CuttableLink, str]:
    """A forwarder to ``url``'s server and ``url`` pointed at it."""
    parsed = make_url(url)
    link = CuttableLink(parsed.host or "127.0.0.1", parsed.port or 5432)
    return link, parsed.set(host="127.0.0.1", port=link.port).render_as_string(False)


@pytest.fixture(scope="module")
def outage_app(pg_url, redis_url, tmp_path_factory):
    """The API on the session's database and Redis, each reached through a link to cut."""
    from zoopick.app.main import create_app
    from zoopick.service.settings import Settings

    db_link, db_url = _linked(pg_url)
    redis_link, broker = _linked(redis_url[0])
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("outage"),
        database_url=db_url,
        broker_url=broker,
        sweep_interval_seconds=0,
        db_pool_timeout_seconds=2,
        retry_after_seconds=3,
    )
    app = create_app(settings)
    yield app, db_link, redis_link
    db_link.cut()
    redis_link.cut()
    app.state.engine.dispose()


def _operations(app) -> list[tuple[str, str]]:
    """Every API operation (method, path with its parameters filled in), from the OpenAPI
    document: a route added later is covered without editing this test."""
    ops = []
    for path, item in app.openapi()["paths"].items():
        if not path.startswith("/api/"):
            continue
        filled = re.sub(r"\{[^}]+\}", lambda _: str(uuid.uuid4()), path)
        ops += [(method.upper(), filled) for method in item if method != "parameters"]
    return ops


SHAPE_REFUSALS = (415, 422)
"""What an operation sent without its body answers before it reads the database."""


def _assert_outage(resp, dependency: str) -> None:
    assert resp.status_code == 503, (resp.request.method, resp.request.url, resp.text)
    assert resp.headers["retry-after"] == "3"
    assert resp.headers["content-type"].startswith("application/problem+json")
    body = resp.json()
    assert body["type"] == f"urn:zoopick:problem:{dependency}-unavailable", body
    assert body["dependency"] == dependency


def test_a_database_outage_answers_503_everywhere_and_recovers(outage_app, caplog):
    from zoopick.app import outage
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import create_api_key

    app, db_link, _ = outage_app
    with session_scope(app.state.sessionmaker) as session:
        _, token = create_api_key(session, tenant=f"outage-{uuid.uuid4()}", name="k", admin=True)
    auth = {"Authorization": f"Bearer {token}"}
    c = TestClient(app, raise_server_exceptions=False, follow_redirects=False)
    browser = TestClient(app, raise_server_exceptions=False, follow_redirects=False)
    page = browser.get("/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    signed = browser.post("/login", data={"api_key": token, "csrf": csrf, "next": "/jobs"})
    assert signed.status_code == 303, signed.text
    assert c.get("/api/v1/jobs", headers=auth).status_code == 200  # a pooled connection

    outage._logged.clear()
    caplog.set_level("WARNING", logger=outage.__name__)
    db_link.cut()
    ops = _operations(app)
    assert len(ops) > 15, ops
    answers = {(m, p): c.request(m, p, headers=auth) for m, p in ops}
    for resp in answers.values():
        if resp.status_code in SHAPE_REFUSALS:  # refused before any database use
            continue
        _assert_outage(resp, "database")
    assert sum(r.status_code == 503 for r in answers.values()) > 15, answers
    said = [r.getMessage() for r in caplog.records if r.name == outage.__name__]
    assert len(said) == 1 and said[0].startswith("database unavailable on "), said  # not 15
    files = {"file": ("a.npz", b"not an npz", "application/octet-stream")}
    _assert_outage(c.post("/api/v1/datasets", files=files, headers=auth), "database")
    _assert_outage(c.get("/metrics", headers=auth), "database")
    ready = c.get("/readyz")
    assert ready.status_code == 503 and ready.headers["retry-after"] == "3"
    assert ready.json()["checks"]["database"].startswith("database unreachable")
    assert ready.json()["checks"]["broker"] == "ok"
    for url in ("/jobs", "/datasets", "/zoo"):
        html = browser.get(url)
        assert html.status_code == 503 and html.headers["retry-after"] == "3", html.text
        assert "Service unavailable" in html.text and "database" in html.text

    db_link.restore()  # the pool's dead connections are replaced (pre-ping): nothing to do
    assert c.get("/api/v1/jobs", headers=auth).status_code == 200
    assert browser.get("/jobs").status_code == 200


def test_an_outage_is_logged_once_a_period_with_the_count_answered_since(monkeypatch, caplog):
    import time

    from zoopick.app import outage

    monkeypatch.setattr(outage, "LOG_EVERY_SECONDS", 0.2)
    monkeypatch.setattr(outage, "_logged", {})
    caplog.set_level("WARNING", logger=outage.__name__)
    for _ in range(3):
        outage._log_outage("broker", "GET /api/v1/jobs", "OperationalError")
    time.sleep(0.25)
    outage._log_outage("broker", "GET /api/v1/zoo", "OperationalError")
    said = [r.getMessage() for r in caplog.records if r.name == outage.__name__]
    assert said == [
        "broker unavailable on GET /api/v1/jobs: OperationalError",
        "broker unavailable on GET /api/v1/zoo: OperationalError (2 more requests answered "
        "503 since the last line)",
    ]


def test_a_broker_outage_answers_503_naming_the_broker(outage_app):
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import create_api_key

    app, _, redis_link = outage_app
    with session_scope(app.state.sessionmaker) as session:
        _, token = create_api_key(session, tenant=f"outage-{uuid.uuid4()}", name="k")
    auth = {"Authorization": f"Bearer {token}"}
    c = TestClient(app, raise_server_exceptions=False)
    redis_link.cut()
    ready = c.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["checks"]["database"] == "ok"
    assert ready.json()["checks"]["broker"].startswith("broker unreachable")
    assert c.get("/api/v1/jobs", headers=auth).status_code == 200  # the database answers
    files = {"file": ("d.npz", npz_bytes(), "application/octet-stream")}
    queued = c.post("/api/v1/datasets", files=files, headers=auth)  # validation is queued
    assert queued.status_code == 503, queued.text
    assert queued.headers["retry-after"] == "3"
    assert queued.json()["dependency"] == "broker"
    assert queued.json()["type"] == "urn:zoopick:problem:broker-unavailable"
    redis_link.restore()
    assert c.get("/readyz").json()["checks"]["broker"] == "ok"
