"""zoopick's selection engine: rank a zoo of pretrained timm models for a target dataset
without training any of them. A plain library: no web code."""

from zoopick.selection.metrics import MetricError, available, needs, score

__all__ = ["MetricError", "available", "needs", "score"]
