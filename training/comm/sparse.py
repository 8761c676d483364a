"""The sparse all-gather exchange shared by ``topk`` and ``gaussiank``.

Each worker sends (int32 index, value) pairs of its own selection; every worker adds all
workers' pairs, piece by piece in rank order, so the sum is bit-identical on all ranks. The
sender keeps ``acc - sent`` (including fp16 rounding) as its residual.
"""

from __future__ import annotations

import torch

from zoopick.training.comm.exchange import INDEX_DTYPE, add_pairs, allgather_parts, to_wire
from zoopick.training.comm.state import HookState


def allgather_exchange(
    state: HookState, acc: torch.Tensor, idx: torch.Tensor, fixed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exchange this worker's selected positions ``idx`` of ``acc``.

    ``fixed``: every worker selects the same number of pairs (no size header needed).
    Returns (sum over workers, residual, sent positions)."""
    payload, seen = to_wire(acc[idx], state.fp16)
    lengths = [[idx.numel()] * 2] * state.size if fixed else None
    gathered = allgather_parts(state, [idx.to(INDEX_DTYPE), payload], lengths)
    total = torch.zeros_like(acc)
    add_pairs(total, [(i, v) for i, v in gathered])
    residual = acc.index_add_(0, idx, -seen)
    state.stats.add(nnz=sum(int(i.numel()) for i, _ in gathered))
    return total, residual, idx
