"""Rank 0's live progress lines: which phase the run is in and, during an epoch, the step
reached with the running mean loss and accuracy so far (``RunEvent("progress")``).

Why here and not in the loop: the loop keeps its sums on the device, so a step never waits for
the GPU; only a report (about ``POINTS_PER_EPOCH`` times an epoch, and at most every
``MIN_INTERVAL`` seconds) reads them on the host. A run on the CPU pays nothing either way.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import torch

from zoopick.training.config import RunEvent, finite_or_none

POINTS_PER_EPOCH = 10
"""Sub-epoch points per epoch at most (the curve of a long epoch moves between its ends)."""
MIN_INTERVAL = 0.5
"""Seconds between two step reports at least: a fast run does not flood the service."""


class Reporter:
    """Emits progress events for rank 0 (other ranks hold a silent one)."""

    def __init__(self, emit: Callable[[RunEvent], None], *, active: bool) -> None:
        self.emit = emit
        self.active = active
        self.host = socket.gethostname()
        self._last = float("-inf")

    def phase(self, name: str, **fields: int) -> None:
        """Say the run entered ``name`` (loading data, evaluating, saving the model...)."""
        if self.active:
            self.emit(RunEvent("progress", phase=name, host=self.host, **fields))

    def due(self, step: int, first: int, last: int) -> bool:
        """Whether step ``step`` (0-based, of ``first``..``last - 1``) is one to report: every
        ``(last - first) / POINTS_PER_EPOCH`` steps, never the epoch's last (its record
        follows), and not sooner than ``MIN_INTERVAL`` after the previous report."""
        if not self.active or step + 1 >= last:
            return False
        every = max(1, (last - first) // POINTS_PER_EPOCH)
        if (step + 1 - first) % every:
            return False
        return time.monotonic() - self._last >= MIN_INTERVAL

    def step(
        self,
        *,
        epoch: int,
        epochs: int,
        step: int,
        steps: int,
        loss_sum: torch.Tensor,
        correct: torch.Tensor,
        seen: int,
    ) -> None:
        """Report ``step`` steps of epoch ``epoch`` (1-based) done, with rank 0's running
        means: the one host read of the device sums per report."""
        self._last = time.monotonic()
        sums = torch.stack([loss_sum, correct]).tolist()
        self.emit(
            RunEvent(
                "progress",
                phase="training",
                host=self.host,
                epoch=epoch,
                epochs=epochs,
                step=step,
                steps=steps,
                # a diverging run's running loss is NaN until its epoch ends in Diverged: a
                # report due before then writes it as unknown, never a bare NaN in the file
                loss=finite_or_none(sums[0] / max(seen, 1)),
                train_acc=finite_or_none(sums[1] / max(seen, 1)),
            )
        )
