"""The dataset error family, in a module of its own so the readers (``data``, ``archives``,
``npzfile``) and the limits can all raise it without importing each other."""

from __future__ import annotations

__all__ = ["DatasetError", "LimitExceeded"]


class DatasetError(ValueError):
    """A target dataset cannot be used (the message names the file or member at fault)."""


class LimitExceeded(DatasetError):
    """A dataset is over one of its :class:`~zoopick.selection.limits.DatasetLimits` (the
    message names the limit)."""
