"""Deferred host reads: the one sanctioned way for a hook to read a tensor's value.

On an accelerator, reading a value that the device computes (``.item()``, ``.tolist()``,
``int(t)``, ``if t:``) or running an op whose output size depends on the data
(``nonzero``, ``unique``, boolean-mask indexing) makes the host wait until the device has
caught up: a host sync, which stops the backward pass from running ahead of the
communication. The hooks' steady state therefore keeps counts and thresholds' inputs on
the device and sends fixed-capacity payloads (padding inside the payload). The few values a
scheme needs on the host to size or steer the *next* iteration (exdyna's threshold and
partitions, spardl's cross-team share, dfs's block size, the pair counts in the stats) are
wrapped in a :class:`Deferred` when they are produced and read when they are next needed,
one iteration later, inside :func:`sanctioned`, which the host-sync guard of the tests
(``tests/host_sync_guard.py``) lets through.

Limit: no accelerator has been available to this project. On a CPU nothing can stall. On
CUDA, :meth:`Deferred.get` is a plain ``.tolist()`` of a device tensor, i.e. still a sync,
only one iteration late; the non-blocking form (a pinned host buffer filled with
``copy_(non_blocking=True)`` and a ``torch.cuda.Event`` queried before the read) belongs in
this class and nowhere else, and is left out until it can be run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_local = threading.local()


@contextmanager
def sanctioned() -> Iterator[None]:
    """Mark the host reads inside as deliberate (deferred values, checkpoints)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def reading() -> bool:
    """Whether the calling thread is inside :func:`sanctioned`."""
    return getattr(_local, "depth", 0) > 0


class Deferred:
    """A snapshot of a device tensor, to be read on the host later (see the module doc)."""

    __slots__ = ("_value",)

    def __init__(self, value: torch.Tensor) -> None:
        self._value = value.detach().clone()

    def get(self) -> Any:
        """The value as Python numbers (``tolist``)."""
        with sanctioned():
            return self._value.tolist()
