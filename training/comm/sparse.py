"""The sparse all-gather exchange shared by ``topk`` and ``gaussiank``.

Each worker sends (int32 index, value) pairs of its own selection; every worker adds all
workers' pairs, piece by piece in rank order, so the sum is bit-identical on all ranks. The
sender keeps ``acc - sent`` (including fp16 rounding) as its residual.
"""

from __future__ import annotations

import torch

from zoopick.training.comm.exchange import INDEX_DTYPE, PairSum, allgather_parts, to_wire
from zoopick.training.comm.state import HookState


def allgather_exchange(
    state: HookState,
    acc: torch.Tensor,
    idx: torch.Tensor,
    valid: torch.Tensor | None = None,
    payload: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exchange this worker's selected positions ``idx`` of ``acc``.

    Every worker sends the same number of pairs (a fixed capacity, so no size header and no
    host read): ``valid`` marks the real ones (``None``: all). Padding travels as index -1
    with value 0, so the count is inside the payload (the stats' pair count is read from it
    later, see ``CommStats``) and a padding pair adds nothing (at its slot's number,
    :func:`slot_numbers`, on the sender and the receivers). Returns (sum over workers,
    residual, sent positions: the indices, or a mask when some were padding and momentum
    is on). The sum is a ``PairSum``, written into the bucket by the driver. ``payload``:
    the wire values of a fused selection (``triton_kernels``) that took them out of ``acc``
    already (padding zero), so ``acc`` is the residual as it stands."""
    wire_idx = idx
    if valid is not None:
        idx = torch.where(valid, idx, slot_numbers(idx))
        wire_idx = torch.where(valid, idx, torch.full_like(idx, -1))
    if payload is None:
        values = acc[idx] if valid is None else torch.where(valid, acc[idx], 0.0)
        payload, seen = to_wire(values, state.fp16)
        acc.index_add_(0, idx, -seen)
    lengths = [[idx.numel()] * 2] * state.size
    gathered = allgather_parts(state, [wire_idx.to(INDEX_DTYPE), payload], lengths)
    total = PairSum([(torch.where(i >= 0, i, slot_numbers(i)), v) for i, v in gathered])
    residual = acc
    if valid is None:
        state.stats.add(nnz=state.size * idx.numel())
        return total, residual, idx
    state.stats.add(nnz=sum(torch.count_nonzero(i >= 0) for i, _ in gathered))
    if state.momentum == 0.0:  # the sent positions are only read for momentum masking
        return total, residual, None
    hit = torch.zeros_like(acc).index_add_(0, idx, valid.to(acc.dtype))
    return total, residual, hit > 0


def slot_numbers(idx: torch.Tensor) -> torch.Tensor:
    """``0 .. len(idx) - 1``: where a padding pair (value 0) is added.

    Why not one position for all: ``index_add_`` on a GPU adds with atomics, and atomics aimed
    at one address serialise: GaussianK's padding (up to a third of its capacity) all at
    position 0 cost about 140 us a bucket on an H200 (issue 19, run D in
    ``benchmarks/comm/README.md``). At distinct positions they run in parallel, and adding
    0 changes no value. A piece is never longer than its bucket (capacities are capped at
    the bucket's size), so every slot number is a position of it."""
    return torch.arange(idx.numel(), device=idx.device, dtype=idx.dtype)
