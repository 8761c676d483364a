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


def test_a_request_that_waits_too_long_for_a_connection_is_503(isolated_settings):
    """The wait for a session slot is bounded: with the only connection held by an upload
    that stalled after its headers (a slow client), another request is answered 503 "busy"
    with Retry-After after ``ZOOPICK_DB_POOL_TIMEOUT_SECONDS``, and requests go through again
    once the upload is gone."""
    with pooled_service(isolated_settings, "overload-shed", 1, 2) as (_, base, factory):
        headers = new_key(factory, "slow")
        host, port = base.removeprefix("http://").split(":")
        head = (
            "POST /api/v1/datasets HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: {headers['Authorization']}\r\n"
            "Content-Type: multipart/form-data; boundary=zpb\r\nContent-Length: 100000\r\n\r\n"
            "--zpb\r\n"
        )
        with socket.create_connection((host, int(port))) as slow:
            slow.sendall(head.encode())
            time.sleep(1.0)  # the upload has its session and waits for the rest of the body
            started = time.monotonic()
            resp = httpx.get(f"{base}/api/v1/datasets", headers=headers, timeout=30)
            waited = time.monotonic() - started
        assert resp.status_code == 503, resp.text
        assert resp.json()["type"].endswith("busy") and resp.headers["retry-after"] == "1"
        assert waited >= 1.5
        back = procs.poll(
            lambda: httpx.get(f"{base}/api/v1/datasets", headers=headers, timeout=30),
            lambda r: r.status_code == 200,
            30,
            what="requests to go through once the stalled upload is gone",
        )
        assert back.json()["items"] == []
