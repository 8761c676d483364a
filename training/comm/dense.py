"""``dense``: the baseline all-reduce average, instrumented like the sparse hooks.

Same arithmetic as torch's ``allreduce_hook`` (divide by P, then all-reduce); a hook-less DDP
run agrees to float rounding (its C++ path orders the division differently). ``fp16=True``
casts to half precision for the wire like ``fp16_compress_hook`` (no error feedback).
``density`` is accepted and ignored so every hook can be built with the same ``make_hook``
call.
"""

import torch
import torch.distributed as dist

from zoopick.training.comm.exchange import allreduce_sum, to_wire
from zoopick.training.comm.state import HookState
from zoopick.training.comm_options import DenseOptions, SparseOptions


class DenseState(HookState):
    name = "dense"

    def __init__(
        self, options: DenseOptions, process_group: dist.ProcessGroup | None = None
    ) -> None:
        """The sparse hooks' state with what a dense hook lacks (warm-up, momentum, ...) at
        its defaults, which leave them off."""
        super().__init__(SparseOptions.model_construct(**dict(options)), process_group)
        self.options = options


def dense_hook(state: DenseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Dense average by all-reduce (DDP's default, with byte and time accounting)."""
    buf = bucket.buffer()
    state.device = buf.device
    state.stats.begin(state.iteration, buf.device)
    payload, _ = to_wire(buf.div_(state.size), state.fp16)
    total = allreduce_sum(state, payload)
    if total is not buf:
        buf.copy_(total)
    state.stats.add(numel=buf.numel(), nnz=buf.numel(), buckets=1)
    if bucket.is_last():
        state.stats.finish()
        state.iteration += 1
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
