"""``topk``: TopK-allgather with error feedback.

Each worker takes the exact top-k by magnitude of ``acc = gradient + residual`` with
``k = ceil(density * numel)`` per bucket, all-gathers the (int32 index, value) pairs (k pairs
from every worker, so no size header), scatter-adds them and keeps ``acc - sent`` as residual.
"""

import torch
import torch.distributed as dist

from zoopick.training.comm.select import SAMPLED_MIN_NUMEL, k_for, topk_indices
from zoopick.training.comm.sparse import allgather_exchange
from zoopick.training.comm.state import HookState, run_hook
from zoopick.training.comm.store import BucketLayout


class TopKState(HookState):
    name = "topk"

    def scan_spans(self, numel: int, density: float) -> list[tuple[int, int]] | None:
        """The whole bucket, when its selection takes the CPU's sampled path."""
        sampled = numel >= SAMPLED_MIN_NUMEL and 8 * k_for(density, numel) <= numel
        return [(0, numel)] if sampled else []


def _exchange(state: HookState, layout: BucketLayout, acc: torch.Tensor, density: float):
    with state.stats.timer("select_s"):
        scratch = state.scratch(acc.device, acc.numel())
        peaks = None if state.prescan is None else state.prescan.peaks(0, acc.numel())
        idx = topk_indices(acc, k_for(density, acc.numel()), scratch=scratch, peaks=peaks)
    return allgather_exchange(state, acc, idx)


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Exact local top-k of gradient + residual, all-gathered; error feedback."""
    return run_hook(state, bucket, _exchange)
