"""The selection kernels alone on a GPU (issue 19): ``torch.topk`` against the fused Triton
select (the sample's bracket, and the radix levels alone) at several program sizes, and
GaussianK's plain against its fused path.

Why: runs D and E (``benchmarks/comm/README.md``) left spardl's graphed step kernel-bound
(its replay's GPU time, 1.0 ms an iteration at 25 MB buckets, is what it adds), with
``torch.topk``'s radix passes the largest part, while the fused Triton select took 3.25 ms,
most of it in its histogram pass ``_scan``. Each ``_scan`` program covers ``TILE * TILES``
elements and adds its 2,048-bin histogram to the block's with global atomics, so the
program size sets the atomic traffic: this sweeps ``TILES`` (no result depends on it) in one
short call, before any default changes. Since session 18 the fused top-k finds the k-th key
from a sample's bracket and one pass that copies the band (``triton_kernels._bracket``), with
no histogram pass where the bracket holds: both ways are timed, and each bucket reports
whether the bracket held.

Input, as the hooks see it: the recipe's model (``gpu_hooks.RECIPES``, random weights, seed
0; bf16 autocast, channels_last) runs ``--steps`` backward passes on random batches; the
gradients, flattened in DDP's bucket order (parameters reversed) and cut into
``--bucket-mb`` buckets (DDP's smaller first bucket is not modelled), go through error
feedback with an exact top-k at ``--density`` (``acc = grad + residual``; the residual keeps
what was not sent), and the last step's ``acc`` of each bucket is what every path selects
from. Degenerate inputs are reported
(share of exact zeros, the k-th largest magnitude against the largest, ties at the k-th).

Each path runs on a fresh copy of the bucket (the fused paths take the values out of it),
timed by CUDA events around the selection alone, ``--reps`` times after ``--warmup``; the
median per bucket, summed over the buckets (an iteration's worth). Every fused top-k is
checked to select the same set as ``torch.topk`` where the k-th magnitude is not tied.

    python benchmarks/comm/gpu_select.py --out benchmarks/results
    python benchmarks/comm/gpu_select.py --dry-run --out /tmp/gpu_select_dry   # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_hooks  # noqa: E402  (sets the Triton mode for --dry-run before torch is imported)
import torch  # noqa: E402

from zoopick.training.comm import select, triton_kernels  # noqa: E402


def gradient_buckets(args, device: torch.device) -> list[torch.Tensor]:
    """The last step's ``acc`` (gradient + residual) of every bucket (see the module doc)."""
    recipes = gpu_hooks.DRY_RECIPES if args.dry_run else gpu_hooks.RECIPES
    recipe = recipes[args.recipe]
    torch.manual_seed(0)
    model = gpu_hooks.create_model(recipe, args.classes, args.dry_run).to(device)
    if recipe["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    cap = int(args.bucket_mb * 2**20) // 4
    buckets: list[list[torch.nn.Parameter]] = [[]]
    for p in params:
        if buckets[-1] and sum(q.numel() for q in buckets[-1]) + p.numel() > cap:
            buckets.append([])
        buckets[-1].append(p)
    residual = [torch.zeros(sum(p.numel() for p in b), device=device) for b in buckets]
    accs: list[torch.Tensor] = []
    _, xs, ys = gpu_hooks.inputs(recipe, args, device, args.steps)
    for x, y in zip(xs, ys, strict=True):
        model.zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        accs = []
        for b, res in zip(buckets, residual, strict=True):
            acc = torch.cat([p.grad.flatten().float() for p in b]) + res
            k = select.k_for(args.density, acc.numel())
            idx = torch.topk(acc.abs(), k, sorted=False).indices
            res.copy_(acc)
            res[idx] = 0.0
            accs.append(acc)
    return accs


def describe(acc: torch.Tensor, k: int) -> dict[str, Any]:
    """What makes a selection input degenerate: exact zeros, a flat top, ties at the k-th."""
    mag = acc.abs()
    top = torch.topk(mag, k).values
    kth = top[-1]
    return {
        "numel": acc.numel(),
        "k": k,
        "zeros": float((acc == 0).float().mean()),
        "kth_over_max": float(kth / top[0]) if float(top[0]) > 0 else 0.0,
        "tied_at_kth": int((mag == kth).sum()),
    }


def timed(fn, x: torch.Tensor, args) -> tuple[float, Any]:
    """Median ms of ``fn(copy of x)`` by events around the call, and the last result."""
    work = torch.empty_like(x)
    times, out = [], None
    for rep in range(args.warmup + args.reps):
        work.copy_(x)
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(work)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            out = fn(work)
            ms = (time.perf_counter() - t0) * 1e3
        if rep >= args.warmup:
            times.append(ms)
    return statistics.median(times), out


def topk_paths(args) -> dict[str, Any]:
    """Path name -> function of a bucket returning its selected positions (spardl's)."""
    paths: dict[str, Any] = {
        "torch.topk": lambda w: torch.topk(w.abs(), k_of(w, args), sorted=False).indices
    }
    for bracket in (True, False):
        for tiles in args.tiles:

            def fused(w: torch.Tensor, tiles: int = tiles, bracket: bool = bracket):
                triton_kernels.TILES, triton_kernels.BRACKET = tiles, bracket
                where = triton_kernels.blocks([0], [w.numel()], w.device)
                idx, _ = triton_kernels.take_topk(w, where, k_of(w, args))
                return idx[0]

            way = "bracket" if bracket else "radix"
            paths[f"triton {way} tiles={tiles}"] = fused
    return paths


def bracket_fit(acc: torch.Tensor, k: int) -> dict[str, Any]:
    """Whether the sample's bracket held the k-th key of this bucket (else the radix levels
    ran), and the band's fill against its capacity."""
    where = triton_kernels.blocks([0], [acc.numel()], acc.device)
    state = torch.zeros(1, triton_kernels.STATE, dtype=torch.int64, device=acc.device)
    _, sizes = triton_kernels._bracket(acc.clone(), where, k, state)
    above, inside = sizes.long().tolist()
    plan = triton_kernels.bracket_plan((acc.numel(),), k, acc.device)
    return {
        "bracket_hit": bool(state[0, 2]),
        "band": inside[0],
        "band_capacity": plan.capacity,
        "above_band": above[0],
    }


def gaussiank_paths(args) -> dict[str, Any]:
    def plain(w: torch.Tensor) -> torch.Tensor:
        k = k_of(w, args)
        thr, _ = select.gaussian_threshold(w, k, 3)
        idx, _, _ = select.capped_indices(w, thr, select.gaussiank_capacity(k))
        return idx

    def fused(w: torch.Tensor) -> torch.Tensor:
        k = k_of(w, args)
        idx, _, _, _ = triton_kernels.take_gaussiank(w, k, 3, select.gaussiank_capacity(k))
        return idx

    return {"gaussiank plain": plain, "gaussiank triton": fused}


def k_of(w: torch.Tensor, args) -> int:
    return select.k_for(args.density, w.numel())


def run(args) -> dict[str, Any]:
    device, _ = gpu_hooks.start(args.dry_run)
    select.CUDA_TRITON = True
    default_tiles, default_bracket = triton_kernels.TILES, triton_kernels.BRACKET
    accs = gradient_buckets(args, device)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)",
        "torch": torch.__version__,
        "options": {k: str(v) for k, v in vars(args).items()},
        "default_tiles": default_tiles,
        "default_bracket": triton_kernels.BRACKET,
        "buckets": [describe(a, k_of(a, args)) | bracket_fit(a, k_of(a, args)) for a in accs],
        "paths": {},
    }
    reference: list[set[int]] = []  # torch.topk's set per bucket (its path runs first)
    for group in (topk_paths(args), gaussiank_paths(args)):
        for name, fn in group.items():
            per_bucket, same = [], []
            for i, acc in enumerate(accs):
                ms, idx = timed(fn, acc, args)
                per_bucket.append(ms)
                if name == "torch.topk":
                    reference.append(set(idx.tolist()))
                elif name.startswith("triton"):
                    tied = result["buckets"][i]["tied_at_kth"] > 1
                    same.append(tied or set(idx.tolist()) == reference[i])
            row = {"ms_per_bucket": per_bucket, "ms": sum(per_bucket)}
            if same:
                row["same_set_as_topk"] = all(same)
            result["paths"][name] = row
            print(json.dumps({"path": name, **row}), flush=True)
    result["profiles"] = profiles(args, accs, default_tiles, device)
    triton_kernels.TILES, triton_kernels.BRACKET = default_tiles, default_bracket
    return result


def profiles(args, accs: list[torch.Tensor], tiles: int, device: torch.device) -> dict:
    """Where each path's time goes: the kernels of one call on the largest bucket under
    torch.profiler (``gpu_hooks.profile_step``), for ``torch.topk``, the fused top-k both
    ways at the default program size and GaussianK's two paths."""
    acc = max(accs, key=lambda a: a.numel())
    paths = topk_paths(args) | gaussiank_paths(args)
    out = {}
    names = ("torch.topk", f"triton bracket tiles={tiles}", f"triton radix tiles={tiles}")
    for name in (*names, "gaussiank plain", "gaussiank triton"):
        fn = paths.get(name)
        if fn is None:
            continue
        work = acc.clone()
        fn(work)  # compiled and cached outside the profile

        def one(_: int, fn=fn, work=work) -> None:
            work.copy_(acc)
            fn(work)

        out[name] = gpu_hooks.profile_step(one, 0, device)
    return out


def report(result: dict[str, Any]) -> str:
    base = result["paths"]["torch.topk"]["ms"]
    lines = [
        "# Selection kernels alone on a GPU (issue 19)",
        "",
        f"{result['device']}, torch {result['torch']}. Recipe `{result['options']['recipe']}`, "
        f"{result['options']['bucket_mb']} MB buckets, density {result['options']['density']}; "
        f"input: the last of {result['options']['steps']} error-feedback steps "
        "(`benchmarks/comm/gpu_select.py`, whose docstring gives the recipe). Median of "
        f"{result['options']['reps']} event-timed runs per bucket, summed over the buckets. "
        f"The hooks' default is tiles={result['default_tiles']}, "
        f"bracket={result['default_bracket']}.",
        "",
        "| bucket | elements | k | exact zeros | k-th / max | tied at k-th | bracket held T "
        "| band / capacity |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, b in enumerate(result["buckets"]):
        lines.append(
            f"| {i} | {b['numel']:,} | {b['k']:,} | {b['zeros']:.3f} | "
            f"{b['kth_over_max']:.3g} | {b['tied_at_kth']} | "
            f"{'yes' if b['bracket_hit'] else '**no**'} | {b['band']:,} / {b['band_capacity']:,} |"
        )
    lines += [
        "",
        "| path | ms an iteration | vs torch.topk | same set as torch.topk |",
        "|---|---|---|---|",
    ]
    for name, row in result["paths"].items():
        same = {True: "yes", False: "**no**"}.get(row.get("same_set_as_topk"), "—")
        lines.append(f"| {name} | {row['ms']:.3f} | {row['ms'] / base:.2f}x | {same} |")
    for name, prof in result.get("profiles", {}).items():
        lines += [
            "",
            f"Kernels of one `{name}` call on the largest bucket (profiled; the bucket copy "
            f"included): {prof['kernels']} kernels, {prof['kernel_ms']:.3f} ms, "
            f"{prof['launches']} launches.",
            "",
            "| kernel | calls | ms |",
            "|---|---|---|",
        ]
        for kernel, (calls, ms) in list(prof["by_kernel"].items())[:12]:
            lines.append(f"| `{kernel}` | {calls} | {ms:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="resnet50", choices=sorted(gpu_hooks.RECIPES))
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiles", type=lambda s: [int(t) for t in s.split(",")], default=[4, 16, 64])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model (gpu_hooks.py's)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    if args.dry_run:
        args.reps, args.warmup, args.bucket_mb = min(args.reps, 2), 1, min(args.bucket_mb, 0.25)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comm_gpu_select.json").write_text(json.dumps(result, indent=1))
    (args.out / "comm_gpu_select.md").write_text(report(result))
    print(f"wrote {args.out / 'comm_gpu_select.md'}")


if __name__ == "__main__":
    main()
