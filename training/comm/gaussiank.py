"""``gaussiank``: GaussianK-SGD (Shi et al. 2019) with error feedback.

Instead of an exact top-k, the threshold comes from the mean and std of
``acc = gradient + residual`` through the normal quantile for the wanted density (two-sided:
``|mean| + std * z(1 - density / 2)``), refined up to 3 times (halved if fewer than 2k/3 pass,
x1.5 if more than 4k/3 pass), all on the device. Counts differ between workers, so every
worker sends a fixed capacity of ``ceil(4k / 3)`` pairs (the top of the refinement band; the
largest ones when more pass, the rest stays in the residual), padded with index -1, and no
size header is exchanged: no host sync in the steady state (see ``hostread``).
"""

import torch
import torch.distributed as dist

from zoopick.training.comm import triton_kernels
from zoopick.training.comm.select import (
    capped_indices,
    gaussian_threshold,
    gaussiank_capacity,
    k_for,
)
from zoopick.training.comm.sparse import allgather_exchange
from zoopick.training.comm.state import HookState, run_hook
from zoopick.training.comm.store import BucketLayout
from zoopick.training.comm_options import GaussianKOptions


class GaussianKState(HookState):
    name = "gaussiank"

    def __init__(
        self, options: GaussianKOptions, process_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(options, process_group)
        self.refine = options.refine

    def scan_spans(self, numel: int, density: float) -> list[tuple[int, int]] | None:
        """No grouped scan (a threshold, not a top-k), but the sum is a ``PairSum``: the
        driver's one pass forms ``acc`` and zeroes the bucket."""
        return []


def _exchange(state: GaussianKState, layout: BucketLayout, acc: torch.Tensor, density: float):
    n = acc.numel()
    k = k_for(density, n)
    if k >= n:
        return allgather_exchange(state, acc, torch.arange(n, device=acc.device))
    if triton_kernels.applies(acc) and state.refine <= triton_kernels.MAX_REFINE:
        with state.stats.timer("select_s"):  # CUDA: the fused selection (triton_kernels)
            scan = state.prescan
            moments = scan.moments if isinstance(scan, triton_kernels.Scan) else None
            wire = torch.float16 if state.fp16 else torch.float32
            idx, valid, payload, _ = triton_kernels.take_gaussiank(
                acc, k, state.refine, gaussiank_capacity(k), wire, moments
            )
        return allgather_exchange(state, acc, idx, valid, payload)
    with state.stats.timer("select_s"):
        mag = torch.abs(acc, out=state.scratch(acc.device, n))
        thr, _ = gaussian_threshold(acc, k, state.refine, mag=mag)
        idx, valid, _ = capped_indices(acc, thr, gaussiank_capacity(k), mag=mag)
    return allgather_exchange(state, acc, idx, valid)


def gaussiank_hook(
    state: GaussianKState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """GaussianK threshold selection of gradient + residual, all-gathered; error feedback."""
    return run_hook(state, bucket, _exchange)
