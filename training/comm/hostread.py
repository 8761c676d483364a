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

On CUDA a :class:`Deferred` copies its value into pinned host memory with
``copy_(non_blocking=True)`` on the current stream and records an event behind the copy
(:func:`recorded_event`); :meth:`Deferred.get` one iteration later finds the event
complete (the device has long finished the copy) and reads the host buffer without
waiting. Only if the device is still behind does ``get`` wait for that one event (never for
the whole device), and :meth:`Deferred.ready` lets a caller that can postpone the read avoid
even that.
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


def recorded_event(device: torch.device, *, timing: bool = False) -> torch.Event:
    """An event recorded on ``device``'s current stream: the one way the hooks make one.
    ``torch.Event`` records in C++, where ``torch.cuda.Event.record()`` first looks the
    current stream up in Python and builds a ``Stream`` object for it: 30-70 us of host time
    a record on issue 19's GPU host (session 21's run, `event record`), spent on the thread
    that launches the backward pass."""
    event = torch.Event(device=device, enable_timing=timing)
    event.record()
    return event


class Deferred:
    """A snapshot of a tensor, to be read on the host later (see the module doc)."""

    __slots__ = ("_event", "_value")

    def __init__(self, value: torch.Tensor) -> None:
        value = value.detach()
        self._event: torch.Event | None = None
        if value.is_cuda:
            host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=True)
            host.copy_(value, non_blocking=True)
            self._event = recorded_event(value.device)
            self._value = host
        else:
            self._value = value.clone()

    def ready(self) -> bool:
        """Whether :meth:`get` can read without waiting for the device."""
        return self._event is None or self._event.query()

    def get(self) -> Any:
        """The value as Python numbers (``tolist``); waits for the copy only if the device has
        not reached it yet."""
        with sanctioned():
            if self._event is not None:
                self._event.synchronize()
            return self._value.tolist()
