"""A dependency outage answered as one: 503 with ``Retry-After``, naming what is down.

When PostgreSQL or the broker (Redis) stops answering, the error surfaces wherever a request
touched it (authentication, a list, a queued task) as a driver's exception. Left to the
catch-all handler that was a 500, which tells a client the request was wrong and not to try
again, and a client's retry policy (``zoopick.client.retry``) gives up on it. An outage is
transient by nature, so every route answers 503 (RFC 9457 body, ``dependency`` naming the
service) with ``Retry-After``; the dashboard's pages get an HTML page saying so. ``/readyz``
reports the same dependency in its ``checks``.
"""

from __future__ import annotations

import logging
import time

from fastapi import Request
from fastapi.responses import HTMLResponse, Response

log = logging.getLogger(__name__)

JSON_PREFIXES = ("/api/", "/metrics", "/readyz", "/healthz", "/openapi.json", "/docs", "/redoc")
"""Paths answered with problem documents; the rest are the dashboard's pages."""


def database_errors() -> tuple[type[BaseException], ...]:
    from sqlalchemy.exc import InterfaceError, OperationalError

    errors: list[type[BaseException]] = [OperationalError, InterfaceError]
    try:
        import psycopg

        errors += [psycopg.OperationalError, psycopg.InterfaceError]
    except ImportError:  # pragma: no cover - SQLite-only installs
        pass
    return tuple(errors)


def broker_errors() -> tuple[type[BaseException], ...]:
    import kombu.exceptions

    errors: list[type[BaseException]] = [kombu.exceptions.OperationalError]
    try:
        import redis.exceptions

        errors += [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError]
    except ImportError:  # pragma: no cover - the file broker
        pass
    return tuple(errors)


def dependency_down(exc: BaseException) -> str | None:
    """``"database"`` or ``"broker"`` when ``exc`` (or an exception it was raised from) is
    that service failing to answer; None for anything else (a bug stays a 500).

    A SQLAlchemy ``DBAPIError`` whose connection was invalidated counts as the database: the
    server went away under a query. A database *statement* error (a constraint, a syntax
    error) is an ``IntegrityError``/``ProgrammingError`` and is not an outage.
    """
    from zoopick.service.dbretry import is_outage

    database, broker = database_errors(), broker_errors()
    if is_outage(exc):  # the rule a worker's task retries by
        return "database"
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, database):  # a driver's error SQLAlchemy did not wrap
            return "database"
        if isinstance(current, broker):
            return "broker"
        current = current.__cause__ or current.__context__
    return None


LOG_EVERY_SECONDS = 10.0
"""During an outage every request answers 503; the log says so once per dependency in this
many seconds, with the count of requests answered since, not once per request."""
_logged: dict[str, tuple[float, int]] = {}  # dependency -> (last logged, answered since)


def _log_outage(dependency: str, where: str, error: str) -> None:
    now = time.monotonic()
    last, since = _logged.get(dependency, (float("-inf"), 0))
    if now - last < LOG_EVERY_SECONDS:
        _logged[dependency] = (last, since + 1)
        return
    _logged[dependency] = (now, 0)
    more = f" ({since} more requests answered 503 since the last line)" if since else ""
    log.warning("%s unavailable on %s: %s%s", dependency, where, error, more)


def detail(dependency: str) -> str:
    what = "the database" if dependency == "database" else "the task broker"
    return f"{what} is unavailable; retry in a few seconds (GET /readyz says what is down)"


def answer(request: Request, dependency: str, exc: BaseException) -> Response:
    """The 503 for ``request`` during an outage of ``dependency``."""
    from zoopick.app.problems import problem_response

    _log_outage(dependency, f"{request.method} {request.url.path}", type(exc).__name__)
    # ZOOPICK_RETRY_AFTER_SECONDS, as for a busy database: a client's policy retries that
    headers = {"Retry-After": str(request.app.state.settings.retry_after_seconds)}
    if request.url.path.startswith(JSON_PREFIXES):
        return problem_response(
            request,
            503,
            detail(dependency),
            kind=f"{dependency}-unavailable",
            title="Service Unavailable",
            headers=headers,
            dependency=dependency,
        )
    return HTMLResponse(
        "<!doctype html><title>Service unavailable</title><h1>Service unavailable</h1>"
        f'<p role="alert">{detail(dependency)}.</p>'
        '<p>This page will work again once it is back: <a href="">reload</a>.</p>',
        status_code=503,
        headers=headers,
    )
