"""More concurrent requests than database connections (issue 10, item 14): the API queues
them and answers every one, instead of freezing until the pool times out and answering 500.

FastAPI runs each sync dependency and the endpoint in its own thread-pool call; a session that
got its connection in one call used to hold it while waiting for a thread for the next. With
more requests in flight than connections, every thread ended up waiting for a connection held
by a request that was waiting for a thread: nothing moved until ``pool_timeout``, then 500s.
Here the pool is 2 connections with a 3 s timeout and 120 requests arrive at once, against a
real uvicorn on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import time

import httpx

from tests.service import procs
from tests.service.test_hardening_quotas import new_key, ready_dataset_and_model, start_service

CONCURRENT = 120


@contextlib.contextmanager
def pooled_service(isolated_settings, name: str, connections: int, timeout: int):
    """(api proc, base URL, sessionmaker) of a uvicorn whose processes hold at most
    ``connections`` database connections and wait ``timeout`` seconds for one."""
    pool = {
        "ZOOPICK_DB_POOL_SIZE": str(connections),
        "ZOOPICK_DB_MAX_OVERFLOW": "0",
        "ZOOPICK_DB_POOL_TIMEOUT_SECONDS": str(timeout),
    }
    api, base, _, factory = start_service(isolated_settings, name, pool)
    try:
        yield api, base, factory
    finally:
        api.stop()


async def _burst(base: str, headers: dict[str, str], paths: list[str]) -> list[int]:
    limits = httpx.Limits(max_connections=CONCURRENT, max_keepalive_connections=CONCURRENT)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=60) as c:
        responses = await asyncio.gather(*(c.get(p) for p in paths))
    return [r.status_code for r in responses]


def test_requests_beyond_the_pool_wait_for_a_connection_and_all_succeed(isolated_settings):
    with pooled_service(isolated_settings, "overload", 2, 3) as (api, base, factory):
        headers = new_key(factory, "busy")
        dataset = ready_dataset_and_model(factory, "busy")
        paths = [
            f"/api/v1/datasets/{dataset}" if i % 2 else "/api/v1/datasets"
            for i in range(CONCURRENT)
        ]
        statuses = asyncio.run(_burst(base, headers, paths))
        assert statuses == [200] * CONCURRENT, (
            f"{sum(s != 200 for s in statuses)} of {CONCURRENT} failed: "
            f"{sorted(set(statuses))}\n{api.tail(20)}"
        )
        assert "TimeoutError" not in api.tail(200)


def _stall(base: str, headers: dict[str, str], path: str, content_type: str) -> socket.socket:
    """A POST whose client sent its headers and the start of its body, then nothing."""
    host, port = base.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: {headers['Authorization']}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: 100000\r\n\r\n"
        "--zpb\r\n"
    )
    slow = socket.create_connection((host, int(port)))
    slow.sendall(head.encode())
    return slow


def test_a_stalled_upload_holds_no_connection(isolated_settings):
    """While an upload's body trickles in (as slowly as its client likes) the request holds
    neither a database connection nor a session slot: with a pool of one connection, other
    requests are served at once (before the fix they waited for the pool timeout, then 503).
    The same for a dashboard form (the login) posted just as slowly."""
    with pooled_service(isolated_settings, "overload-stall", 1, 2) as (_, base, factory):
        headers = new_key(factory, "slow")
        multipart = "multipart/form-data; boundary=zpb"
        form = "application/x-www-form-urlencoded"
        with (
            _stall(base, headers, "/api/v1/datasets", multipart),
            _stall(base, headers, "/login", form),
        ):
            time.sleep(1.0)  # both wait for the rest of their bodies
            for _ in range(3):
                started = time.monotonic()
                resp = httpx.get(f"{base}/api/v1/datasets", headers=headers, timeout=30)
                assert resp.status_code == 200, resp.text
                assert time.monotonic() - started < 1.5  # well inside the 2 s pool timeout


def test_a_request_that_waits_too_long_for_a_connection_is_503(isolated_settings):
    """The wait for a session slot is bounded: with the only connection held by an upload
    whose insert waits on a lock (here the tenant's row, locked by another client of the
    database), another request is answered 503 "busy" with Retry-After after
    ``ZOOPICK_DB_POOL_TIMEOUT_SECONDS``; once the lock is gone the upload finishes and
    requests go through again."""
    from sqlalchemy import select

    from zoopick.service.db.models import Tenant

    with pooled_service(isolated_settings, "overload-shed", 1, 2) as (api, base, factory):
        headers = new_key(factory, "locked")
        blocker = factory()
        blocker.execute(select(Tenant).where(Tenant.name == "locked").with_for_update())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            upload = pool.submit(
                httpx.post,
                f"{base}/api/v1/datasets",
                headers=headers,
                files={"file": ("d.npz", b"not really an npz", "application/octet-stream")},
                timeout=60,
            )
            time.sleep(1.0)  # the upload holds its slot, waiting for the tenant lock
            started = time.monotonic()
            resp = httpx.get(f"{base}/api/v1/datasets", headers=headers, timeout=30)
            waited = time.monotonic() - started
            assert resp.status_code == 503, resp.text
            assert resp.json()["type"].endswith("busy") and resp.headers["retry-after"] == "1"
            assert waited >= 1.5
            assert not upload.done()
            blocker.rollback()  # the lock goes: the upload's insert proceeds
            blocker.close()
            finished = upload.result(timeout=30)
        assert finished.status_code in (201, 422), finished.text  # validated inline
        back = procs.poll(
            lambda: httpx.get(f"{base}/api/v1/datasets", headers=headers, timeout=30),
            lambda r: r.status_code == 200,
            30,
            what="requests to go through once the lock is gone",
        )
        assert back.status_code == 200, api.tail(20)
