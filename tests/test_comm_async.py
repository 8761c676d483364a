"""Asynchronous hooks (``async_comm=True``): one FIFO communication thread per process.

Two gloo workers train a small model under DDP with several buckets, once with synchronous
hooks and once with the communication thread, with ``find_unused_parameters=True`` (so DDP
issues collectives of its own from the main thread while ours run on the thread). The runs
must finish (no deadlock: the harness has a 120 s collective timeout) and give bit-identical
parameters, residuals and byte counts: the arithmetic and its order are the same."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoopick.training.comm as comm
from tests.comm_harness import launch_cached

HOOKS = ("spardl", "topk", "exdyna")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        self.spare = nn.Linear(64, 4)  # used on odd steps only

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + (self.spare(h) if step % 2 else 0.0)


def _train(rank: int, name: str, async_comm: bool) -> dict:
    torch.manual_seed(0)
    model = _Net()
    ddp = DDP(model, bucket_cap_mb=0.005, find_unused_parameters=True)
    state, hook = comm.make_hook(name, density=0.1, async_comm=async_comm)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(5):
        gen = torch.Generator().manual_seed(100 * rank + step)
        opt.zero_grad(set_to_none=True)
        out = ddp(torch.randn(8, 16, generator=gen), step)
        nn.functional.mse_loss(out, torch.randn(8, 4, generator=gen)).backward()
        opt.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "residuals": [state.residuals.get(p) for p in model.parameters()],
        "bytes": [rec["bytes_sent"] for rec in state.stats],
        "buckets": [rec["buckets"] for rec in state.stats],
    }


def _suite(rank: int, P: int) -> dict:
    return {(name, a): _train(rank, name, a) for name in HOOKS for a in (False, True)}


def test_async_hooks_match_the_synchronous_ones():
    run = launch_cached(_suite, 2)
    for res in run:
        for name in HOOKS:
            sync, asyn = res[(name, False)], res[(name, True)]
            assert max(sync["buckets"]) >= 2, name  # several buckets in flight
            assert sync["bytes"] == asyn["bytes"], name
            for a, b in zip(sync["params"], asyn["params"], strict=True):
                assert torch.equal(a, b), name
            for a, b in zip(sync["residuals"], asyn["residuals"], strict=True):
                assert (a is None and b is None) or torch.equal(a, b), name
    for name in HOOKS:  # ranks agree
        ranks = [r[(name, True)]["params"] for r in run]
        for a, b in zip(*ranks, strict=True):
            assert torch.equal(a, b), name
