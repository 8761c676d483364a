"""RFC 9457 problem details for every error the API returns.

Handlers turn our :class:`Problem`, Starlette's HTTP errors (404 for an unknown route, 405) and
request-validation errors into ``application/problem+json`` with ``type``, ``title``,
``status`` and ``detail``; anything unexpected becomes a 500 problem without internals.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from zoopick.service.inputs import clip

log = logging.getLogger(__name__)

MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:zoopick:problem:"


class ProblemDetail(BaseModel):
    """The body of every error response (RFC 9457)."""

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None


class Problem(Exception):
    """Raise from anywhere in a request to answer with a problem document.

    ``kind`` names the problem class (it becomes ``urn:zoopick:problem:<kind>``); ``extra``
    members are added to the body (RFC 9457 extensions), ``headers`` to the response.
    """

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        kind: str | None = None,
        title: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        phrase = HTTPStatus(status).phrase
        self.kind = kind or phrase.lower().replace(" ", "-").replace("'", "")
        self.title = title or phrase
        self.headers = headers or {}
        self.extra = extra


EVERY_API_CALL = (401, 429, 503)
"""What any authenticated, database-backed operation can answer: a missing or bad key, the
failed-authentication rate limit, no database connection free in time."""


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries declaring problem-details bodies for ``codes`` and for
    ``EVERY_API_CALL``."""
    every = sorted({*codes, *EVERY_API_CALL})
    return {code: {"model": ProblemDetail, "content": {MEDIA_TYPE: {}}} for code in every}


def problem_response(
    request: Request | None,
    status: int,
    detail: str,
    *,
    kind: str | None = None,
    title: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    p = Problem(status, detail, kind=kind, title=title, headers=headers, **extra)
    body: dict[str, Any] = {
        "type": TYPE_PREFIX + p.kind,
        "title": p.title,
        "status": p.status,
        "detail": clip(p.detail, MAX_DETAIL),
    }
    if request is not None:
        body["instance"] = request.url.path
    body.update(jsonable_encoder(p.extra))
    return JSONResponse(body, status_code=status, headers=p.headers, media_type=MEDIA_TYPE)


def busy() -> Problem:
    """503 for a request that found no database connection free in time: overload, not a
    bug (the pool's own timeout, or the wait for a session slot in ``deps.get_session``)."""
    return Problem(
        503,
        "the server is busy (no database connection free); retry shortly",
        kind="busy",
        headers={"Retry-After": "1"},
    )


MAX_DETAIL = 2000
"""Characters of a problem's ``detail``: whatever it quotes of the input, it stays small."""
MAX_ERRORS = 20
"""Validation errors listed (50,000 wrongly typed list items give 50,000 errors)."""
MAX_PART = 100
"""Characters of one part of an error's location, or of a message (a 200 kB key is echoed
in both)."""


def describe(err: dict[str, Any]) -> str:
    """One validation error as ``where: what`` (pydantic's ``Value error, `` prefix off)."""
    loc = ".".join(str(part) for part in err.get("loc", ()) if part != "body") or "request"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{loc}: {msg}"


def _bounded(err: dict[str, Any]) -> dict[str, Any]:
    """One validation error as the body lists it, each part clipped."""
    return {
        "loc": [p if isinstance(p, int) else clip(str(p), MAX_PART) for p in err.get("loc", ())],
        "msg": clip(str(err.get("msg", "")), 3 * MAX_PART),
        "type": err.get("type", ""),
    }


def install(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        headers, extra = dict(exc.headers), dict(exc.extra)
        if exc.status == 503:  # every 503 says when to come back (issue 43)
            headers.setdefault("Retry-After", str(request.app.state.settings.retry_after_seconds))
        if exc.kind == "broker-unavailable":
            extra.setdefault("dependency", "broker")
        return problem_response(
            request,
            exc.status,
            exc.detail,
            kind=exc.kind,
            title=exc.title,
            headers=headers,
            **extra,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 413:  # Starlette's body cap (FastAPI's max_body_size)
            limit = request.app.state.settings.body_max_bytes
            detail = f"the request body is over {limit} bytes (ZOOPICK_BODY_MAX_BYTES)"
        kind = getattr(exc, "kind", None)  # zoopick.app.bodies.BodyRefused names its own
        return problem_response(
            request, exc.status_code, detail, kind=kind, headers=dict(exc.headers or {})
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        every = exc.errors()
        errors = [_bounded(e) for e in every[:MAX_ERRORS]]
        detail = "; ".join(describe(e) for e in errors) or "invalid request"
        if len(every) > len(errors):
            detail += f"; and {len(every) - len(errors):,} more errors"
        return problem_response(
            request,
            422,
            detail,
            kind="validation-error",
            title="Request validation failed",
            errors=errors,
        )

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # a client that left mid-body (closed tab, cancelled upload): no one reads this answer
        from zoopick.app.bodies import GONE, client_gone

        if not request.scope.get(GONE):
            client_gone(request.scope)
        return Response(status_code=400)

    from sqlalchemy.exc import TimeoutError as PoolTimeout

    @app.exception_handler(PoolTimeout)
    async def _busy(request: Request, exc: PoolTimeout) -> JSONResponse:
        # every database connection of this process is busy: overload, not a bug; shed it
        p = busy()
        return problem_response(request, p.status, p.detail, kind=p.kind, headers=p.headers)

    from sqlalchemy.exc import DBAPIError

    from zoopick.app import outage

    async def _outage(request: Request, exc: Exception) -> Response:
        # the database or the broker stopped answering: 503 with Retry-After (app.outage)
        dependency = outage.dependency_down(exc)
        if dependency is not None:
            return outage.answer(request, dependency, exc)
        return await _unexpected(request, exc)

    # handled here, not by the catch-all below, which Starlette runs after re-raising
    for error in (DBAPIError, *outage.database_errors(), *outage.broker_errors()):
        app.add_exception_handler(error, _outage)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        dependency = outage.dependency_down(exc)
        if dependency is not None:  # wrapped in another error
            return outage.answer(request, dependency, exc)
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(
            request, 500, "internal error; the server log has the details", kind="internal"
        )
