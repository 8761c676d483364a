"""Transferability metrics, one module each, registered by name.

Importing this package imports every metric module so the registry is complete.
"""

from importlib import import_module

from selection.metrics.registry import (
    MetricError,
    MetricSpec,
    available,
    get,
    needs,
    register,
    score,
)

# One module per metric; each registers itself on import.
_MODULES = ("sms", "leep", "nce", "logme", "hscore", "nleep", "gbc", "sfda", "transrate", "knn")
for _m in _MODULES:
    try:
        import_module(f"selection.metrics.{_m}")
    except ModuleNotFoundError as _e:  # a metric not written yet must not break the others
        if _e.name != f"selection.metrics.{_m}":
            raise

__all__ = ["MetricError", "MetricSpec", "available", "get", "needs", "register", "score"]
