"""Per-iteration communication accounting shared by every hook.

Each hook call adds to the record of the current training iteration; the record is closed when
DDP hands over its last bucket (``bucket.is_last()``). Records are plain dicts so tests,
benchmarks and a dashboard can serialise them as they are.

Byte counts are what *this* worker puts on and takes off the wire under the usual bandwidth
model of each primitive: point-to-point messages count exactly; an all-gather counts the own
(padded) payload once per other worker sent and every other worker's payload received (the
ring / direct algorithm); an all-reduce of ``b`` bytes counts ``2 (P - 1) / P * b`` each way
(ring reduce-scatter + all-gather). Headers (size exchanges) are included.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

FIELDS = ("bytes_sent", "bytes_recv", "select_s", "comm_s", "numel", "nnz", "buckets")


DENSE_ELEMENT_BYTES = 4
"""A gradient element as DDP's default all-reduce sends it (float32)."""


def dense_allreduce_bytes(numel: float, world: int) -> float:
    """What this worker would put on the wire to all-reduce ``numel`` float32 gradient
    elements densely (a ring: ``2 (P - 1) / P`` of the payload, as the dense hook counts it):
    the baseline a sparse hook's ``bytes_sent`` is measured against."""
    return DENSE_ELEMENT_BYTES * numel * 2 * (world - 1) / world if world > 1 else 0.0


def empty_record(iteration: int) -> dict[str, float]:
    rec: dict[str, float] = {"iteration": iteration}
    rec.update(dict.fromkeys(FIELDS, 0))
    rec["select_s"] = 0.0
    rec["comm_s"] = 0.0
    return rec


def sum_stats(records: Iterable[dict[str, float]]) -> dict[str, float]:
    """Field-wise sum of per-iteration records (``iterations`` = how many were summed)."""
    total: dict[str, float] = dict.fromkeys(FIELDS, 0)
    total["select_s"] = 0.0
    total["comm_s"] = 0.0
    count = 0
    for rec in records:
        count += 1
        for f in FIELDS:
            total[f] += rec.get(f, 0)
    total["iterations"] = count
    return total


class CommStats(list):
    """The list of finished per-iteration records plus the one being filled (``current``).

    Each record: ``iteration``, ``bytes_sent``, ``bytes_recv``, ``select_s``, ``comm_s``,
    ``numel`` (gradient elements handled), ``nnz`` (non-zeros in the applied update as
    exchanged: pairs or block values) and ``buckets`` (hook calls)."""

    def __init__(self, sync_cuda: bool = True) -> None:
        super().__init__()
        self.current: dict[str, float] | None = None
        self.sync_cuda = sync_cuda
        self._device: torch.device | None = None

    def begin(self, iteration: int, device: torch.device) -> dict[str, float]:
        """Open the record for ``iteration`` unless one is already open."""
        self._device = device
        if self.current is None:
            self.current = empty_record(iteration)
        return self.current

    def finish(self) -> None:
        """Close the current record (called after the last bucket of an iteration)."""
        if self.current is not None:
            self.append(self.current)
            self.current = None

    def add(self, **amounts: float) -> None:
        if self.current is None:
            raise RuntimeError("CommStats.add outside an iteration")
        for key, value in amounts.items():
            self.current[key] += value

    def _sync(self) -> None:
        dev = self._device
        if self.sync_cuda and dev is not None and dev.type == "cuda":
            torch.cuda.synchronize(dev)

    @contextmanager
    def timer(self, field: str) -> Iterator[None]:
        """Add the wall time of the block to ``field`` (``select_s`` or ``comm_s``); on CUDA
        the device is synchronised at both ends so queued kernels are charged to the block."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.add(**{field: time.perf_counter() - start})

    def reset(self) -> None:
        """Forget finished records (an open record keeps being filled)."""
        self.clear()

    def total(self, last: int | None = None) -> dict[str, float]:
        """Sum of the finished records, or of the ``last`` ones."""
        recs = list(self) if last is None else list(self)[-last:]
        return sum_stats(recs)
