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

import httpx

from tests.service.test_hardening_quotas import new_key, ready_dataset_and_model, start_service

CONCURRENT = 120


async def _burst(base: str, headers: dict[str, str], paths: list[str]) -> list[int]:
    limits = httpx.Limits(max_connections=CONCURRENT, max_keepalive_connections=CONCURRENT)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=60) as c:
        responses = await asyncio.gather(*(c.get(p) for p in paths))
    return [r.status_code for r in responses]


def test_requests_beyond_the_pool_wait_for_a_connection_and_all_succeed(isolated_settings):
    pool = {
        "ZOOPICK_DB_POOL_SIZE": "2",
        "ZOOPICK_DB_MAX_OVERFLOW": "0",
        "ZOOPICK_DB_POOL_TIMEOUT_SECONDS": "3",
    }
    api, base, _, factory = start_service(isolated_settings, "overload", pool)
    try:
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
    finally:
        api.stop()
