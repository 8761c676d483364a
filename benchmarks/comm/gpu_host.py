"""Where a hook's host time goes on a GPU (issue 19): per hook, the host-side operations of a
few training iterations by self CPU time, beyond torch's ``noop_hook``.

``gpu_hooks.py`` showed the iteration host-bound on the lent H100 (the time a sparse hook adds
follows how much longer ``backward()`` keeps the host, not its kernel time), so this asks what
the host does: every aten operator and CUDA runtime call (``cudaLaunchKernel``,
``cudaMalloc``, ``cudaFree``, ``cudaStreamSynchronize``, ``cudaMemcpyAsync``...) that
``torch.profiler`` records on any thread (the DDP hook runs on autograd's device thread), with
its calls and self CPU time per iteration, and the host wall time of an iteration. The
recorded self CPU time is summed over all threads; Python run inside an operator's span (the
hook's own code inside ``AccumulateGrad``) counts as that span's self time.

Same recipe and replica as ``gpu_hooks.py`` (``build``): DDP over NCCL at world size 1, bf16
autocast, density 1 %. Per hook: ``--warmup`` untimed iterations, then ``--iters`` under the
profiler, synchronised at the end only.

    python benchmarks/comm/gpu_host.py --out benchmarks/results
    python benchmarks/comm/gpu_host.py --dry-run --out /tmp/gpu_host_dry   # CPU, tiny model
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_hooks  # noqa: E402  (sets the Triton mode for --dry-run before torch is imported)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

HOOKS = "noop,dense,topk,gaussiank,gaussiank+triton,spardl,spardl+triton"
TOP = 14


def host_profile(run: gpu_hooks.Run, args, device: torch.device) -> dict[str, Any]:
    """``--iters`` iterations of ``run`` under the profiler: per operator name, calls and self
    CPU ms per iteration; the host wall time of an iteration."""
    cuda = device.type == "cuda"
    for _ in range(args.warmup):
        run.step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.iters):
            run.step()
        wall = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.key_averages():
        if e.self_cpu_time_total <= 0:
            continue
        ops[e.key][0] += e.count / args.iters
        ops[e.key][1] += e.self_cpu_time_total / 1000 / args.iters
    return {
        "hook": run.label,
        "host_ms": 1000 * wall / args.iters,
        "ops": {k: v for k, v in sorted(ops.items(), key=lambda kv: -kv[1][1])},
    }


def report(result: dict[str, Any]) -> str:
    rows = result["rows"]
    base = next(r for r in rows if r["hook"] == "noop")
    lines = [
        "# Where a hook's host time goes (world size 1)",
        "",
        f"{result['device']}, torch {result['torch']}. Recipe `{result['recipe']}` "
        f"(`gpu_hooks.py`), {result['bucket_mb']:g} MB buckets, density {result['density']}; "
        f"{result['warmup']} warm-up + {result['iters']} profiled iterations per hook "
        "(`benchmarks/comm/gpu_host.py`). Self CPU time of every operator and CUDA runtime "
        "call the profiler records, on all threads, per iteration.",
        "",
        "| hook | host ms / iteration | beyond noop | recorded self CPU ms | beyond noop |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        rec = sum(ms for _, ms in r["ops"].values())
        rec0 = sum(ms for _, ms in base["ops"].values())
        lines.append(
            f"| {r['hook']} | {r['host_ms']:.2f} | {r['host_ms'] - base['host_ms']:+.2f} | "
            f"{rec:.2f} | {rec - rec0:+.2f} |"
        )
    for r in rows:
        if r["hook"] == "noop":
            continue
        grown = []
        for name, (calls, ms) in r["ops"].items():
            c0, m0 = base["ops"].get(name, (0.0, 0.0))
            grown.append((ms - m0, calls - c0, name))
        grown.sort(reverse=True)
        lines += [
            "",
            f"**{r['hook']}**: operators whose self CPU time per iteration grew most",
            "",
            "| operator | calls + | self CPU ms + |",
            "|---|---|---|",
        ]
        lines += [f"| `{n[:70]}` | {c:+.0f} | {m:+.3f} |" for m, c, n in grown[:TOP]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="resnet50")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--hooks", default=HOOKS)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model (gpu_hooks.py's)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    if "noop" not in args.hooks.split(","):
        raise SystemExit("--hooks must include noop: every figure is given beyond it")
    if args.dry_run:
        args.iters, args.warmup, args.classes, args.bucket_mb = 2, 1, 10, 2.0
    device, _ = gpu_hooks.start(args.dry_run)
    recipe = (gpu_hooks.DRY_RECIPES if args.dry_run else gpu_hooks.RECIPES)[args.recipe]
    init, xs, ys = gpu_hooks.inputs(recipe, args, device, batches=1)
    rows = []
    for label in args.hooks.split(","):
        run = gpu_hooks.build(label, args, recipe, args.bucket_mb, init, (xs, ys), device)
        rows.append(host_profile(run, args, device))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "ops"}), flush=True)
        del run
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    result = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (dry run)",
        "torch": torch.__version__,
        "recipe": args.recipe,
        "bucket_mb": args.bucket_mb,
        "density": args.density,
        "warmup": args.warmup,
        "iters": args.iters,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comm_gpu_host.json").write_text(json.dumps(result, indent=1))
    (args.out / "comm_gpu_host.md").write_text(report(result))
    print(f"wrote {args.out / 'comm_gpu_host.md'}")


if __name__ == "__main__":
    main()
