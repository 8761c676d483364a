"""Error feedback, the bucket's zeroing and the grouped scan's maxima in one chunked pass.

On the CPU the driver of a sparse hook reads the bucket's gradient to form
``acc = residual + gradient``; the selection later reads ``acc`` twice more per block (the
``amax`` and ``amin`` of ``select.grouped_positions``), and the driver writes the whole bucket
once more (zeros, before the sparse average is added in). Done one after another these are
four passes over tens of MB that have left the core's cache in between. ``accumulate`` runs
them chunk by chunk over the columns of each block's ``(GROUP_ROWS, m)`` grid: the slice of
``acc`` just summed is still cached when its column maxima are taken, and the slice of the
gradient just read is zeroed while cached. What is left is the one pass error feedback needs.

A :class:`Prescan` keeps, per block, the largest ``|acc|`` of each column (the maxima
``grouped_positions`` would compute itself). When the scheme changes ``acc`` before it
selects, a stored maximum may be stale: where values shrank (pairs taken out of the residual,
unused parameters held out) it is too high, which only makes the scan look at a column it
could have skipped; where values may have grown (received pairs added) the scheme calls
:meth:`Prescan.touch`, which sets those columns' maxima to infinity so they are always
scanned. The positions a scan finds are therefore exactly those of a fresh one.

A CPU path (``select.cpu_shortcut``, ``select.CPU_GROUPED``): the driver uses it only for
states whose ``scan_spans`` names the blocks (the schemes whose sum is a ``PairSum``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zoopick.training.comm.select import GROUP_ROWS

CHUNK_COLUMNS = 8192
"""Grid columns per chunk (64K elements: the chunk of ``acc`` and of the gradient stay in a
core's L2 cache); measured 9.5 ms against 13.1 for the separate passes on a 7.2M-element
bucket of two blocks on one core."""


class Prescan:
    """Per block ``(lo, hi)`` of the bucket, the column maxima of ``|acc[lo:hi]|`` viewed as
    ``GROUP_ROWS`` rows (see the module docstring)."""

    def __init__(self, maxima: dict[tuple[int, int], torch.Tensor]) -> None:
        self.maxima = maxima

    def peaks(self, lo: int, hi: int) -> torch.Tensor | None:
        """The column maxima of block ``[lo, hi)``, or None when it was not scanned."""
        return self.maxima.get((lo, hi))

    def touch(self, idx: torch.Tensor) -> None:
        """Values of ``acc`` at positions ``idx`` may have grown: scan their columns."""
        if not idx.numel():
            return
        idx = idx.long()
        for (lo, hi), peaks in self.maxima.items():
            inside = idx[(idx >= lo) & (idx < hi)]  # boolean indexing: a CPU-only path
            if inside.numel():
                peaks.index_fill_(0, (inside - lo) % peaks.numel(), float("inf"))

    def changed(self, lo: int, hi: int) -> None:
        """Values of ``acc[lo:hi]`` changed otherwise (an unused parameter's residual held
        out, zeroed): nothing to do, a maximum too high only costs a column's look."""


def _add_zero(acc: torch.Tensor, grad: torch.Tensor) -> None:
    """``acc += grad; grad = 0`` over 1-d slices, chunk by chunk."""
    step = CHUNK_COLUMNS * GROUP_ROWS
    for c0 in range(0, acc.numel(), step):
        acc[c0 : c0 + step].add_(grad[c0 : c0 + step])
        grad[c0 : c0 + step].zero_()


def accumulate(acc: torch.Tensor, grad: torch.Tensor, spans: Sequence[tuple[int, int]]) -> Prescan:
    """``acc += grad`` and ``grad.zero_()`` (1-d float32 tensors of one size, ``grad`` spent
    afterwards), with the column maxima of every block in ``spans`` (disjoint ``(lo, hi)``)
    taken while each chunk is cached. The sums are the ones ``acc.add_(grad)`` gives."""
    maxima: dict[tuple[int, int], torch.Tensor] = {}
    low = torch.empty(CHUNK_COLUMNS, dtype=acc.dtype, device=acc.device)
    done = 0
    for lo, hi in sorted(spans):
        if lo < done or hi > acc.numel():
            raise ValueError(f"spans must be disjoint and inside {acc.numel()}: {sorted(spans)}")
        _add_zero(acc[done:lo], grad[done:lo])
        cols = (hi - lo) // GROUP_ROWS
        body = lo + GROUP_ROWS * cols
        grid = acc[lo:body].view(GROUP_ROWS, cols)
        spent = grad[lo:body].view(GROUP_ROWS, cols)
        peaks = torch.empty(cols, dtype=acc.dtype, device=acc.device)
        for c0 in range(0, cols, CHUNK_COLUMNS):
            c1 = min(cols, c0 + CHUNK_COLUMNS)
            part = grid[:, c0:c1].add_(spent[:, c0:c1])
            spent[:, c0:c1].zero_()
            top = torch.amax(part, 0, out=peaks[c0:c1])
            torch.maximum(top, torch.amin(part, 0, out=low[: c1 - c0]).neg_(), out=top)
        _add_zero(acc[body:hi], grad[body:hi])
        maxima[(lo, hi)] = peaks
        done = hi
    _add_zero(acc[done:], grad[done:])
    return Prescan(maxima)
