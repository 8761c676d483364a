"""Rules every request body shares, whichever face it came through: no NUL characters
(PostgreSQL's text and jsonb cannot store one; unchecked, it surfaces as a 500 at insert),
and messages that quote the input quote a bounded part of it (100,000 unknown model ids
once came back as a 989 KB error)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, model_validator


def nul_path(value: Any, where: str) -> str | None:
    """The location of the first string holding a NUL character, at any depth."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, str):
        return where if "\x00" in value else None
    if isinstance(value, dict):
        for k, v in value.items():
            found = nul_path(k, where) or nul_path(v, f"{where}.{k}")
            if found:
                return found
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = nul_path(v, f"{where}[{i}]")
            if found:
                return found
    return None


class NoNulModel(BaseModel):
    """A request body whose strings, at any depth, may not contain NUL (422 naming the field)."""

    @model_validator(mode="after")
    def _no_nul(self) -> NoNulModel:
        for name in type(self).model_fields:
            found = nul_path(getattr(self, name), name)
            if found:
                raise ValueError(f"{found} contains a NUL character")
        return self


QUOTED_ITEMS = 10
QUOTED_CHARS = 100


def quoted(values: Sequence[Any], limit: int = QUOTED_ITEMS) -> str:
    """``values`` for a message: the first ``limit`` of them, each ``repr``'d and clipped to
    ``QUOTED_CHARS``, then how many more there are."""
    shown = [clip(repr(v), QUOTED_CHARS) for v in values[:limit]]
    more = len(values) - len(shown)
    return ", ".join(shown) + (f" and {more:,} more" if more > 0 else "")


def clip(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with a note of how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit:,} characters more)"
