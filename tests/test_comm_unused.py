"""Residuals of parameters no rank used (``find_unused_parameters=True``) are kept, not lost.

Two gloo workers train a model whose second branch is used in iteration 0 only. In
iteration 1 DDP zero-fills that branch's gradient and, as no rank used it, never applies the
reduced bucket to it; the hook must therefore not spend its residual there."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoopick.training.comm as comm
from tests.comm_harness import launch_cached


class _TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


def _unused(rank: int, P: int, name: str) -> dict:
    torch.manual_seed(0)
    model = _TwoBranch()
    ddp = DDP(model, find_unused_parameters=True)
    state, hook = comm.make_hook(name, density=0.2)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = {}
    for it in range(3):
        model.use_b = it == 0
        gen = torch.Generator().manual_seed(10 * rank + it)
        opt.zero_grad(set_to_none=True)
        ddp(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        out[it] = {
            "b": [p.detach().clone() for p in model.b.parameters()],
            "res_b": [state.residuals.get(p).clone() for p in model.b.parameters()],
        }
    return out


def _suite(rank: int, P: int) -> dict:
    return {name: _unused(rank, P, name) for name in ("topk", "spardl")}


def test_unused_parameters_keep_their_residual():
    run = launch_cached(_suite, 2)
    for name in ("topk", "spardl"):
        for res in run:
            r = res[name]
            assert any(float(t.abs().sum()) > 0 for t in r[0]["res_b"]), name
            for it in (1, 2):  # branch b unused: not updated, residual untouched
                for before, after in zip(r[0]["b"], r[it]["b"], strict=True):
                    assert torch.equal(before, after), name
                for before, after in zip(r[0]["res_b"], r[it]["res_b"], strict=True):
                    assert torch.equal(before, after), (name, it)
