"""``GET /metrics`` for Prometheus, and the API's HTTP latency histogram.

Who may scrape: by default only an admin API key (``Authorization: Bearer <key>``, which
Prometheus sends with ``authorization: {credentials: <key>}`` in its scrape config), since
queue depths and worker names describe the deployment; ``ZOOPICK_METRICS_PUBLIC=true`` opens
the endpoint for a scraper inside a trusted network.

HTTP latency is labelled by *route template* (``/api/v1/jobs/{job_id}``), never the raw path,
so a scan of random URLs cannot grow the label set: unmatched requests share one label. It is
kept per process; with several API processes (``zoopick serve --workers N``), ``serve`` points
``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder and every process reads all processes' files
(prometheus_client's multiprocess mode). Everything else is computed at scrape time from the
database and the broker (``zoopick.service.metrics``), so any process answers the same.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client import multiprocess as prom_multiprocess

from zoopick.app.api.deps import Creds, SessionDep, authenticated
from zoopick.app.problems import Problem
from zoopick.service.metrics import ServiceCollector

UNMATCHED = "<unmatched>"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

router = APIRouter(tags=["metrics"])


def _multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class LatencyMiddleware:
    """Pure ASGI middleware (no body buffering): observes each HTTP request's duration under
    its method, route template and status class once the response is sent."""

    def __init__(self, app: Any, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.histogram.labels(
                scope["method"], route_template(scope), f"{status[0] // 100}xx"
            ).observe(time.perf_counter() - start)


def route_template(scope: dict) -> str:
    """The matched route's template with the prefix it was included under
    (``/api/v1/jobs/{job_id}``), or :data:`UNMATCHED`.

    The router leaves the matched route in ``scope["route"]``, but a route of an included
    router knows only its own part (``/jobs/{job_id}``): its pattern is found at the end of the
    request path, and what precedes it is the (static) prefix."""
    route = scope.get("route")
    path, regex = getattr(route, "path", None), getattr(route, "path_regex", None)
    if not path or regex is None:
        return UNMATCHED
    tail = re.compile(regex.pattern.removeprefix("^"))
    found = tail.search(scope.get("path", ""))
    if found is None:
        return path
    return scope["path"][: found.start()] + path


def install(app: FastAPI) -> None:
    """The latency middleware and ``GET /metrics`` on ``app``; each app has its own registry
    (tests build several apps in one process)."""
    registry = CollectorRegistry()
    histogram = Histogram(
        "zoopick_http_request_duration_seconds",
        "API request latency by method, route template and status class.",
        ["method", "route", "status"],
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    app.state.metrics_registry = registry
    app.add_middleware(LatencyMiddleware, histogram=histogram)
    app.include_router(router)


def _scrape(request: Request, session: SessionDep) -> bytes:
    http = request.app.state.metrics_registry
    if _multiprocess():  # every API process' HTTP histogram, from their files
        http = CollectorRegistry()
        prom_multiprocess.MultiProcessCollector(http)
    service = CollectorRegistry()
    service.register(
        ServiceCollector(session, request.app.state.settings, request.app.state.dispatcher.celery)
    )
    return generate_latest(http) + generate_latest(service)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"},
        401: {"description": "No or a bad API key (unless ZOOPICK_METRICS_PUBLIC)"},
        403: {"description": "Not an admin key"},
    },
)
def metrics(request: Request, session: SessionDep, creds: Creds) -> Response:
    """Queue depths, jobs by state, scoring and training durations, worker liveness and HTTP
    latency, in Prometheus' text format. Needs an admin key unless
    ``ZOOPICK_METRICS_PUBLIC`` is set."""
    if not request.app.state.settings.metrics_public:
        caller, _ = authenticated(request, session, creds)
        if not caller.admin:
            raise Problem(403, "scraping /metrics needs an admin API key", kind="forbidden")
    return Response(_scrape(request, session), media_type=CONTENT_TYPE_LATEST)
