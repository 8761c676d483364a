"""The HTTP side of issue 21 (items 4-12): request-head caps over a raw socket, typed hook
options, bounded JSON, the dashboard's submit and sign-in doors, spardl teams, the upload
cap, log noise and plain messages. In-process on the session's app (PostgreSQL, Redis);
the raw-socket tests serve that app with uvicorn in a thread (no new process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests import hostile_http as hostile
from tests.service.procs import free_port
from tests.service.test_api import (
    API,
    assert_problem,
    ready_dataset,
    zoo,  # noqa: F401 - the module fixture, for the form tests
)

# -- 4: request-head caps ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["httptools", "h11"])
def raw_server(request, service_app, client) -> Iterator[tuple[str, int]]:
    """The session's app served by uvicorn (in a thread) with the protocol ``zoopick serve``
    uses, on each of uvicorn's HTTP/1.1 implementations."""
    import uvicorn

    from zoopick.app import httpcaps

    protocol = {"httptools": httpcaps.AutoProtocol, "h11": httpcaps.H11CappedProtocol}
    if request.param == "httptools":
        assert httpcaps.AutoProtocol.__name__ == "HttpToolsCappedProtocol"
    port = free_port()
    config = uvicorn.Config(
        service_app,
        host="127.0.0.1",
        port=port,
        http=protocol[request.param],
        lifespan="off",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield "127.0.0.1", port
    server.should_exit = True
    thread.join(10)


@pytest.mark.parametrize(
    ("head", "status", "needle"),
    [
        (hostile.huge_header_head(1024 * 1024), 431, "header line"),
        (hostile.many_headers_head(1000), 431, "header block"),
        (hostile.long_target_head(1024 * 1024), 414, "request line"),
    ],
    ids=["one-1MiB-header", "1000-headers", "1MiB-target"],
)
def test_oversized_request_heads_are_refused_before_parsing(raw_server, head, status, needle):
    started = time.monotonic()
    got, answer = hostile.send_raw(*raw_server, head)
    assert got == status, answer[:300]
    assert b"application/problem+json" in answer and needle.encode() in answer
    assert time.monotonic() - started < 5
    # the server still answers, at once, a normal request
    ok, answer = hostile.send_raw(*raw_server, hostile.request_head(headers={"X-Ok": "1" * 4000}))
    assert ok == 200, answer[:300]


def test_a_head_that_never_ends_is_timed_out(raw_server, monkeypatch):
    """The caps bound a head's bytes; a client trickling one (slowloris) held its connection
    for as long as it liked. Past ``HEAD_SECONDS`` a begun head gets a 408 and the connection
    closes; a connection that sends nothing is closed."""
    import socket

    from zoopick.app import httpcaps

    monkeypatch.setattr(httpcaps, "HEAD_SECONDS", 1.0)
    host, port = raw_server
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line: never ends
        started = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer
        assert time.monotonic() - started < 8
    with socket.create_connection((host, port), timeout=10) as sock:
        assert sock.recv(1) == b""  # silent: closed, no answer
    ok, answer = hostile.send_raw(host, port, hostile.request_head())
    assert ok == 200, answer[:300]


def test_a_long_body_on_a_kept_alive_connection_is_no_head(raw_server):
    """The caps follow the parser's own idea of where a head is: a body of 200 kB without a
    newline, unread by the app, then a second request on the same connection."""
    import socket

    body = b'{"pad": "' + b"0" * 200_000 + b'"}'
    first = (
        f"POST {API}/jobs HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(raw_server, timeout=10) as sock:
        sock.sendall(first + hostile.request_head())
        answer = b""
        while answer.count(b"HTTP/1.1 ") < 2 or not answer.endswith(b"}"):
            got = sock.recv(65536)
            assert got, answer
            answer += got
    statuses = [int(p.split(b" ", 1)[0]) for p in answer.split(b"HTTP/1.1 ")[1:]]
    assert statuses == [401, 200], answer


# -- 5, 9: hook options typed per hook; spardl teams against the workers -----------------------


def _job(client, tenant, finetune: dict, **extra):
    ds = ready_dataset(client.app, tenant.name)
    body = {"dataset_id": ds, "models": ["no-such-model"], "finetune": finetune, **extra}
    return client.post(f"{API}/jobs", json=body, headers=tenant.headers)


@pytest.mark.parametrize(
    ("finetune", "needle"),
    [
        ({"compressor": "topk", "hook_options": {"momentum": []}}, "momentum"),
        ({"compressor": "topk", "hook_options": {"a": 1}}, "'a'"),
        ({"compressor": "spardl", "hook_options": {"pairs16": []}}, "pairs16"),
        ({"compressor": "dfs", "hook_options": {"shrink_at": "x"}}, "shrink_at"),
        ({"compressor": "spardl", "hook_options": {"fp16": "no"}}, "fp16"),
        ({"compressor": "spardl", "hook_options": {"fp16": 1}}, "fp16"),
        ({"compressor": "spardl", "hook_options": {"teams": "2"}}, "teams"),
        ({"compressor": "spardl", "hook_options": {"teams": 1.0}}, "teams"),
        ({"compressor": "spardl", "hook_options": {"teams": 10**30}}, "teams"),
        ({"compressor": "spardl", "workers": 2, "hook_options": {"teams": 3}}, "teams"),
        ({"compressor": "spardl", "workers": 4, "hook_options": {"teams": 3}}, "teams"),
        (
            {"compressor": "spardl", "workers": {"min": 2, "max": 3}, "hook_options": {"teams": 2}},
            "teams",
        ),
    ],
)
def test_wrong_hook_options_are_422_naming_the_field(client, alice, finetune, needle):
    body = assert_problem(_job(client, alice, finetune), 422, needle)
    assert "hook_options" in body["detail"]


def test_teams_that_divide_the_workers_pass_validation(client, alice):
    # past the options, the job is refused for its unknown model: the options were accepted
    for workers in (4, {"min": 2, "max": 2}):
        fine = {"compressor": "spardl", "workers": workers, "hook_options": {"teams": 2}}
        assert_problem(_job(client, alice, fine), 422, "unknown zoo model")


# -- 6, 12: free-form JSON bounded, a too-large body is a problem document ---------------------

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("depth", [40, 256])
def test_deeply_nested_json_is_a_4xx_on_every_body(client, alice, admin, depth):
    ds = ready_dataset(client.app, alice.name)
    hook = {"compressor": "spardl", "hook_options": {"teams": hostile.nested(depth)}}
    resp = client.post(
        f"{API}/jobs", json={"dataset_id": ds, "finetune": hook}, headers=alice.headers
    )
    assert_problem(resp, 422, "nested deeper than")
    text = hostile.nested_json_text(depth * 20)
    for path, who in ((f"{API}/jobs", alice), (f"{API}/zoo", admin)):
        resp = client.post(path, content=text, headers={**who.headers, **JSON})
        assert_problem(resp, 422, "nested deeper than")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (b'{"dataset_id": "%s", "finetune": {"lr": NaN}}', "NaN is not a JSON value"),
        (b'{"dataset_id": "%s", "finetune": {"lr": -Infinity}}', "-Infinity is not a JSON"),
        (b'{"dataset_id": "%s", "finetune": {"epochs": 500, "epochs": 1}}', "'epochs' appears"),
        (b'{"dataset_id": "%s", "dataset_id": "%s"}', "'dataset_id' appears twice"),
    ],
)
def test_json_that_python_reads_but_json_has_not_is_refused(client, alice, text, needle):
    """NaN and Infinity are no JSON (a NaN ``lr`` had been refused as "not less than or
    equal to 10"), and a key given twice is read as its last value without a word."""
    ds = ready_dataset(client.app, alice.name)
    body = text.replace(b"%s", ds.encode())
    resp = client.post(f"{API}/jobs", content=body, headers={**alice.headers, **JSON})
    assert_problem(resp, 422, needle)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (b'{"dataset_id": "%s", "finetune": {"epochs": 1%z}}', "finetune.epochs: an integer of"),
        (b'{"dataset_id": "%s", "models": ["a", -9%z]}', "models.1: an integer of 4301 digits"),
        (b'{"dataset_id": "%s", "finetune": {"hook_options": {"k": 1%z}}}', "hook_options.k:"),
        (b"1%z", "the body: an integer of"),
    ],
)
def test_an_integer_too_long_for_python_names_its_field(client, alice, text, needle):
    """Python's json gives up on an integer of over 4300 digits (``int`` max str digits) with
    a ValueError, which FastAPI answered "There was an error parsing the body": a 422 names
    the field."""
    ds = ready_dataset(client.app, alice.name)
    digits = b"0" * 5000 if b"1%z" in text else b"9" * 4300
    body = text.replace(b"%s", ds.encode()).replace(b"%z", digits)
    resp = client.post(f"{API}/jobs", content=body, headers={**alice.headers, **JSON})
    assert_problem(resp, 422, needle)
    assert "too large to read" in resp.json()["detail"]


def test_nesting_inside_strings_does_not_count(client, alice):
    resp = client.post(
        f"{API}/jobs",
        json={"dataset_id": "[[[[" * 100, "models": ["{{" * 100]},
        headers=alice.headers,
    )
    assert_problem(resp, 422, "dataset_id")


def test_a_json_body_over_the_cap_is_a_413_problem(client, alice, service_settings):
    size = service_settings.body_max_bytes + 1024
    for headers in (JSON, {"content-type": "text/plain"}):
        resp = client.post(
            f"{API}/jobs", content=hostile.big_json(size), headers={**alice.headers, **headers}
        )
        assert_problem(resp, 413, "ZOOPICK_BODY_MAX_BYTES")
    # chunked (no Content-Length): counted as it arrives
    chunks = iter([hostile.big_json(size)[i : i + 65536] for i in range(0, size, 65536)])
    resp = client.post(f"{API}/jobs", content=chunks, headers={**alice.headers, **JSON})
    assert_problem(resp, 413, "ZOOPICK_BODY_MAX_BYTES")


# -- 10: the upload cap counts every byte of the body ------------------------------------------


@pytest.mark.parametrize("path", [f"{API}/datasets", "/datasets/upload"])
def test_a_second_file_part_over_the_cap_is_413(client, service_app, alice, service_settings, path):
    from tests.service.datafiles import npz_bytes

    headers = {**alice.headers, **hostile.multipart_headers()}
    if path.startswith("/datasets"):  # the dashboard's form: signed in, with its CSRF token
        from tests.service.test_dashboard import csrf_of, sign_in

        b = sign_in(service_app, alice.token)
        token = csrf_of(b.get("/datasets").text)
        path, client, headers = f"{path}?csrf={token}", b, hostile.multipart_headers()
        headers["accept"] = "application/json"
    over = service_settings.upload_max_bytes + 512 * 1024
    body = hostile.multipart_chunks(
        [hostile.part("file", npz_bytes(seed=3), filename="a.npz")],
        filler_part=("file", "b.npz", over),
    )
    assert_problem(client.post(path, content=body, headers=headers), 413, "limit")
    # and a text part as large: the same
    body = hostile.multipart_chunks(
        [hostile.part("file", npz_bytes(seed=3), filename="a.npz")],
        filler_part=("name", "", over),
    )
    resp = client.post(path, content=body, headers=headers)
    assert resp.status_code in (400, 413), resp.text


# -- 7: the dashboard's submit form keeps the API's Idempotency-Key rules ----------------------


@pytest.fixture(scope="module")
def sqlite_app(tmp_path_factory):
    """The app on the embedded defaults' database (SQLite), migrated, with one zoo model."""
    from zoopick.app.main import create_app
    from zoopick.service.db import migrate
    from zoopick.service.db.models import ZooModel
    from zoopick.service.db.session import session_scope
    from zoopick.service.settings import Settings

    data = tmp_path_factory.mktemp("sqlite-app")
    settings = Settings(data_dir=data, database_url=f"sqlite:///{data / 'z.db'}")
    migrate.upgrade(settings.database_url)
    app = create_app(settings)
    with session_scope(app.state.sessionmaker) as session:
        session.add(ZooModel(id="m1", arch="test_resnet", weights="none", num_classes=2))
    return app


@pytest.mark.parametrize("db", ["postgresql", "sqlite"])
@pytest.mark.parametrize("idem", ["k" * 10_000, "a\x00b", "tab\there"], ids=["10k", "nul", "ctrl"])
def test_the_submit_form_refuses_a_bad_idempotency_key(request, service_app, sqlite_app, db, idem):
    from sqlalchemy import func, select

    from tests.service.test_dashboard import csrf_of, sign_in
    from zoopick.service.db.models import Job, ZooModel
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import create_api_key

    app = service_app if db == "postgresql" else sqlite_app
    if db == "postgresql":
        request.getfixturevalue("zoo")
    tenant = f"idem-{db}-{request.node.callspec.id}"
    with session_scope(app.state.sessionmaker) as session:
        key, token = create_api_key(session, tenant=tenant, name="k")
        tenant_id = key.tenant_id
        model = session.scalars(select(ZooModel.id).order_by(ZooModel.id)).first()
    b = sign_in(app, token)
    form = {"csrf": csrf_of(b.get("/submit").text), "idempotency_key": idem}
    form.update(dataset_id=ready_dataset(app, tenant), metrics="sms", models=model)
    resp = b.post("/submit", data=form)
    assert resp.status_code == 422, resp.text[:500]
    assert "The job was not submitted: the Idempotency-Key" in resp.text
    with session_scope(app.state.sessionmaker) as session:
        count = select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id)
        assert session.scalar(count) == 0


# -- 8: dashboard sign-in is rate-limited like the API -----------------------------------------


def test_sign_in_is_refused_after_the_apis_number_of_failures(service_app, service_settings):
    from fastapi.testclient import TestClient
    from limits import parse

    from tests.service.test_dashboard import csrf_of

    allowed = parse(service_settings.rate_auth_failures).amount
    # an address of its own: the session's other tests share "testclient"
    b = TestClient(service_app, follow_redirects=False, client=("198.51.100.21", 4000))
    token = csrf_of(b.get("/login").text)
    codes = [
        b.post("/login", data={"api_key": f"zp_wrong{i}", "csrf": token}).status_code
        for i in range(allowed + 1)
    ]
    assert codes == [401] * allowed + [429]
    last = b.post("/login", data={"api_key": "zp_wrong", "csrf": token})
    assert last.status_code == 429 and "too many failed authentications" in last.text
    assert int(last.headers["retry-after"]) >= 1
    # the API from that address is refused too: one counter per address
    api = TestClient(service_app, client=("198.51.100.21", 4001))
    assert_problem(api.get(f"{API}/jobs", headers={"Authorization": "Bearer x"}), 429)


# -- 11: expected events log one info line -----------------------------------------------------


def _disconnect_midway(app, path: str, headers: dict[str, str]) -> None:
    """Call ``app`` as a server would for a client that sends part of its body and goes."""
    import asyncio

    messages = [
        {"type": "http.request", "body": b"--hostile-boundary\r\n", "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("198.51.100.31", 4000),
        "server": ("testserver", 80),
        "state": {},
    }
    asyncio.run(app(scope, receive, send))


@pytest.mark.parametrize("kind", ["upload", "json"])
def test_a_client_gone_mid_body_is_one_info_line(service_app, alice, caplog, kind):
    import logging

    if kind == "upload":
        path, headers = f"{API}/datasets", {**alice.headers, **hostile.multipart_headers()}
    else:
        path, headers = f"{API}/jobs", {**alice.headers, **JSON}
    headers["content-length"] = "100000"
    with caplog.at_level(logging.INFO):
        _disconnect_midway(service_app, path, headers)
    mine = [r for r in caplog.records if r.name.startswith("zoopick")]
    assert [r.levelno for r in mine] == [logging.INFO], [r.getMessage() for r in mine]
    assert "went away" in mine[0].getMessage() and mine[0].exc_info is None


def test_a_revoked_chord_is_one_info_line_and_other_chord_errors_stay_errors(caplog):
    """Celery's backend logs a cancelled job's chord with ``logger.exception``; the worker's
    app (``zoopick.workers.celery_app``) installs the filter that makes it one info line."""
    import logging

    from celery.backends.redis import logger as backend_log
    from celery.exceptions import ChordError, TaskRevokedError

    import zoopick.workers.celery_app  # noqa: F401 - installs the filter, as the worker does

    def chord_raised(exc: Exception) -> None:
        try:
            raise exc
        except ChordError as caught:  # as celery.backends.redis.on_chord_part_return does
            backend_log.exception("Chord %r raised: %r", "g-1", caught)

    revoked = ChordError(f"Dependency t-1 raised {TaskRevokedError('revoked')!r}")
    with caplog.at_level(logging.INFO, logger=backend_log.name):
        chord_raised(revoked)
        chord_raised(ChordError("Dependency t-2 raised ValueError('boom')"))
    records = [r for r in caplog.records if r.name == backend_log.name]
    assert [r.levelno for r in records] == [logging.INFO, logging.ERROR]
    assert records[0].exc_info is None and "revoked" in records[0].getMessage()
    assert "TaskRevokedError" not in caplog.text.split("\n")[0]


# -- 12: echoed input is capped --------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"models": [f"m{i}" for i in range(100_000)]},
        {"metrics": [f"no-such-metric-{i}" for i in range(30)]},
        {"models": list(range(5_000))},
        {"x" * 200_000: 1},
        {"finetune": {"hook_options": {"y" * 200_000: 1}}},
    ],
    ids=["100k-unknown-models", "30-unknown-metrics", "50k-bad-types", "long-key", "long-option"],
)
def test_errors_do_not_echo_unbounded_input(client, alice, service_settings, body):
    ds = ready_dataset(client.app, alice.name)
    content = __import__("json").dumps({"dataset_id": ds, **body})
    if len(content) > service_settings.body_max_bytes:
        pytest.fail("the body must fit the cap, or it tests the cap instead")
    resp = client.post(f"{API}/jobs", content=content, headers={**alice.headers, **JSON})
    assert 400 <= resp.status_code < 500, resp.text[:300]
    assert len(resp.content) < 8 * 1024, resp.text[:300]
    assert "more" in resp.json()["detail"] or "…" in resp.text


# -- 12: plain messages ------------------------------------------------------------------------


def test_a_png_bomb_names_max_pixels_not_pillows_limit(monkeypatch):
    from PIL import Image

    from tests.bombs import png_bytes
    from zoopick.selection import data
    from zoopick.selection.errors import LimitExceeded

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow refuses over twice this
    with pytest.raises(LimitExceeded) as err:
        data._decode(png_bytes(100, 100, 7), "a/bomb.png")
    assert "max_pixels" in str(err.value) and "bomb" in str(err.value)
    assert "DOS" not in str(err.value) and "Image size" not in str(err.value)


def test_a_failed_runs_error_names_no_exception_class_of_ours():
    from zoopick.training.comm_options import CommError
    from zoopick.training.config import failure_text

    exc = CommError("spardl: teams=3 does not divide the 2 workers")
    assert failure_text(type(exc).__name__, str(exc)) == str(exc)
    # an unexpected error keeps its class: a clue for whoever reads the log
    assert failure_text("RuntimeError", "boom") == "RuntimeError: boom"


def test_each_hooks_options_are_published_in_the_openapi_document(client):
    schema = client.get("/openapi.json").json()["components"]["schemas"]["FinetuneOptions"]
    per_hook = {s["title"]: s for s in schema["properties"]["hook_options"]["anyOf"]}
    spardl = per_hook["spardl options"]
    assert spardl["properties"]["teams"]["type"] == "integer"
    assert spardl["properties"]["fp16"]["type"] == "boolean"
    assert spardl["additionalProperties"] is False


# -- the same class of hole elsewhere: query strings of the dashboard --------------------------


@pytest.mark.parametrize("size", ["9" * 5000, "²", "-1", "0"])
def test_a_dashboard_page_size_that_is_no_number_is_no_500(service_app, alice, size):
    from tests.service.test_dashboard import sign_in

    b = sign_in(service_app, alice.token)
    for page in ("/jobs", "/jobs/rows"):
        resp = b.get(page, params={"page_size": size})
        assert resp.status_code < 500, resp.text[:300]
