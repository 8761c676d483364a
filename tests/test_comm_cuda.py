"""The hooks on CUDA tensors (issue 9): skipped where no GPU is present (CI has none; the
results of a run on a lent GPU are in ``benchmarks/results/gpu_logs/cuda_tests.log``).

One process, an NCCL group of one (a single GPU): every hook still selects, packs and keeps
residuals. Checked, for every configuration of the CPU no-sync test, both plain and with
``async_comm`` (the side stream):

* the steady state makes no synchronising CUDA call (``torch.cuda.set_sync_debug_mode
  ("error")`` raises at the first one), deferred reads included;
* nothing is lost: the applied updates plus the residual equal the summed gradients;
* the CUDA run applies the same update as the same run on the CPU, where selection cannot
  differ (dense, topk, spardl in float32).
"""

from __future__ import annotations

import pytest
import torch

import zoopick.training.comm as comm
from tests.comm_harness import world_of_one
from tests.test_comm_nosync import CONFIGS, SHAPES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WARM, GUARDED = 3, 4
EXACT = {"dense", "topk", "spardl"}  # the CPU and CUDA selections must agree exactly


@pytest.fixture(scope="module")
def nccl_world_of_one():
    yield from world_of_one(cuda=True)


def _run(device: str, name: str, options: dict, guard: bool) -> tuple[list, torch.Tensor, list]:
    """(applied updates per iteration, summed gradients, final residuals by parameter)."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.zeros(s, device=device) for s in SHAPES]
    state, hook = comm.make_hook(name, density=0.05, **options)
    applied, grad_sum = [], [torch.zeros(s) for s in SHAPES]
    for it in range(WARM + GUARDED):
        split = [[0, 1], [2, 3]] if it == 0 else [[3, 0], [1, 2]]  # DDP's rebuild
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for g, acc in zip(grads, grad_sum, strict=True):
            acc += g
        buckets = [
            comm.SimpleBucket(
                [params[i] for i in m], [grads[i].to(device) for i in m], index=b, is_last=b == 1
            )
            for b, m in enumerate(split)
        ]
        if guard and it >= WARM:
            torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [hook(state, bucket).wait() for bucket in buckets]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        applied.append((split, [o.detach().cpu() for o in outs]))
    residuals = [state.residuals.get(p) for p in params]
    return applied, grad_sum, [r.cpu() if r is not None else None for r in residuals]


def _per_param(applied) -> list[torch.Tensor]:
    total = [torch.zeros(s).flatten() for s in SHAPES]
    for split, outs in applied:
        for members, out in zip(split, outs, strict=True):
            off = 0
            for i in members:
                n = total[i].numel()
                total[i] += out[off : off + n]
                off += n
    return total


@pytest.mark.parametrize("async_comm", [False, True], ids=["plain", "side-stream"])
@pytest.mark.parametrize("key", list(CONFIGS))
def test_cuda_hook(nccl_world_of_one, monkeypatch, key, async_comm):
    from zoopick.training.comm import select

    monkeypatch.setattr(select, "CPU_SHORTCUTS", False)  # the CPU run takes the CUDA path too
    name, options = CONFIGS[key]
    if options.get("teams", 1) > 1:
        pytest.skip("teams need several workers; one GPU gives a group of one")
    if async_comm and name == "dense":
        pytest.skip("dense is DDP's all-reduce: no async_comm option")
    if async_comm:
        options = {**options, "async_comm": True}
    applied, grad_sum, residuals = _run("cuda", name, options, guard=True)
    total = _per_param(applied)
    if not options.get("momentum"):
        for i, res in enumerate(residuals):
            kept = res.flatten() if res is not None else torch.zeros_like(total[i])
            torch.testing.assert_close(total[i] + kept, grad_sum[i].flatten(), atol=1e-4, rtol=0)
    if name in EXACT and not options.get("fp16") and "pairs16" not in options:
        cpu_applied, _, _ = _run("cpu", name, options, guard=False)
        for a, b in zip(_per_param(cpu_applied), total, strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_block_topk_on_cuda_matches_the_cpu_and_does_not_synchronise():
    """The batched block topk of spardl's device path (a world of one never has a message
    of several blocks, so the hooks above do not reach it): the CPU's positions, with no
    synchronising call once its ``Blocks`` exist."""
    from zoopick.training.comm.select import Blocks, block_topk_indices, even_bounds

    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(3))
    bounds = even_bounds(x.numel(), 8)
    picks = (6, 7, 0, 1)  # a wrapped message, one block longer than the others
    lengths = [bounds[j + 1] - bounds[j] for j in picks]
    starts = [bounds[j] for j in picks]
    want = block_topk_indices(x, Blocks.of(starts, lengths, x.device), 500)
    xc = x.cuda()
    blocks = Blocks.of(starts, lengths, xc.device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = block_topk_indices(xc, blocks, 500)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for row_got, row_want in zip(got.cpu(), want, strict=True):
        assert set(row_got.tolist()) == set(row_want.tolist())
