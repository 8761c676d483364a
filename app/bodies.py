"""Bounds on every request body the app reads whole (JSON and forms, API and dashboard): its
size (``ZOOPICK_BODY_MAX_BYTES``) and, for JSON, how deeply it nests (:data:`JSON_MAX_DEPTH`).

A pure ASGI middleware wraps ``receive``: a ``Content-Length`` over the cap is refused
before a byte is read, a chunked body as it passes the cap, and a JSON body that nests too
deep when its last chunk arrives, before the route parses it. Free-form JSON nested hundreds
deep parses, but then overflows pydantic's serialiser or the recursion limit (a 500): the
depth is measured first, at C speed (strings removed by one regex, brackets summed by numpy).
Each refusal is a :class:`BodyRefused` (an HTTP exception: FastAPI lets it through its body
parsing), which ``problems`` answers as a problem document; Starlette's own cap (FastAPI's
``max_body_size``) is not used, as it answers a bare text/plain 413 when a route answers
before reading the body.

Routes that stream their body themselves (uploads, with ``max_body_size=UNCAPPED_BODY``:
they count every byte against ``ZOOPICK_UPLOAD_MAX_BYTES`` in :mod:`zoopick.app.uploads`)
are told apart by the cap that route sets in the scope when it is entered.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

JSON_MAX_DEPTH = 32
"""Deepest nesting of arrays and objects a JSON body may have (every schema of the API needs
fewer than 8 levels; free-form ``hook_options`` values are scalars)."""
NO_BODY = frozenset({"GET", "HEAD", "OPTIONS"})

_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.S)
"""A string, escapes and all; possessive, and one left open runs to the end of the body, so
every match that starts succeeds without backtracking: linear time whatever the body (a
pattern that can fail after scanning, as ``"(?:\\.|[^"])*"`` on an unterminated ``"\\"\\"...``,
is tried again from every quote in it: quadratic, seconds for 32 KB)."""
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deeply ``body`` nests arrays and objects, brackets inside strings not counted (or,
    with no more than ``JSON_MAX_DEPTH`` brackets opened in all, that number: a bound).
    Linear, and approximate only for text that is no JSON (which the route then refuses)."""
    skeleton = _STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    opened = skeleton.count(b"[") + skeleton.count(b"{")
    if opened <= JSON_MAX_DEPTH:  # every body of the API: no numpy in the API process
        return opened
    import numpy as np

    opens = np.frombuffer(skeleton, dtype=np.uint8)
    steps = np.where((opens == ord("[")) | (opens == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


class _NotStrict(ValueError):
    pass


def _no_constants(name: str) -> None:
    raise _NotStrict(f"{name} is not a JSON value (JSON has no NaN or Infinity)")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise _NotStrict(f"the key {key[:MAX_KEY]!r} appears twice in one JSON object")
        seen[key] = value
    return seen


MAX_KEY = 100
"""Characters of one key quoted in a message (a 200 kB key would be echoed whole)."""


class _HugeInt:
    """Stands in for an integer too long for Python to convert (its ``int max str digits``
    limit), so that a second parse goes on and the field holding it can be named."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _where_huge(value: object, path: tuple[str | int, ...] = ()) -> tuple[str, int] | None:
    """(location, digits) of the first :class:`_HugeInt` in a parsed body (its depth is
    bounded by :data:`JSON_MAX_DEPTH` before this runs), or None."""
    if isinstance(value, _HugeInt):
        return ".".join(str(part)[:MAX_KEY] for part in path) or "the body", value.digits
    if isinstance(value, dict):
        items = iter(value.items())
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _where_huge(item, (*path, key))
        if found:
            return found
    return None


def _huge_int(body: bytes, limit: int) -> str | None:
    """Where ``body`` has an integer of over ``limit`` digits, as a problem's detail."""
    import json

    def parse_int(text: str) -> int | _HugeInt:
        digits = len(text) - text.startswith("-")
        return _HugeInt(digits) if digits > limit else int(text)

    try:
        parsed = json.loads(
            body, parse_constant=_no_constants, object_pairs_hook=_unique_keys, parse_int=parse_int
        )
    except _NotStrict as exc:  # what the first parse did not reach
        return str(exc)
    except ValueError:
        return None
    found = _where_huge(parsed)
    if found is None:
        return None
    where, digits = found
    return (
        f"{where}: an integer of {digits} digits is too large to read "
        f"(at most {limit} digits; no field takes anything near that)"
    )


def not_strict_json(body: bytes) -> str | None:
    """Why ``body`` is JSON the API refuses although Python's parser (FastAPI's) reads it,
    or None: ``NaN`` and ``Infinity``, which are no JSON (a NaN ``lr`` was then refused as
    "not less than or equal to 10"), and a key given twice in one object, which the parser
    reads as its last value without a word (``{"epochs": 500, "epochs": 1}`` ran 1 epoch).
    Also an integer longer than Python converts (``sys.get_int_max_str_digits()``, 4300
    digits), on which the parser gives up without saying where ("There was an error parsing
    the body"): the field is named. A body that is no JSON at all is left to the route, which
    names where it breaks."""
    import json
    import sys

    try:
        json.loads(body, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except _NotStrict as exc:
        return str(exc)
    except ValueError as exc:  # not JSON (or not UTF-8): FastAPI's own message
        limit = sys.get_int_max_str_digits()
        if limit and "integer string conversion" in str(exc):
            return _huge_int(body, limit)  # parsed again, only for such a body
        return None
    return None


def _is_json(scope: Scope) -> bool:
    """JSON, or no content type at all (FastAPI parses a body without one as JSON)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value[:19]) if value.isdigit() else None  # 19 digits: enough to refuse
    return None


GONE = "zoopick.client_gone"
"""Scope key set once a client's leaving was logged (so it is logged once)."""


def client_gone(scope: Scope, size: int | None = None) -> None:
    """The one info line for a client that left mid-body: an expected event, no traceback."""
    scope[GONE] = True
    client = scope.get("client")
    read = f" ({size} bytes read)" if size is not None else ""
    log.info(
        "client %s went away while sending the body of %s %s%s",
        client[0] if client else "?", scope["method"], scope["path"], read,
    )  # fmt: skip


class BodyRefused(HTTPException):
    """A body over a bound; ``kind`` names the problem class."""

    def __init__(self, status: int, detail: str, kind: str) -> None:
        super().__init__(status_code=status, detail=detail)
        self.kind = kind


class BodyBounds:
    """The middleware; ``limit`` is ``ZOOPICK_BODY_MAX_BYTES``."""

    def __init__(self, app: ASGIApp, *, limit: int) -> None:
        self.app = app
        self.limit = limit

    def too_large(self) -> BodyRefused:
        return BodyRefused(
            413,
            f"the request body is over {self.limit} bytes (ZOOPICK_BODY_MAX_BYTES)",
            "request-entity-too-large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in NO_BODY:
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        size = 0
        chunks: list[bytes] = []
        done = False  # the whole body is in: a disconnect now is a client leaving normally

        async def bounded() -> Message:
            nonlocal size, done
            limit = scope.get(MAX_BODY_SIZE_SCOPE_KEY) or self.limit
            if limit > self.limit:  # a route that streams and caps its own body
                return await receive()
            if length is not None and length > limit:
                raise self.too_large()
            message = await receive()
            if message["type"] == "http.disconnect" and not done and not scope.get(GONE):
                client_gone(scope, size)
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise self.too_large()
            done = not message.get("more_body", False)
            if _is_json(scope):
                chunks.append(chunk)
                if not message.get("more_body", False):
                    body = b"".join(chunks)
                    chunks.clear()
                    depth = json_depth(body)
                    if depth > JSON_MAX_DEPTH:
                        raise BodyRefused(
                            422,
                            f"the JSON body is nested deeper than {JSON_MAX_DEPTH} levels "
                            f"({depth})",
                            "json-too-deep",
                        )
                    problem = not_strict_json(body)
                    if problem:
                        raise BodyRefused(422, problem, "json-not-strict")
            return message

        await self.app(scope, bounded, send)


def install(app: FastAPI, limit: int) -> None:
    app.add_middleware(BodyBounds, limit=limit)
