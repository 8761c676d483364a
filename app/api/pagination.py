"""Keyset pagination with opaque page tokens.

Lists are ordered newest first by (created_at, id); a token encodes the last item's key, so a
page is a range query (stable under inserts, no OFFSET scans). Tokens are base64url JSON: opaque
to clients, not secret (the tenant filter, not the token, protects other tenants' rows).
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, Uuid, and_, or_
from sqlalchemy.orm import Session

from zoopick.app.problems import Problem
from zoopick.service.settings import Settings


def encode(created_at: datetime, id_: uuid.UUID | str) -> str:
    raw = json.dumps({"c": created_at.isoformat(), "i": str(id_)}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def invalid_token() -> Problem:
    return Problem(
        400,
        "invalid page_token: pass the next_page_token of a previous page unchanged",
        kind="invalid-page-token",
    )


MAX_TOKEN_CHARS = 512
"""Longest page token read: one this service writes is about 120 characters; a longer one is
refused before it is decoded (a crafted one of nested JSON arrays would otherwise reach the
parser's recursion limit)."""


def decode(token: str) -> tuple[datetime, str]:
    """The (created_at in UTC, id) a token encodes. The time is converted to UTC here, where a
    crafted offset near the ends of the calendar (``0001-01-01T00:00:00+14:00``) overflows as
    a 400 instead of deep in the column type as a 500."""
    if len(token) > MAX_TOKEN_CHARS:
        raise invalid_token()
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        created = datetime.fromisoformat(data["c"])
        if created.tzinfo is None:
            raise ValueError("naive time")
        return created.astimezone(UTC), str(data["i"])
    except (ValueError, KeyError, TypeError, OverflowError, AttributeError, RecursionError):
        raise invalid_token() from None


def page(
    stmt: Select[Any],
    model: Any,
    token: str | None,
    size: int,
    *,
    uuid_ids: bool = True,
    oldest_first: bool = False,
) -> Select[Any]:
    """``stmt`` restricted to the page after ``token``, newest first (or oldest first), one
    row extra (to know whether another page follows)."""
    if token:
        created, last = decode(token)
        try:
            last_id: Any = uuid.UUID(last) if uuid_ids else last
        except ValueError:
            raise invalid_token() from None
        if oldest_first:
            after = or_(
                model.created_at > created, and_(model.created_at == created, model.id > last_id)
            )
        else:
            after = or_(
                model.created_at < created, and_(model.created_at == created, model.id < last_id)
            )
        stmt = stmt.where(after)
    if oldest_first:
        return stmt.order_by(model.created_at.asc(), model.id.asc()).limit(size + 1)
    return stmt.order_by(model.created_at.desc(), model.id.desc()).limit(size + 1)


def split(rows: list[Any], size: int) -> tuple[list[Any], str | None]:
    """(items of this page, token of the next page or None)."""
    if len(rows) <= size:
        return rows, None
    items = rows[:size]
    return items, encode(items[-1].created_at, items[-1].id)


def list_page(
    session: Session,
    stmt: Select[Any],
    model: Any,
    *,
    token: str | None,
    page_size: int | None,
    settings: Settings,
    out: Callable[[Any], Any],
    oldest_first: bool = False,
) -> dict[str, Any]:
    """One page of ``stmt`` (newest first) as ``{"items": [...], "next_page_token": ...}``:
    the body of every list endpoint. ``page_size`` is capped by the settings; ``out`` turns a
    row into its response item."""
    size = min(page_size or settings.page_size_default, settings.page_size_max)
    uuid_ids = isinstance(model.__table__.c.id.type, Uuid)
    stmt = page(stmt, model, token, size, uuid_ids=uuid_ids, oldest_first=oldest_first)
    rows = list(session.scalars(stmt))
    items, next_token = split(rows, size)
    return {"items": [out(row) for row in items], "next_page_token": next_token}
