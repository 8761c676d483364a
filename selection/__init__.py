"""zoopick's selection engine: rank a zoo of pretrained timm models for a target dataset
without training any of them. A plain library: no web code.

The metric names below are loaded on first use: importing a light submodule (``ties``,
``limits``) must not pull in the metrics' numpy, scipy and scikit-learn, which the API would
otherwise pay for on the first poll of every process.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["MetricError", "available", "needs", "score"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module("zoopick.selection.metrics"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
