"""The hooks on a GPU: what selection and packing cost against the backward pass, whether the
steady state is free of host syncs, and what the side stream (``async_comm``) buys.

Recipe: timm ``resnet50`` (``zero_init_last=False``, random weights), ``--batch`` random
images of ``--px`` pixels, 1000 classes, bf16 autocast and channels_last as
``zoopick train`` runs on a GPU, DDP (default 25 MB buckets) over NCCL at world size 1 (one
GPU: no bytes leave it, so what a hook adds is its selection, packing and bookkeeping),
plain SGD. Per hook a fresh DDP wraps the same initial weights; ``--warmup`` iterations, then
``--iters`` timed ones, each timed by CUDA events around forward + backward (DDP runs the
hook inside backward), with no host sync inside the timed loop; *added* = the median
iteration minus the same with torch's ``noop_hook``. *select* is the hook's own event-timed
selection seconds. *host backward* is how long ``backward()`` kept the host: a hook that
syncs makes it as long as the device work.

Host syncs: the timed iterations run under ``torch.cuda.set_sync_debug_mode("warn")``; each
warning (a synchronising CUDA call) is counted with the line that made it. The count of the
``noop`` row is what the training loop and DDP themselves do.

    python benchmarks/comm/gpu_hooks.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zoopick.training.comm import make_hook  # noqa: E402

HOOKS = "noop,dense,topk,gaussiank,spardl,spardl+async,exdyna,dfs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def attach(ddp: DDP, label: str, density: float):
    if label == "noop":
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        ddp.register_comm_hook(None, noop_hook)
        return None
    name, _, variant = label.partition("+")
    options = {"async_comm": True} if variant == "async" else {}
    state, hook = make_hook(name, density=density, **options)
    ddp.register_comm_hook(state, hook)
    return state


def run_hook(label: str, args, init: dict[str, torch.Tensor], data) -> dict[str, Any]:
    import timm

    model = timm.create_model(args.model, num_classes=1000, zero_init_last=False)
    model.load_state_dict(init)
    model.cuda().to(memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[0])
    state = attach(ddp, label, args.density)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    xs, ys = data

    def step(i: int) -> None:
        x, y = xs[i % len(xs)], ys[i % len(ys)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
        t0 = time.perf_counter()
        loss.backward()
        host_backward.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    host_backward: list[float] = []
    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    host_backward.clear()
    if state is not None:
        state.stats.resolve()
        before = dict(state.stats.cumulative)
    events = []
    syncs: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(args.iters):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                step(args.warmup + i)
                end.record()
                events.append((start, end))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            where = f"{Path(w.filename).name}:{w.lineno}"
            syncs[where] = syncs.get(where, 0) + 1
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in events]
    row: dict[str, Any] = {
        "hook": label,
        "iteration_ms": statistics.median(ms),
        "iteration_ms_all": ms,
        "host_backward_ms": 1000 * statistics.median(host_backward),
        "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20,
        "syncs": sum(syncs.values()),
        "sync_sites": syncs,
    }
    if state is not None:
        state.stats.resolve()
        after = state.stats.cumulative
        n = after["iterations"] - before["iterations"]
        row["select_ms"] = 1000 * (after["select_s"] - before["select_s"]) / n
        row["comm_ms"] = 1000 * (after["comm_s"] - before["comm_s"]) / n
        row["nnz_per_iter"] = (after["nnz"] - before["nnz"]) / n
        row["numel_per_iter"] = (after["numel"] - before["numel"]) / n
        row["buckets_per_iter"] = (after["buckets"] - before["buckets"]) / n
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--px", type=int, default=224)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--hooks", default=HOOKS)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_hooks.py needs a CUDA device")
    import timm

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.manual_seed(0)
    init = timm.create_model(args.model, num_classes=1000, zero_init_last=False).state_dict()
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [
        torch.randn(args.batch, 3, args.px, args.px, device="cuda", generator=gen).contiguous(
            memory_format=torch.channels_last
        )
        for _ in range(3)
    ]
    ys = [torch.randint(0, 1000, (args.batch,), device="cuda", generator=gen) for _ in range(3)]
    rows = []
    t0 = time.time()
    for label in args.hooks.split(","):
        rows.append(run_hook(label, args, init, (xs, ys)))
        torch.cuda.empty_cache()
        shown = {k: v for k, v in rows[-1].items() if k != "iteration_ms_all"}
        print(json.dumps(shown), flush=True)
    base = next(r for r in rows if r["hook"] == "noop")
    for r in rows:
        r["added_ms"] = r["iteration_ms"] - base["iteration_ms"]
        r["added_syncs"] = r["syncs"] - base["syncs"]
    result = {
        "recipe": vars(args) | {"out": str(args.out)},
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "seconds": time.time() - t0,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comm_gpu.json").write_text(json.dumps(result, indent=1))
    (args.out / "comm_gpu.md").write_text(report(result))
    dist.destroy_process_group()


def report(result: dict[str, Any]) -> str:
    r = result["recipe"]
    lines = [
        "# Hooks on a GPU (world size 1)",
        "",
        f"{result['device']}, torch {result['torch']}. timm `{r['model']}` "
        f"(`zero_init_last=False`), batch {r['batch']} x {r['px']} px, bf16 autocast, "
        f"channels_last, DDP over NCCL at world size 1, density {r['density']}, "
        f"{r['warmup']} warm-up + {r['iters']} timed iterations per hook "
        "(`benchmarks/comm/gpu_hooks.py`). No bytes leave the GPU at world size 1: *added* is "
        "selection, packing and bookkeeping. Iteration = forward + backward by CUDA events "
        "(median); *host backward* = how long `backward()` held the host; *syncs* = "
        "synchronising CUDA calls in the timed iterations (`set_sync_debug_mode('warn')`), "
        "beyond those of the `noop` row.",
        "",
        "| hook | iteration ms | added ms | added / backward+forward | select ms | host backward "
        "ms | peak MB | extra syncs | sync sites |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = next(x for x in result["rows"] if x["hook"] == "noop")["iteration_ms"]
    for x in result["rows"]:
        sites = ", ".join(f"`{k}` x{v}" for k, v in x["sync_sites"].items()) or "none"
        sel = f"{x['select_ms']:.2f}" if "select_ms" in x else "—"
        lines.append(
            f"| {x['hook']} | {x['iteration_ms']:.2f} | {x['added_ms']:.2f} | "
            f"{x['added_ms'] / base:.3f} | {sel} | {x['host_backward_ms']:.2f} | "
            f"{x['peak_mem_mb']:.0f} | {x['added_syncs']} | {sites} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
