"""The error type of the communication package: defined, torch-free, beside the hooks' option
models (``training.comm_options``), so a bad option is the same error whether the API
checked it without torch or ``make_hook`` did.

``CommError`` (a ``ValueError``): a bad hook name, an unknown or invalid option, or a
configuration the scheme cannot run (e.g. SparDL teams that do not divide the number of
workers)."""

from __future__ import annotations

from zoopick.training.comm_options import CommError

__all__ = ["CommError"]
