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
from typing import Any

import torch

from zoopick.training.comm import hostread
from zoopick.training.comm.hostread import Deferred

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
    """The most recent finished per-iteration records (at most ``keep``), the one being filled
    (``current``), and ``cumulative``: the field-wise sum of every record ever finished
    (``cumulative["iterations"]`` counts them), so a long run's memory stays bounded while
    totals over any span stay exact (difference of two ``cumulative`` snapshots).

    Each record: ``iteration``, ``bytes_sent``, ``bytes_recv``, ``select_s``, ``comm_s``,
    ``numel`` (gradient elements handled), ``nnz`` (non-zeros in the applied update as
    exchanged: pairs or block values) and ``buckets`` (hook calls).

    Timing: on the CPU, wall time. On CUDA the default (``sync_cuda=False``) records a pair
    of CUDA events around each timed block and never waits for the device; the elapsed
    times are added to their records when the events have completed (checked without
    blocking at every ``finish``; :meth:`resolve` waits for the rest and is called by
    :meth:`total`). ``sync_cuda=True`` synchronises the device at both ends of each block
    instead (exact wall time per block, but it stalls the GPU: benchmarks of one block only).
    The CUDA paths ran on an H100 (``tests/test_comm_cuda.py``, skipped where no GPU is).

    Amounts given as tensors (e.g. a pair count that only the device knows) are not read at
    ``add``: they are kept as :class:`~zoopick.training.comm.hostread.Deferred` values and
    added to their record at ``finish`` on a CPU; on an accelerator ``finish`` adds those whose
    non-blocking copies have landed and :meth:`resolve` waits for the rest (the same place the
    CUDA timing events are waited for), so counting never stalls and what is pending stays
    bounded by what the device has not yet reached."""

    def __init__(self, sync_cuda: bool = False, keep: int = 1000) -> None:
        super().__init__()
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.current: dict[str, float] | None = None
        self.sync_cuda = sync_cuda
        self.keep = keep
        self.cumulative: dict[str, float] = sum_stats([])
        self._device: torch.device | None = None
        # (record, field, start event, end event) not yet added to their record
        self._pending: list[tuple[dict[str, float], str, object, object]] = []
        # (record, field, value) given as tensors, not yet added to their record; field None:
        # a vector of every field (FIELDS order), a running total's snapshot (``follow``)
        self._deferred: list[tuple[dict[str, float], str | None, Deferred]] = []
        # device vectors (FIELDS order) that CUDA graphs add their replays' amounts to
        self._running: list[torch.Tensor] = []

    def begin(self, iteration: int, device: torch.device) -> dict[str, float]:
        """Open the record for ``iteration`` unless one is already open."""
        self._device = device
        if self.current is None:
            self.current = empty_record(iteration)
        return self.current

    def finish(self) -> None:
        """Close the current record (called after the last bucket of an iteration)."""
        if self.current is None:
            return
        rec = self.current
        dev = self._device
        for totals in self._running:  # this iteration's replays' amounts, then from zero
            self._deferred.append((rec, None, Deferred(totals)))
            totals.zero_()
        # on a CPU nothing is waited for; on an accelerator only the values whose copies
        # have already landed are read, so pending values stay bounded without a stall
        self._read_deferred(only_ready=dev is not None and dev.type != "cpu")
        self.current = None
        self.append(rec)
        for f in FIELDS:
            self.cumulative[f] += rec.get(f, 0)
        self.cumulative["iterations"] += 1
        if len(self) > self.keep:
            del self[: len(self) - self.keep]
        self._resolve(block=False)

    def follow(self, totals: torch.Tensor) -> None:
        """Count ``totals`` too: a device vector with one element per field (``FIELDS``
        order) that work the host does not see adds to (a CUDA graph's replays add their
        tensor amounts to it in the graph itself, ``graphs.py``: no host work a replay). Each
        ``finish`` adds what it holds to the record being closed, read like any tensor
        amount, and sets it back to zero behind that read on the device."""
        if not any(t is totals for t in self._running):
            self._running.append(totals)

    def add(self, **amounts: float) -> None:
        if self.current is None:
            raise RuntimeError("CommStats.add outside an iteration")
        for key, value in amounts.items():
            if isinstance(value, torch.Tensor):
                self._deferred.append((self.current, key, Deferred(value)))
            else:
                self.current[key] += value

    def _read_deferred(self, only_ready: bool = False) -> None:
        left = []
        for rec, field, value in self._deferred:
            if only_ready and not value.ready():
                left.append((rec, field, value))
                continue
            amount = value.get()
            parts = zip(FIELDS, amount, strict=True) if field is None else [(field, amount)]
            for name, part in parts:
                rec[name] += part
                if rec is not self.current:  # already summed into the cumulative total
                    self.cumulative[name] += part
        self._deferred = left

    def _sync(self) -> None:
        dev = self._device
        if self.sync_cuda and dev is not None and dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def _events(self) -> bool:
        dev = self._device
        return not self.sync_cuda and dev is not None and dev.type == "cuda"

    @contextmanager
    def timer(self, field: str) -> Iterator[None]:
        """Add the time of the block to ``field`` (``select_s`` or ``comm_s``): wall time on
        the CPU, CUDA event time (no host wait) on a GPU; see the class docstring."""
        if self._events():
            rec = self.current
            if rec is None:
                raise RuntimeError("CommStats.timer outside an iteration")
            start = hostread.recorded_event(self._device, timing=True)
            try:
                yield
            finally:
                end = hostread.recorded_event(self._device, timing=True)
                self.add_elapsed(field, start, end)
            return
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.add(**{field: time.perf_counter() - t0})

    def add_elapsed(self, field: str, start: Any, end: Any) -> None:
        """Add to ``field`` of the current record the time between two recorded CUDA
        events, once the device has passed them (what :meth:`timer` does on CUDA; a CUDA
        graph's timed replays hand their events here too, ``graphs.py``)."""
        rec = self.current
        if rec is None:
            raise RuntimeError("CommStats.add_elapsed outside an iteration")
        self._pending.append((rec, field, start, end))

    def _resolve(self, block: bool) -> None:
        """Add the elapsed times of completed event pairs (all of them with ``block``)."""
        left = []
        for rec, field, start, end in self._pending:
            if not block and not end.query():  # type: ignore[attr-defined]
                left.append((rec, field, start, end))
                continue
            end.synchronize()  # type: ignore[attr-defined]
            seconds = start.elapsed_time(end) / 1000.0  # type: ignore[attr-defined]
            rec[field] += seconds
            if rec is not self.current:  # already summed into the cumulative total
                self.cumulative[field] += seconds
        self._pending = left

    def resolve(self) -> None:
        """Wait for the outstanding CUDA timing events and add their times, and read the
        deferred counts (a host sync: call it where one is harmless, e.g. at the end of an
        epoch)."""
        self._resolve(block=True)
        self._read_deferred()

    def reset(self) -> None:
        """Forget finished records (an open record keeps being filled; ``cumulative`` too)."""
        self.clear()

    def total(self, last: int | None = None) -> dict[str, float]:
        """Sum of the kept finished records, or of the ``last`` ones."""
        self.resolve()
        recs = list(self) if last is None else list(self)[-last:]
        return sum_stats(recs)
