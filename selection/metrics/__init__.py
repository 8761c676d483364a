"""Transferability metrics, one module each, registered by name.

Importing this package imports every metric module so the registry is complete.
"""

from importlib import import_module

from zoopick.selection.metrics.registry import (
    MetricError,
    MetricSpec,
    available,
    get,
    needs,
    register,
    score,
)

# One module per metric; each registers itself on import.
_MODULES = (
    "sms",
    "leep",
    "nce",
    "logme",
    "hscore",
    "nleep",
    "gbc",
    "sfda",
    "transrate",
    "knn",
    "parc",
    "ncti",
    "fsms",
)
for _m in _MODULES:
    import_module(f"zoopick.selection.metrics.{_m}")

__all__ = ["MetricError", "MetricSpec", "available", "get", "needs", "register", "score"]
