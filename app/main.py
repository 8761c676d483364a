"""The FastAPI application factory: ``create_app(settings)``.

``uvicorn --factory zoopick.app.main:create_app`` serves it with settings from the environment;
tests
and ``zoopick serve`` pass their own :class:`~zoopick.service.settings.Settings`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from zoopick.app import apidocs, bodies, dashboard
from zoopick.app import metrics as prometheus
from zoopick.app.api import datasets, health, jobs, zoo
from zoopick.app.api import webhooks as webhook_api
from zoopick.app.api.settled import SettledViews
from zoopick.app.dashboard.auth import load_secret
from zoopick.app.problems import install as install_problems
from zoopick.app.ratelimit import RateLimits
from zoopick.service import outbox
from zoopick.service.db.session import make_engine, make_sessionmaker
from zoopick.service.dispatch import Dispatcher
from zoopick.service.recovery import Sweeper
from zoopick.service.settings import Settings, get_settings

API_PREFIX = "/api/v1"

DESCRIPTION = """
Upload a labelled image dataset, and zoopick ranks the pretrained models of its zoo for it
**without training any of them** (transferability metrics from one forward pass per model),
picks the best and, on request, fine-tunes it with sparse-communication data parallelism.

Authenticate with an API key as a Bearer token. Errors are RFC 9457 problem details.
"""


def create_app(settings: Settings | None = None) -> FastAPI:
    """The API for ``settings`` (default: :func:`get_settings`, from ``ZOOPICK_*``, as the
    workers read theirs)."""
    settings = settings or get_settings()
    settings.ensure_dirs()
    engine = make_engine(
        settings.database_url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_max_overflow,
        pool_timeout=settings.db_pool_timeout_seconds,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = None
        if settings.sweep_interval_seconds > 0:  # lost jobs: see zoopick.service.recovery
            sweeper = Sweeper(app.state.sessionmaker, app.state.dispatcher, settings)
            sweeper.start()
        app.state.sweeper = sweeper
        yield
        if sweeper is not None:
            sweeper.stop()
        engine.dispose()

    app = FastAPI(
        title="zoopick",
        version="0.1.0",
        description=DESCRIPTION,
        # /docs and /redoc with their assets served here, not from a CDN (zoopick.app.apidocs)
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
        # no Starlette body cap: zoopick.app.bodies caps JSON and form bodies (its 413 is a
        # problem document), uploads cap their own stream (zoopick.app.uploads)
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = make_sessionmaker(engine)
    # one slot per connection the pool can give: a request waits here, holding no thread,
    # until its session is sure of a connection (zoopick.app.api.deps.get_session)
    app.state.session_slots = asyncio.Semaphore(settings.db_pool_size + settings.db_max_overflow)
    app.state.dispatcher = Dispatcher(settings)
    # a job moved by a request sends its webhook's task through this app's broker settings
    app.state.sessionmaker.configure(info={outbox.DISPATCHER_KEY: app.state.dispatcher})
    app.state.rate = RateLimits(settings)
    app.state.settled_views = SettledViews()  # finished jobs' views (app.api.settled)
    app.state.session_secret = load_secret(settings)  # signs dashboard session cookies
    install_problems(app)
    app.include_router(health.router)
    for module in (datasets, zoo, jobs, webhook_api):
        app.include_router(module.router, prefix=API_PREFIX)
    dashboard.install(app)  # the web pages at /, over the same functions
    apidocs.install(app)  # /docs and /redoc, working offline
    bodies.install(app, settings.body_max_bytes)  # JSON and form bodies: size, depth
    prometheus.install(app)  # GET /metrics and the HTTP latency histogram
    return app
