"""``dfs``: block-energy top-k over all-gather with a dynamic block size; error feedback.

What it is, and what it is not: the name is historical. This is *not* the DFS paper's
scheme (parameter-server streaming in which workers and server skip zero blocks in both
directions); it borrows only the block-aligned selection and the adaptive block size and
exchanges the blocks by all-gather, so every worker receives every other worker's blocks:
the bytes each worker sends and receives grow linearly with P (``(P - 1) (m + m B)`` words
each way), unlike SparDL's ``2 k (P - 1) / P`` pairs. The hook keeps its registry name
``dfs`` so existing job settings still resolve.

Selection is aligned to blocks of ``B`` consecutive elements, so whole blocks are either sent
or left at zero, and only non-zero blocks travel: ``m = ceil(k / B)`` block ids (int32) plus
their ``m * B`` values, chosen as the blocks of ``acc = gradient + residual`` with the largest
energy (sum of squares). The value budget stays about ``k = ceil(density * numel)``; the
index cost drops from ``k`` to ``k / B`` ints.

Dynamic block size from the observed density: each worker measures the in-block density of
what it sent, the fraction of the sent values that are at least the element-wise top-k
magnitude (estimated on a strided sample of at most 4096 elements). The value rides along at
the end of the value payload, so every rank sees every worker's figure and applies the same
rule to the mean (read when the bucket comes back at the next iteration, so no host sync;
see ``hostread``): above ``grow_at`` (blocks are mostly significant) the block size doubles,
below ``shrink_at`` it halves, within ``[1, max_block]``. With ``B = 1`` the scheme is exact
top-k. All workers always use the same ``B`` and ``m``, so payloads have equal sizes.
"""

import math
from typing import Any

import torch
import torch.distributed as dist

from zoopick.training.comm.exchange import INDEX_DTYPE, allgather_parts, to_wire
from zoopick.training.comm.hostread import Deferred
from zoopick.training.comm.select import k_for, topk_indices
from zoopick.training.comm.state import HookState, id_key, named_key, run_hook
from zoopick.training.comm.store import BucketLayout
from zoopick.training.comm_options import DFSOptions

SAMPLE = 4096


class DFSState(HookState):
    name = "dfs"

    def graphable(self) -> bool:
        """No: its block size is steered on the host."""
        return False

    def __init__(self, options: DFSOptions, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(options, process_group)
        self.block_size = options.block_size
        self.max_block = options.max_block
        self.grow_at = options.grow_at
        self.shrink_at = options.shrink_at
        self.sizes: dict[tuple[int, ...], int] = {}
        # per bucket: (every worker's fill, block size, numel) of the last iteration
        self.fills: dict[tuple[int, ...], tuple[Deferred, int, int]] = {}

    def reset_state(self) -> None:
        super().reset_state()
        self.sizes.clear()
        self.fills.clear()

    def settle(self) -> None:
        for key in list(self.fills):
            _adapt(self, key)

    def scheme_state(self, names: dict[int, str]) -> dict[Any, Any]:
        """The block size per bucket (a resumed run continues with the adapted sizes)."""
        return {named_key(key, names): int(b) for key, b in self.sizes.items()}

    def load_scheme_state(self, params: dict[str, torch.Tensor], blob: dict[Any, Any]) -> None:
        self.sizes = {id_key(named, params): int(b) for named, b in blob.items()}


def topk_magnitude_estimate(x: torch.Tensor, k: int) -> torch.Tensor:
    """Approximate k-th largest ``|x|`` from a strided sample (no full sort), a 0-d tensor."""
    n = x.numel()
    step = max(1, n // SAMPLE)
    sample = x[::step].abs()
    rank = min(sample.numel(), max(1, round(k / n * sample.numel())))
    return torch.topk(sample, rank, sorted=False).values.min()


def _adapt(state: DFSState, key: tuple[int, ...]) -> None:
    """Next block size from the mean fill of the bucket's previous iteration (deferred:
    read when the bucket comes back, see ``hostread``)."""
    pending = state.fills.pop(key, None)
    if pending is None:
        return
    fills, B, n = pending
    values = fills.get()
    mean_fill = sum(values) / len(values)
    grown = 2 * B
    if mean_fill > state.grow_at and grown <= min(state.max_block, n):
        state.sizes[key] = grown
    elif mean_fill < state.shrink_at and B > 1:
        state.sizes[key] = B // 2
    else:
        state.sizes[key] = B


def _exchange(state: DFSState, layout: BucketLayout, acc: torch.Tensor, density: float):
    P = state.size
    n = acc.numel()
    k = k_for(density, n)
    _adapt(state, layout.key)
    B = min(state.sizes.get(layout.key, state.block_size), n)
    nb = math.ceil(n / B)
    m = min(nb, math.ceil(k / B))
    dev = acc.device
    with state.stats.timer("select_s"):
        padded = torch.zeros(nb * B, device=dev)
        padded[:n] = acc
        rows = padded.view(nb, B)
        ids = topk_indices(rows.pow(2).sum(1), m)
        values = rows[ids].flatten()
        if k < n:
            thr = topk_magnitude_estimate(acc, k)
            passing = torch.count_nonzero(values.abs() >= thr).to(values.dtype)
            fill = passing / max(1, values.numel())
        else:
            fill = values.new_ones(())
        payload, seen = to_wire(torch.cat([values, fill.reshape(1)]), state.fp16)
    gathered = allgather_parts(state, [ids.to(INDEX_DTYPE), payload], [[m, m * B + 1]] * P)
    offsets = torch.arange(B, device=dev)
    total = torch.zeros(nb * B, device=dev)
    for g_ids, g_vals in gathered:
        pos = (g_ids.long()[:, None] * B + offsets).flatten()
        total.index_add_(0, pos, g_vals[:-1].float())
    mine = (ids[:, None] * B + offsets).flatten()
    padded.index_add_(0, mine, -seen[:-1])
    sent = torch.zeros(nb, B, dtype=torch.bool, device=dev)
    sent.index_fill_(0, ids, True)
    state.fills[layout.key] = (Deferred(torch.stack([g[-1] for _, g in gathered])), B, n)
    state.stats.add(nnz=P * m * B)
    return total[:n], padded[:n], sent.flatten()[:n]


def dfs_hook(state: DFSState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Block-energy top-k over all-gather (not the DFS paper's parameter-server streaming):
    whole blocks (ids + values), dynamic block size, bytes linear in P; error feedback."""
    return run_hook(state, bucket, _exchange)
