"""All hooks on real gloo process groups (P = 2, 3, 5), one launch per P.

Each launch runs ``suite`` on every rank: DDP training steps with every hook (density 1.0 vs a
hook-less DDP, and sparse settings for cross-rank consistency), plus raw hook calls on
``SimpleBucket``s whose residuals and outputs are returned to the parent, which checks them
against plain single-process reimplementations (top-k, GaussianK with scipy's normal quantile,
SparDL in tests/test_comm_spardl.py) and the conservation law

    sum_w residual_after_w = sum_w (input_w + residual_before_w) - P * average.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoopick.training.comm as comm
from tests.comm_harness import launch_cached
from zoopick.training.comm.store import BucketLayout

SPARSE = ["topk", "gaussiank", "spardl", "exdyna", "dfs"]
SHAPES = [(40, 25), (300,), (63,), (500,)]
ITERS = 4
DENSITY = 0.05
# DDP's constructor imports torch._dynamo (~5 s CPU per process), so the DDP checks run in
# the P = 3 launch only; the raw-bucket checks run for every P.
DDP_WORLDS = (3,)
DFS_WORLD = 3
WORLDS = (2, 3, 5)  # P = 6 runs in tests/test_comm_spardl.py (same suite, same cache)


def raw_configs(P: int) -> dict[str, tuple[str, dict]]:
    """Raw-bucket runs of one launch: key -> (hook name, options)."""
    configs = {
        "topk": ("topk", {}),
        "topk_fp16": ("topk", {"fp16": True}),
        "topk_momentum": ("topk", {"momentum": 0.9, "warmup": 2}),
        "topk_dense_warmup": ("topk", {"warmup": 1, "warmup_mode": "dense"}),
        "exdyna_fp16": ("exdyna", {"blocks": 16, "fp16": True}),
        "gaussiank": ("gaussiank", {}),
        "exdyna": ("exdyna", {"blocks": 16}),
        "exdyna_paper": ("exdyna", {"blocks": 16, "controller": "paper"}),
        "dfs": ("dfs", {}),
        "dfs_fp16": ("dfs", {"fp16": True, "block_size": 4}),
        "spardl": ("spardl", {}),
        "spardl_fp16": ("spardl", {"fp16": True}),
        "spardl_pow2": ("spardl", {"split": "pow2"}),
        "spardl_halving": ("spardl", {"split": "halving"}),
        "spardl_dense": ("spardl", {"density": 1.0}),
        "spardl_d20": ("spardl", {"density": 0.2}),
        "spardl_p16": ("spardl", {"pairs16": "fp16"}),
        "spardl_p16bf": ("spardl", {"pairs16": "bf16"}),
        # the accelerator's path (no CPU shortcuts: batched block topk, fixed capacities)
        "spardl_device": ("spardl", {DEVICE_PATH: True}),
    }
    for d in range(2, P + 1):
        if P % d == 0:
            configs[f"spardl_teams{d}"] = ("spardl", {"teams": d})
            configs[f"spardl_teams{d}_fp16"] = ("spardl", {"teams": d, "fp16": True})
            configs[f"spardl_teams{d}_dense"] = ("spardl", {"teams": d, "density": 1.0})
            configs[f"spardl_teams{d}_p16bf"] = ("spardl", {"teams": d, "pairs16": "bf16"})
    return configs


# ----------------------------------------------------------------------------- worker side
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 3)
    )


def _train(rank: int, name: str | None, steps: int, **options) -> tuple[list, object]:
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.0002)
    state = None
    if name is not None:
        state, hook = comm.make_hook(name, **options)
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(8, 6, generator=gen)
        y = torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    return params, (list(state.stats) if state is not None else None)


DEVICE_PATH = "_device_path"  # a config flag of these tests, not a hook option


def _raw(rank: int, P: int, name: str, options: dict) -> dict:
    """Drive a hook with SimpleBuckets for ITERS iterations; the bucket split of the
    parameters changes after the first iteration, like DDP's rebuild. ``DEVICE_PATH: True``
    in ``options`` runs it with the CPU shortcuts off."""
    from zoopick.training.comm import select

    options = dict(options)
    if options.pop(DEVICE_PATH, False):
        saved, select.CPU_SHORTCUTS = select.CPU_SHORTCUTS, False
        try:
            return _raw(rank, P, name, options)
        finally:
            select.CPU_SHORTCUTS = saved
    gen = torch.Generator().manual_seed(1000 + rank)
    params = [torch.zeros(s) for s in SHAPES]
    options = {"density": DENSITY, **options}
    state, hook = comm.make_hook(name, **options)
    records = []
    for it in range(ITERS):
        split = [[0, 1], [2, 3]] if it == 0 else [[3, 0], [1, 2]]
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        layouts, before, out = [], {}, {}
        buckets = []
        for b, members in enumerate(split):
            bucket = comm.SimpleBucket(
                [params[i] for i in members],
                [grads[i] for i in members],
                index=b,
                is_last=b == len(split) - 1,
            )
            buckets.append((members, bucket))
        for members, bucket in buckets:
            layout = BucketLayout.of(bucket)
            layouts.append(layout)
            flat = state.residuals.gather(layout, torch.device("cpu"))
            mom = state.momenta.gather(layout, torch.device("cpu"))
            for i, off, ln in zip(members, layout.offsets, layout.lengths, strict=True):
                before[i] = (flat[off : off + ln].clone(), mom[off : off + ln].clone())
        for members, bucket in buckets:
            avg = hook(state, bucket).wait()
            layout = BucketLayout.of(bucket)
            for i, off, ln in zip(members, layout.offsets, layout.lengths, strict=True):
                out[i] = avg[off : off + ln].clone()
        after = {i: state.residuals.get(params[i]).clone().reshape(-1) for i in range(len(params))}
        records.append(
            {
                "split": split,
                "grads": [g.reshape(-1) for g in grads],
                "before": [before[i][0] for i in range(len(params))],
                "mom_before": [before[i][1] for i in range(len(params))],
                "after": [after[i] for i in range(len(params))],
                "avg": [out[i] for i in range(len(params))],
            }
        )
    return {"records": records, "stats": list(state.stats)}


def _exdyna_density(rank: int, P: int) -> list[float]:
    """Achieved density of exdyna (target 0.01) over 40 iterations on fresh gradients."""
    gen = torch.Generator().manual_seed(7 + rank)
    params = [torch.zeros(4000)]
    state, hook = comm.make_hook("exdyna", density=0.01, blocks=64)
    for _ in range(40):
        hook(state, comm.SimpleBucket(params, [torch.randn(4000, generator=gen)]))
    return [rec["nnz"] / rec["numel"] for rec in state.stats]


def _dfs_adapt(rank: int, P: int) -> dict:
    """Final dfs block sizes after 6 iterations on clustered vs i.i.d. gradients, and the
    first iteration's update (block-aligned at the initial block size 16)."""
    gen = torch.Generator().manual_seed(50 + rank)
    out = {}
    for kind in ("clustered", "iid"):
        params = [torch.zeros(4096)]
        state, hook = comm.make_hook("dfs", density=0.05)
        for it in range(6):
            g = torch.randn(4096, generator=gen) * 0.01
            if kind == "clustered":  # a few runs of 128 large values, placed per iteration
                for start in torch.randint(0, 32, (2,), generator=gen).tolist():
                    g[start * 128 : (start + 1) * 128] += torch.randn(128, generator=gen)
            else:
                g = torch.randn(4096, generator=gen)
            avg = hook(state, comm.SimpleBucket(params, [g])).wait()
            if it == 0:
                out[f"{kind}_first"] = avg.clone()
        state.settle()  # the last iteration's adaptation is read when the bucket returns
        out[kind] = next(iter(state.sizes.values()))
    return out


GROUPED_WORLD = 2
GROUPED_SIZES = (300_007, 140_001)  # buckets whose blocks take the CPU's sampled selection
GROUPED_HOOKS = ("spardl", "topk", "gaussiank")
# CPU paths: (select.CPU_KERNEL, select.CPU_GROUPED, exchange.SPARSE_AVERAGE)
CPU_PATHS = {"compiled": (True, True, True), "grouped": (False, True, True)}
CPU_PATHS["plain"] = (False, False, False)


def _grouped_vs_plain(rank: int, P: int) -> dict:
    """spardl, topk and gaussiank at density 1 % on large buckets (the CPU's sampled
    selection) for 3 iterations on each of issue 19's CPU paths (``CPU_PATHS``): the
    compiled single pass (``cpu_kernels``), the torch one (the driver's one-pass error
    feedback, the grouped scan, the sparse average) and the plain reference: every
    averaged bucket and residual, per path, and the compiled path's selection counts."""
    from zoopick.training.comm import exchange, select

    out: dict = {}
    saved = (select.CPU_KERNEL, select.CPU_GROUPED, exchange.SPARSE_AVERAGE)
    try:
        for path, flags in CPU_PATHS.items():
            select.CPU_KERNEL, select.CPU_GROUPED, exchange.SPARSE_AVERAGE = flags
            for name in GROUPED_HOOKS:
                gen = torch.Generator().manual_seed(300 + rank)
                params = [torch.zeros(n) for n in GROUPED_SIZES]
                state, hook = comm.make_hook(name, density=0.01)
                seen = []
                for it in range(3):
                    for b, p in enumerate(params):
                        g = torch.randn(p.numel(), generator=gen) * 0.01
                        g[1000 * it : 1000 * it + 500] += torch.randn(500, generator=gen)
                        g[::7] = 0.0
                        bucket = comm.SimpleBucket([p], [g], index=b, is_last=b == 1)
                        seen.append(hook(state, bucket).wait().clone())
                residuals = [state.residuals.get(p).clone() for p in params]
                out[(name, path)] = (seen, residuals)
    finally:
        select.CPU_KERNEL, select.CPU_GROUPED, exchange.SPARSE_AVERAGE = saved
    kernels = select._load_cpu_kernels()
    out["counts"] = dict(kernels.COUNTS) if kernels is not None else {}
    return out


def suite(rank: int, P: int) -> dict:
    torch.manual_seed(rank)
    result: dict = {"rank": rank, "P": P}
    if P in DDP_WORLDS:
        result["default"], _ = _train(rank, None, steps=2)
        result["dense1"] = {}
        for name in comm.available():
            result["dense1"][name] = _train(rank, name, steps=2, density=1.0)
        result["sparse"] = {}
        for name in SPARSE:
            result["sparse"][name] = _train(
                rank, name, steps=3, density=0.1, momentum=0.5, warmup=1
            )
    result["raw"] = {key: _raw(rank, P, name, opts) for key, (name, opts) in raw_configs(P).items()}
    result["exdyna_density"] = _exdyna_density(rank, P)
    if P == DFS_WORLD:
        result["dfs_adapt"] = _dfs_adapt(rank, P)
    if P == GROUPED_WORLD:
        result["grouped"] = _grouped_vs_plain(rank, P)
    dist.barrier()
    return result


# ----------------------------------------------------------------------------- parent side
@pytest.fixture(scope="module", params=WORLDS, ids=lambda p: f"P{p}")
def run(request):
    return launch_cached(suite, request.param)


def _buckets_of(split: list[list[int]], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat([tensors[i] for i in members]) for members in split]


@pytest.fixture(scope="module")
def ddp_run():
    return launch_cached(suite, DDP_WORLDS[0])


def test_density_one_matches_dense_ddp(ddp_run):
    assert set(ddp_run[0]["dense1"]) == set(comm.available())
    for res in ddp_run:
        for name, (params, stats) in res["dense1"].items():
            for p, q in zip(params, res["default"], strict=True):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
            assert len(stats) == 2, name
            # DDP rebuilt its buckets after iteration 0: several small buckets afterwards
            assert stats[1]["buckets"] >= 3 and stats[1]["numel"] == 843, name


def test_sparse_ddp_keeps_ranks_identical_and_fills_stats(ddp_run):
    for name in SPARSE:
        ref, stats = ddp_run[0]["sparse"][name]
        assert len(stats) == 3, name
        for res in ddp_run[1:]:
            for p, q in zip(res["sparse"][name][0], ref, strict=True):
                assert torch.equal(p, q), name
        for rec in stats:
            assert rec["bytes_sent"] > 0 and rec["bytes_recv"] > 0, name
            assert rec["comm_s"] > 0 and rec["select_s"] > 0, name
            assert rec["buckets"] >= 1 and rec["numel"] == 843, name
        # warm-up iteration 0 runs at density 0.25, afterwards 0.1: fewer bytes (exdyna's
        # threshold needs a few iterations and its header dominates these tiny buckets)
        if name != "exdyna":
            assert stats[2]["bytes_sent"] < stats[0]["bytes_sent"], name


def check_conservation(run, key: str) -> None:
    """sum_w residual_after = sum_w (input + residual_before) - P * average, per parameter."""
    P = len(run)
    name, options = raw_configs(P)[key]
    fp16 = options.get("fp16", False) or options.get("pairs16") is not None
    momentum = options.get("momentum", 0.0)
    for it in range(ITERS):
        recs = [res["raw"][key]["records"][it] for res in run]
        for i in range(len(SHAPES)):
            avg = recs[0]["avg"][i]
            for r in recs[1:]:
                assert torch.equal(r["avg"][i], avg), (key, it, i)
            if momentum:  # inputs are the momentum-corrected u = m u_prev + g
                inputs = sum(momentum * r["mom_before"][i] + r["grads"][i] for r in recs)
            else:
                inputs = sum(r["grads"][i] for r in recs)
            lhs = sum(r["after"][i] for r in recs)
            rhs = inputs + sum(r["before"][i] for r in recs) - P * avg
            tol = 1e-2 if fp16 else 1e-4
            if fp16 and name == "exdyna":
                # its value all-reduce sums in half precision: the sum's rounding (a few ulps
                # of the largest summed value) is applied but belongs to nobody's residual
                tol = 4 * P * float(rhs.abs().max() + P * avg.abs().max()) * 2.0**-11
            torch.testing.assert_close(lhs, rhs, rtol=0, atol=tol, msg=f"{key} it{it} p{i}")


def test_residual_conservation(run):
    for key in raw_configs(len(run)):
        check_conservation(run, key)


def _acc(recs: list[dict], split: list[list[int]]) -> list[list[torch.Tensor]]:
    """Per rank, per bucket: gradient + residual before the call."""
    return [
        _buckets_of(split, [g + b for g, b in zip(r["grads"], r["before"], strict=True)])
        for r in recs
    ]


def test_dense_warmup_iteration_is_the_dense_average(run):
    P = len(run)
    recs = [res["raw"]["topk_dense_warmup"]["records"][0] for res in run]
    for i in range(len(SHAPES)):
        dense = sum(r["grads"][i] for r in recs) / P
        torch.testing.assert_close(recs[0]["avg"][i], dense, rtol=1e-6, atol=1e-6)
    later = run[0]["raw"]["topk_dense_warmup"]["stats"]
    assert later[1]["bytes_sent"] < later[0]["bytes_sent"]


def test_topk_matches_plain_reference(run):
    P = len(run)
    for it in range(ITERS):
        recs = [res["raw"]["topk"]["records"][it] for res in run]
        split = recs[0]["split"]
        got = _buckets_of(split, recs[0]["avg"])
        for b, accs in enumerate(zip(*_acc(recs, split), strict=True)):
            n = accs[0].numel()
            k = math.ceil(DENSITY * n - 1e-9)
            expect = np.zeros(n)
            for a in accs:
                a = a.numpy().astype(np.float64)
                top = np.argsort(-np.abs(a))[:k]
                expect[top] += a[top]
            np.testing.assert_allclose(got[b].numpy(), expect / P, atol=1e-5)


def test_gaussiank_matches_plain_reference(run):
    from scipy.stats import norm  # slow import: keep it out of the spawned workers

    P = len(run)
    for it in range(ITERS):
        recs = [res["raw"]["gaussiank"]["records"][it] for res in run]
        split = recs[0]["split"]
        got = _buckets_of(split, recs[0]["avg"])
        for b, accs in enumerate(zip(*_acc(recs, split), strict=True)):
            n = accs[0].numel()
            k = math.ceil(DENSITY * n - 1e-9)
            expect = np.zeros(n)
            for a in accs:
                a = a.numpy().astype(np.float64)
                thr = abs(a.mean()) + a.std(ddof=1) * norm.ppf(1 - k / n / 2)
                for _ in range(3):
                    c = int((np.abs(a) >= thr).sum())
                    if c < 2 * k / 3:
                        thr /= 2
                    elif c > 4 * k / 3:
                        thr *= 1.5
                    else:
                        break
                sel = np.abs(a) >= thr
                expect[sel] += a[sel]
            np.testing.assert_allclose(got[b].numpy(), expect / P, atol=1e-5)


def test_topk_bytes_exact(run):
    P = len(run)
    for res in run:
        for it, rec in enumerate(res["raw"]["topk"]["stats"]):
            split = res["raw"]["topk"]["records"][it]["split"]
            sizes = [sum(math.prod(SHAPES[i]) for i in members) for members in split]
            pairs = sum(math.ceil(DENSITY * n - 1e-9) for n in sizes)
            assert rec["bytes_sent"] == pairs * 8 * (P - 1)
            assert rec["bytes_recv"] == pairs * 8 * (P - 1)
        for it, rec in enumerate(res["raw"]["topk_fp16"]["stats"]):
            split = res["raw"]["topk_fp16"]["records"][it]["split"]
            sizes = [sum(math.prod(SHAPES[i]) for i in members) for members in split]
            pairs = sum(math.ceil(DENSITY * n - 1e-9) for n in sizes)
            assert rec["bytes_sent"] == pairs * (4 + 2) * (P - 1)


def test_momentum_masks_sent_positions(run):
    """DGC momentum correction: u = m u + g is accumulated, and zeroed where it was sent."""
    m = raw_configs(len(run))["topk_momentum"][1]["momentum"]
    for res in run:
        recs = res["raw"]["topk_momentum"]["records"]
        for it in range(ITERS - 1):
            cur, nxt = recs[it], recs[it + 1]
            for i in range(len(SHAPES)):
                u = m * cur["mom_before"][i] + cur["grads"][i]
                acc = cur["before"][i] + u
                sent = (cur["after"][i] == 0) & (acc != 0)
                expect = torch.where(sent, torch.zeros_like(u), u)
                torch.testing.assert_close(nxt["mom_before"][i], expect, rtol=1e-6, atol=1e-6)


def test_cpu_paths_change_no_bit():
    """Issue 19's CPU paths, the compiled single pass (``cpu_kernels``: error feedback,
    zeroing and candidates in one pass, filtered by the exact threshold) and the torch one
    (the driver's one-pass error feedback with the column maxima, the grouped candidate
    scan, the sparse average), leave every averaged bucket and every residual of spardl,
    topk and gaussiank bit-identical to the plain paths, on two real gloo workers with
    buckets large enough for the sampled selection (spardl's own block is selected after
    the peer's pairs landed in it: touched positions); the averages are the same on both
    ranks and not trivially zero, and the compiled path selected on its candidates."""
    run = launch_cached(suite, GROUPED_WORLD)
    for name in GROUPED_HOOKS:
        for res in run:
            old, old_res = res["grouped"][(name, "plain")]
            assert len(old) == 6
            for path in ("compiled", "grouped"):
                new, new_res = res["grouped"][(name, path)]
                assert len(new) == len(old)
                for a, b in zip(new, old, strict=True):
                    assert torch.equal(a, b), (name, path)
                for a, b in zip(new_res, old_res, strict=True):
                    assert torch.equal(a, b), (name, path)
        first, second = (res["grouped"][(name, "compiled")][0] for res in run)
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b) and torch.count_nonzero(a) > 0, name
    for res in run:  # spardl: 2 blocks x 2 buckets x 3 iterations; topk: 1 x 2 x 3
        assert res["grouped"]["counts"].get("kernel", 0) >= 15, res["grouped"]["counts"]
