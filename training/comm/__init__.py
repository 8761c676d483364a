"""Sparse gradient communication as PyTorch DDP communication hooks.

``make_hook(name, density=..., **options) -> (state, hook)`` for
``ddp_model.register_comm_hook(state, hook)`` (``build(name, options)`` from options validated
before); ``available()`` lists the names, each declared once in ``training.comm_options.HOOKS``:

- ``dense``: all-reduce average (DDP's default, instrumented);
- ``topk``: exact local top-k, all-gather of (index, value) pairs;
- ``gaussiank``: GaussianK threshold selection, all-gather;
- ``spardl``: SparDL sparse reduce-scatter + all-gather, any P, optional teams, optional
  4-byte pairs (``pairs16``: 16-bit block-relative indices and 16-bit values);
- ``exdyna``: ExDyna exclusive rotating partitions with online threshold scaling;
- ``dfs``: block-energy top-k over all-gather with a dynamic block size (the name is
  historical: not the DFS paper's parameter-server streaming; bytes grow linearly with P).

All sparse hooks keep error-feedback residuals per parameter (surviving DDP's bucket
rebuild), share ``density``, ``warmup``/``warmup_mode``, ``momentum`` (DGC momentum
correction) and ``fp16`` options, return the average of what is applied, and record bytes and
times per iteration in ``state.stats``. Only gloo/NCCL-common operations are used. In their
steady state they read no tensor value on the host (fixed-capacity payloads; see
``hostread``).
"""

from zoopick.training.comm import dense, dfs, exdyna, gaussiank, spardl, topk  # noqa: F401
from zoopick.training.comm.bucket import SimpleBucket
from zoopick.training.comm.errors import CommError
from zoopick.training.comm.registry import available, build, check_options, get, make_hook
from zoopick.training.comm.spardl import (
    Transfer,
    message_steps,
    simulate_schedule,
    spardl_schedule,
)
from zoopick.training.comm.state import HookState
from zoopick.training.comm.stats import CommStats, sum_stats

__all__ = [
    "CommError",
    "CommStats",
    "HookState",
    "SimpleBucket",
    "Transfer",
    "available",
    "build",
    "check_options",
    "get",
    "make_hook",
    "message_steps",
    "simulate_schedule",
    "spardl_schedule",
    "sum_stats",
]
