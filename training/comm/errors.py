"""The error type of the communication package."""

from __future__ import annotations


class CommError(ValueError):
    """Bad hook name, unknown or invalid option, or a configuration the scheme cannot run
    (e.g. SparDL teams that do not divide the number of workers)."""
