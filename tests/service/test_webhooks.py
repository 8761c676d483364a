"""Webhooks: refused to internal addresses by default (422 naming the field, and at delivery
time), and, on the live stack (whose settings allow 127.0.0.1), delivered to a real receiver on
127.0.0.1 by the Celery worker with a valid signature, retried after a failure and logged."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.service.datafiles import npz_bytes
from tests.service.test_dashboard import sign_in
from zoopick.service import netguard, pipeline, webhooks
from zoopick.service.db.models import Job, JobStatus, WebhookDelivery
from zoopick.service.db.session import session_scope
from zoopick.service.queue import WEBHOOKS
from zoopick.service.security import get_or_create_tenant


class Receiver:
    """An HTTP server on 127.0.0.1 that records each POST and answers ``statuses`` in turn
    (then 200)."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.calls: list[dict] = []
        self.statuses = list(statuses or [])
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls.append({"headers": dict(self.headers), "body": body})
                status = outer.statuses.pop(0) if outer.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook?x=1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver(statuses=[500])
    yield r
    r.close()


def verify(secret: str, headers: dict, body: bytes, tolerance: float = 300) -> bool:
    """The README's verification recipe, as a receiver writes it."""
    fields = dict(p.split("=", 1) for p in headers["Zoopick-Signature"].split(","))
    expected = hmac.new(
        secret.encode(), fields["t"].encode() + b"." + body, hashlib.sha256
    ).hexdigest()
    fresh = abs(time.time() - int(fields["t"])) <= tolerance
    return fresh and hmac.compare_digest(expected, fields["v1"])


# -- refused by default -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "192.168.0.1",
        "169.254.169.254",
        "::1",
        "fe80::1",
        "224.0.0.1",
        "0.0.0.0",
        "::ffff:127.0.0.1",
        "100.64.0.1",
        "240.0.0.1",
        # IPv6 forms that carry an internal IPv4 address: NAT64 (loopback, cloud metadata),
        # 6to4, IPv4-compatible, IPv4-translated; local-use NAT64
        "64:ff9b::7f00:1",
        "64:ff9b::a9fe:a9fe",
        "2002:7f00:1::",
        "::127.0.0.1",
        "::ffff:0:7f00:1",
        "64:ff9b:1::a00:1",
        # IANA's special-purpose blocks that Python 3.11's ipaddress calls global, or that
        # only the registry lists: protocol assignments (192.0.0.8, the dummy address; PCP
        # anycast), documentation, benchmarking, anycast services, broadcast
        "192.0.0.8",
        "192.0.0.9",
        "192.0.0.171",
        "192.0.2.1",
        "198.18.0.1",
        "198.51.100.7",
        "203.0.113.5",
        "192.31.196.1",
        "192.52.193.1",
        "192.88.99.1",
        "192.175.48.1",
        "255.255.255.255",
        "100::1",
        "2001::1",
        "2001:1::1",
        "2001:2::1",
        "2001:3::1",
        "2001:4:112::1",
        "2001:20::1",
        "2001:db8::1",
        "2620:4f:8000::1",
        "3fff::1",
        "5f00::1",
        "fd00::1",
        "fec0::1",
        "ff0e::1",
        "4000::1",
        # and those carried in IPv6: mapped, NAT64, 6to4
        "::ffff:192.0.0.8",
        "64:ff9b::c000:8",
        "2002:c000:8::1",
        "2002:c633:6407::1",
    ],
)
def test_internal_addresses_are_refused_unless_allowed(address):
    addr = ipaddress.ip_address(address)
    assert netguard.address_problem(addr, []) is not None
    assert netguard.address_problem(addr, netguard.networks(["0.0.0.0/0", "::/0"])) is None
    assert netguard.address_problem(ipaddress.ip_address("93.184.216.34"), []) is None


@pytest.mark.parametrize(
    "address",
    [
        "93.184.216.34",
        "64:ff9b::5db8:d822",
        "2002:5db8:d822::1",
        "::ffff:93.184.216.34",
        "2606:4700::1111",
        "2001:4860:4860::8888",  # beside 2001::/23, not in it
        "192.0.3.1",  # beside 192.0.0.0/24 and 192.0.2.0/24
        "198.20.0.1",  # beside 198.18.0.0/15
    ],
)
def test_public_addresses_pass_in_every_form(address):
    assert netguard.address_problem(ipaddress.ip_address(address), []) is None


def test_a_special_purpose_address_is_named_and_its_block_can_be_allowed():
    addr = ipaddress.ip_address("192.0.0.8")
    problem = netguard.address_problem(addr, [])
    assert problem is not None and "192.0.0.0/24" in problem, problem
    assert netguard.address_problem(addr, netguard.networks(["192.0.0.0/24"])) is None
    assert netguard.address_problem(addr, netguard.networks(["192.0.2.0/24"])) is not None
    # the allow-list admits a carried special-purpose address too
    nat64 = ipaddress.ip_address("64:ff9b::c000:8")
    assert netguard.address_problem(nat64, netguard.networks(["192.0.0.8/32"])) is None


def test_an_allowed_ipv4_network_allows_its_nat64_form():
    allow = netguard.networks(["10.0.0.0/8"])
    assert netguard.address_problem(ipaddress.ip_address("64:ff9b::a00:1"), allow) is None
    # 192.168.0.1 behind NAT64: private, and not in the allowed network
    assert netguard.address_problem(ipaddress.ip_address("64:ff9b::c0a8:1"), allow) is not None


def test_bad_webhook_urls_get_a_422_naming_the_field(client, alice):
    for url, why in [
        ("http://127.0.0.1:9/hook", "loopback"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://localhost/hook", "loopback"),
        ("ftp://example.com/hook", "http"),
        ("http://user:pw@example.com/", "credentials"),
        ("http://no-such-host.invalid/", "does not resolve"),
        ("http://93.184.216.34:0/hook", "port 0"),
        ("http://[64:ff9b::7f00:1]/hook", "carries 127.0.0.1"),
        ("http://192.0.0.8/", "192.0.0.0/24"),
        ("http://[2001:db8::1]/hook", "documentation"),
    ]:
        resp = client.put("/api/v1/webhook", json={"url": url}, headers=alice.headers)
        assert resp.status_code == 422, (url, resp.text)
        assert resp.json()["detail"].startswith("url:") and why in resp.json()["detail"], url
        assert "Value error" not in resp.json()["detail"]  # pydantic's prefix: not ours
    body = {"dataset_id": str(uuid.uuid4()), "webhook": {"url": "gopher://x/"}}
    resp = client.post("/api/v1/jobs", json=body, headers=alice.headers)
    assert resp.status_code == 422 and "webhook" in resp.text and "url" in resp.text
    body["webhook"] = {"url": "http://10.0.0.7:8080/hook", "phases": True}
    resp = client.post("/api/v1/jobs", json=body, headers=alice.headers)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"].startswith("webhook.url: 10.0.0.7 is a private address")
    assert client.get("/api/v1/webhook", headers=alice.headers).json()["url"] is None


def test_delivery_to_a_loopback_address_is_refused_at_send_time(
    service_app, service_settings, make_key
):
    """A URL that passed its check (or whose DNS changed since) is checked again when sent;
    the job's dashboard page shows the delivery log."""
    seen = Receiver()
    owner = make_key(f"hooks-{uuid.uuid4().hex[:6]}")
    try:
        factory = service_app.state.sessionmaker
        with session_scope(factory) as session:
            tenant = get_or_create_tenant(session, owner.name)
            job = Job(
                tenant_id=tenant.id,
                request={},
                models=["a"],
                metrics=["sms"],
                select_by="sms",
                webhook={"url": seen.url, "phases": False},
            )
            session.add(job)
            session.flush()
            job_id = job.id
            assert pipeline.transition(session, job_id, JobStatus.scoring)
            assert pipeline.transition(session, job_id, JobStatus.failed, error="boom")
            [delivery] = webhooks.deliveries(session, job_id)  # terminal only: no phases
            assert delivery.event == "job.failed" and delivery.payload["job"]["error"] == "boom"
        with session_scope(factory) as session:
            outcome = webhooks.deliver(session, delivery.id, service_settings)
        assert outcome.done
        with factory() as session:
            row = session.get(WebhookDelivery, delivery.id)
            assert row.status == "failed" and row.attempts == 1
            assert "refused" in row.error and "loopback" in row.error
        assert seen.calls == []  # nothing reached the receiver
        page = sign_in(service_app, owner.token).get(f"/jobs/{job_id}")
        assert page.status_code == 200
        table = page.text[page.text.index('id="webhook-deliveries"') :]
        assert "job.failed" in table and "refused" in table and "loopback" in table
    finally:
        seen.close()


class RawReceiver:
    """A TCP server on 127.0.0.1 that reads a request and answers with ``answer(sock)``, in a
    thread per connection; ``sent`` counts the bytes it managed to send."""

    def __init__(self, answer) -> None:
        import socket

        self.sent = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn) -> None:
        with conn:
            conn.recv(65536)
            with contextlib.suppress(OSError):  # the client hung up: what the test expects
                self.answer(self, conn)

    def close(self) -> None:
        self.sock.close()


def _trickle(rx: RawReceiver, conn) -> None:
    """A status line a byte every 0.3 s (each read comes well within any read timeout)."""
    for ch in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
        conn.sendall(bytes([ch]))
        rx.sent += 1
        time.sleep(0.3)


def _flood(rx: RawReceiver, conn) -> None:
    """200 at once, then a body announced as 2 GB, sent for as long as the client reads."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2000000000\r\n\r\n")
    chunk = b"\0" * 65536
    while rx.sent < 2_000_000_000:
        conn.sendall(chunk)
        rx.sent += len(chunk)


def _pending_delivery(factory, tenant_name: str, url: str) -> uuid.UUID:
    """A failed job of its own with one pending delivery of its end to ``url``."""
    with session_scope(factory) as session:
        tenant = get_or_create_tenant(session, tenant_name)
        job = Job(tenant_id=tenant.id, request={}, models=["a"], metrics=["sms"],
                  select_by="sms", webhook={"url": url, "phases": False})  # fmt: skip
        session.add(job)
        session.flush()
        assert pipeline.transition(session, job.id, JobStatus.scoring)
        assert pipeline.transition(session, job.id, JobStatus.failed, error="boom")
        [delivery] = webhooks.deliveries(session, job.id)
        return delivery.id


@pytest.mark.parametrize("answer", [_trickle, _flood], ids=["trickling", "flooding"])
def test_one_try_is_bounded_in_time_and_reads_no_body(service_app, service_settings, answer):
    """A receiver that sends its answer a byte at a time (each read within httpx's timeout)
    had held a worker for the task's time limit, every task behind it waiting; one that
    answers a 2 GB body had it read into the worker's memory. A try now ends at
    ``webhook_timeout_seconds`` whatever the receiver does, and only the status is read."""
    settings = service_settings.model_copy(
        update={"webhook_allow_networks": ["127.0.0.1/32"], "webhook_timeout_seconds": 1.5}
    )
    rx = RawReceiver(answer)
    try:
        factory = service_app.state.sessionmaker
        delivery_id = _pending_delivery(factory, f"hooks-{uuid.uuid4().hex[:6]}", rx.url)
        start = time.monotonic()
        with session_scope(factory) as session:
            outcome = webhooks.deliver(session, delivery_id, settings)
        took = time.monotonic() - start
        with factory() as session:
            row = session.get(WebhookDelivery, delivery_id)
            status, error = row.status, row.error
    finally:
        rx.close()
    assert took < 5, took
    if answer is _trickle:
        assert not outcome.done and status == "pending" and "TimeoutError" in error, error
        assert rx.sent < 10  # it was cut off part-way through the status line
    else:
        assert outcome.done and status == "delivered"
        assert rx.sent < 64 * 2**20  # the body went unread (socket buffers hold a little)


# -- delivered by the worker --------------------------------------------------------------------


def test_worker_delivers_signed_webhooks_with_retries_and_a_log(live_server, receiver):
    stack = live_server.tenant(f"hooks-{uuid.uuid4().hex[:6]}")
    with stack.api() as api:
        hook = api.put("/webhook", json={"url": receiver.url, "phases": True})
        assert hook.status_code == 200, hook.text
        secret = hook.json()["secret"]
        assert len(secret) == 64 and api.get("/webhook").json()["secret"] == secret

        upload = api.post("/datasets", files={"file": ("d.npz", npz_bytes(seed=3))})
        assert upload.status_code in (201, 202), upload.text
        ds = upload.json()["id"]
        deadline = time.monotonic() + 60
        while api.get(f"/datasets/{ds}").json()["status"] != "ready":
            assert time.monotonic() < deadline, "dataset never became ready"
            time.sleep(0.2)
        body = {"dataset_id": ds, "models": ["tiny-resnet"], "metrics": ["sms"]}
        job = api.post("/jobs", json=body).json()["id"]

        deadline = time.monotonic() + 90
        while True:
            log = api.get(f"/jobs/{job}/webhooks").json()
            done = [d for d in log if d["event"] == "job.succeeded"]
            if done and all(d["status"] != "pending" for d in log):
                break
            assert time.monotonic() < deadline, f"no delivery: {log}\n{stack.logs()}"
            time.sleep(0.2)

    assert [d["event"] for d in log] == ["job.scoring", "job.succeeded"]
    assert all(d["status"] == "delivered" for d in log), log
    # the receiver's first answer was a 500: that event was tried twice
    assert sorted(d["attempts"] for d in log) == [1, 2]
    assert len(receiver.calls) == 3
    final = [c for c in receiver.calls if c["headers"]["Zoopick-Event"] == "job.succeeded"][-1]
    assert verify(secret, final["headers"], final["body"])
    assert not verify("0" * 64, final["headers"], final["body"])
    assert not verify(secret, final["headers"], final["body"] + b" ")
    payload = json.loads(final["body"])
    assert payload["job"]["id"] == job and payload["job"]["status"] == "succeeded"
    assert payload["job"]["chosen_model"] == "tiny-resnet"
    assert payload["job"]["ranking"][0]["model"] == "tiny-resnet"
    assert final["headers"]["Zoopick-Delivery"] == payload["delivery"]


def test_the_sweep_resends_deliveries_left_pending(service_app, service_settings):
    """A delivery whose task was lost (broker down at the commit, a message dropped) is sent
    again by the recovery sweep, once per period."""
    from datetime import timedelta

    from zoopick.service import recovery
    from zoopick.service.db.types import utcnow

    factory = service_app.state.sessionmaker
    old = utcnow() - timedelta(seconds=webhooks.stale_after(service_settings) + 5)
    with session_scope(factory) as session:
        tenant = get_or_create_tenant(session, f"hooks-{uuid.uuid4().hex[:6]}")
        job = Job(tenant_id=tenant.id, request={}, models=["a"], metrics=["sms"], select_by="sms")
        session.add(job)
        session.flush()
        lost = WebhookDelivery(
            job_id=job.id,
            event="job.failed",
            url="http://example.com/",
            payload={},
            updated_at=old,
        )
        fresh = WebhookDelivery(
            job_id=job.id, event="job.scoring", url="http://example.com/", payload={}
        )
        session.add_all([lost, fresh])
    recovery.sweep(factory, service_app.state.dispatcher, service_settings)
    with factory() as session:
        assert session.get(WebhookDelivery, lost.id).updated_at > old  # re-sent, touched
    assert webhooks.resend_stale(factory, service_app.state.dispatcher, service_settings) == []


def _webhooks_queue_depth(dispatcher) -> int:
    with dispatcher.celery.connection_for_read() as conn:
        return conn.default_channel.queue_declare(queue=WEBHOOKS, durable=True).message_count


def test_every_commit_of_one_session_sends_its_events(service_app):
    """A session that moves a job in two transactions sends two delivery tasks (to the real
    broker), and a rolled-back move sends none."""
    factory = service_app.state.sessionmaker
    dispatcher = service_app.state.dispatcher
    with session_scope(factory) as session:
        tenant = get_or_create_tenant(session, f"hooks-{uuid.uuid4().hex[:6]}")
        job = Job(
            tenant_id=tenant.id,
            request={},
            models=["a"],
            metrics=["sms"],
            select_by="sms",
            webhook={"url": "http://93.184.216.34/hook", "phases": True},
        )
        session.add(job)
    before = _webhooks_queue_depth(dispatcher)
    with factory() as session:
        assert pipeline.transition(session, job.id, JobStatus.scoring)
        session.rollback()
        assert _webhooks_queue_depth(dispatcher) == before
        assert pipeline.transition(session, job.id, JobStatus.scoring)
        session.commit()
        assert pipeline.transition(session, job.id, JobStatus.succeeded)
        session.commit()
    assert _webhooks_queue_depth(dispatcher) == before + 2
    with factory() as session:
        events = [d.event for d in webhooks.deliveries(session, job.id)]
    assert events == ["job.scoring", "job.succeeded"]
