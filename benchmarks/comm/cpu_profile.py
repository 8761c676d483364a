"""Where a sparse hook's CPU time goes, per rank, on real ResNet-18 gradients (issue 19).

Two (``--workers``) gloo processes on loopback, each pinned to a core of its own
(``--pin-from``), call the hook directly on DDP-shaped buckets of timm ``resnet18``'s
gradient (``zero_init_last=False``, ``--batch`` random images of ``--px`` pixels: the
recipe of ``iteration.py``), like ``worker.py`` does. After ``--warmup`` iterations (so the
residuals are in their steady state and the scratch buffers exist):

* ``--iters`` timed iterations per variant, the variants interleaved iteration by iteration
  (``plain``: ``select.CPU_KERNEL = select.CPU_GROUPED = exchange.SPARSE_AVERAGE = False``,
  the reference paths; ``grouped``: issue 19's torch paths: the driver's one-pass error
  feedback with the column maxima (``prescan``), the grouped candidate scan and the sparse
  average; ``compiled``: the defaults, the compiled single pass of ``cpu_kernels``, whose
  numba kernels the profile lists as ``numba::<kernel>``), each on a state of its own fed
  the same gradients; per iteration the wall time of all hook calls after a barrier and the
  calling thread's CPU time (``time.thread_time``: what the other jobs of a busy machine do
  not inflate as much as wall time);
* ``--profiled`` profiled iterations per variant (``torch.profiler``, CPU, with Python
  stacks): every aten operation's self time is attributed to the innermost function of
  ``training/comm`` among its parents, summed by (function, operation) per iteration, and
  the tables give the median over the profiled iterations;
* the floor: one pass over a buffer of the gradient's size on this core (``sum`` reads it,
  ``add_`` reads two and writes one, ``zero_`` writes one), best of 15.

    python benchmarks/comm/cpu_profile.py --out benchmarks/results/comm_cpu_profile.md

Loopback is not a shaped link: the exchanges here cost what gloo's copies and round trips
cost, not wire time (``run.py --mode iteration`` measures whole iterations on 1 Gbit/s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.comm.worker import ddp_buckets, model_gradients  # noqa: E402
from zoopick.training.comm import SimpleBucket, exchange, make_hook, select  # noqa: E402

# variant: (select.CPU_KERNEL, select.CPU_GROUPED, exchange.SPARSE_AVERAGE)
VARIANTS = {
    "plain": (False, False, False),
    "grouped": (False, True, True),
    "compiled": (True, True, True),
}


def use_variant(name: str) -> None:
    """Switch the module flags of ``training/comm`` to a variant's paths."""
    select.CPU_KERNEL, select.CPU_GROUPED, exchange.SPARSE_AVERAGE = VARIANTS[name]


def trace_kernels() -> None:
    """Wrap the numba kernels of ``cpu_kernels`` in profiler ranges (``numba::<name>``): the
    profiler sees only aten operations otherwise."""
    kernels = select._load_cpu_kernels()
    if kernels is None:
        return
    for name in ("_accumulate", "_candidates"):
        kernel = getattr(kernels, name)

        def traced(*args, _kernel=kernel, _label=f"numba::{name}"):
            with torch.profiler.record_function(_label):
                return _kernel(*args)

        setattr(kernels, name, traced)


def floor_ms(numel: int) -> dict[str, float]:
    """Best-of-15 time of one pass over ``numel`` float32 elements on this thread."""
    x, y = torch.randn(numel), torch.randn(numel)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    return {
        "sum (read 1)": best(lambda: x.sum()),
        "zero_ (write 1)": best(lambda: x.zero_()),
        "add_ (read 2, write 1)": best(lambda: x.add_(y)),
    }


def _owner(event: Any) -> str:
    """The innermost function of ``training/comm`` among an event's Python parents
    (``path(line): function`` events recorded with ``with_stack=True``)."""
    parent = event.cpu_parent
    while parent is not None:
        if "training/comm/" in parent.name and ": " in parent.name:
            path, function = parent.name.rsplit(": ", 1)
            return f"{function} ({path.split('training/comm/')[-1].split('(')[0]})"
        parent = parent.cpu_parent
    return "(outside training/comm)"


def profile_table(prof: Any) -> list[tuple[str, str, float, int]]:
    """(function, operation, self ms, calls), largest first."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        names = ("aten::", "c10d::", "gloo:", "numba::")
        if not ev.name.startswith(names) and "wait" not in ev.name:
            continue
        op = "wait (gloo)" if "wait" in ev.name else ev.name
        key = (_owner(ev), op)
        acc[key][0] += ev.self_cpu_time_total / 1e3
        acc[key][1] += 1
    rows = [(f, op, ms, int(c)) for (f, op), (ms, c) in acc.items()]
    return sorted(rows, key=lambda r: -r[2])


def median_table(
    runs: list[list[tuple[str, str, float, int]]],
) -> list[tuple[str, str, float, int]]:
    """Per (function, operation), the median self time over the profiled iterations (an
    operation missing from one counts 0 there): one iteration of a busy machine is noise."""
    keys = {(f, op) for table in runs for f, op, _, _ in table}
    per = [{(f, op): (ms, c) for f, op, ms, c in table} for table in runs]
    rows = [
        (
            f,
            op,
            statistics.median(p.get((f, op), (0.0, 0))[0] for p in per),
            max(p.get((f, op), (0.0, 0))[1] for p in per),
        )
        for f, op in keys
    ]
    return sorted(rows, key=lambda r: -r[2])


def run_rank(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=spec["world"],
        timeout=datetime.timedelta(seconds=600),
    )
    params, grads = model_gradients("resnet18", rank, spec["grads"], spec["px"], spec["batch"])
    groups = ddp_buckets([p.numel() * 4 for p in params])
    bucket_grads = [[[g[i] for i in idx] for idx in groups] for g in grads]
    numel = sum(p.numel() for p in params)
    if "compiled" in spec["variants"]:
        trace_kernels()
    setups = {}
    for name in spec["variants"]:
        state, hook = make_hook(spec["hook"], density=spec["density"])
        buckets = [
            SimpleBucket([params[i] for i in idx], index=b, is_last=b == len(groups) - 1)
            for b, idx in enumerate(groups)
        ]
        setups[name] = (state, hook, buckets)

    def iteration(name: str, it: int, prof: Any = None) -> tuple[float, float]:
        state, hook, buckets = setups[name]
        use_variant(name)
        for bucket, g in zip(buckets, bucket_grads[it % len(bucket_grads)], strict=True):
            bucket.set_gradients(g)
        dist.barrier()
        if prof is not None:
            prof.start()
        c0, t0 = time.thread_time(), time.perf_counter()
        for bucket in buckets:
            hook(state, bucket).wait()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if prof is not None:
            prof.stop()
        return wall, cpu

    for it in range(spec["warmup"]):
        for name in spec["variants"]:
            iteration(name, it)
    times: dict[str, dict[str, list[float]]] = {
        v: {"wall_ms": [], "cpu_ms": []} for v in spec["variants"]
    }
    for it in range(spec["iters"]):
        order = spec["variants"] if it % 2 == 0 else spec["variants"][::-1]
        for name in order:
            wall, cpu = iteration(name, spec["warmup"] + it)
            times[name]["wall_ms"].append(wall * 1e3)
            times[name]["cpu_ms"].append(cpu * 1e3)
    runs: dict[str, list[list[tuple[str, str, float, int]]]] = {v: [] for v in spec["variants"]}
    for rep in range(spec["profiled"]):
        for name in spec["variants"] if rep % 2 == 0 else spec["variants"][::-1]:
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True
            )
            iteration(name, spec["warmup"] + spec["iters"] + rep, prof)
            runs[name].append(profile_table(prof))
    tables = {name: median_table(r) for name, r in runs.items()}
    out = {"rank": rank, "numel": numel, "times": times, "tables": tables}
    out["floor_ms"] = floor_ms(numel)
    dist.barrier()
    dist.destroy_process_group()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CATEGORIES = (  # (category, functions of training/comm whose operations count there)
    (
        "error feedback: acc = residual + gradient (fused: + bucket zeroed, column maxima or "
        "candidates)",
        ("_run", "accumulate", "_add_zero", "pre_threshold"),
    ),
    (
        "selection: |x|, sample, threshold, compare, candidates, trim",
        (
            "topk_indices",
            "_sampled_topk",
            "_sampled_topk_grouped",
            "_sample_threshold",
            "grouped_positions",
            "sparse_positions",
            "touch",
            "trim_candidates",
        ),
    ),
    ("selected values out of the residual (gather, subtract)", ("take", "round_to")),
    ("packing and unpacking pairs", ("pack", "unpack", "split", "<listcomp>")),
    ("exchanges (gloo, waits included)", ("p2p_exchange", "allgather_parts")),
    ("received pairs added, average written into the bucket", ("add_pairs", "write")),
)


def category(function: str, op: str) -> str:
    """The row of the summary table an operation's time goes to."""
    if op in ("aten::empty", "aten::empty_strided", "aten::resize_"):
        return "allocation"
    name = function.split(" (")[0]
    for cat, functions in CATEGORIES:
        if name in functions:
            return cat
    return "other (views, bookkeeping)"


def _fmt(vals: list[float]) -> str:
    return f"{statistics.median(vals):.1f} [{min(vals):.1f}-{max(vals):.1f}]"


def render(spec: dict[str, Any], ranks: list[dict[str, Any]], argv: list[str]) -> str:
    """The markdown report: hook times, the floor, a summary by category, the top rows."""
    variants = spec["variants"]
    heads = " | ".join(f"rank {r['rank']} ms" for r in ranks)
    ranks_label = " / ".join(f"rank {r['rank']}" for r in ranks)
    lines = [
        "# Sparse hook CPU profile (issue 19)",
        "",
        f"`python benchmarks/comm/cpu_profile.py {' '.join(argv)}`: hook `{spec['hook']}`, "
        f"density {spec['density']}, P = {spec['world']} gloo processes on loopback, one core "
        f"each (pinned from core {spec['pin_from']}), timm resnet18 (`zero_init_last=False`) "
        f"at {spec['px']} px, batch {spec['batch']}, DDP's buckets; {spec['warmup']} warm-up "
        f"iterations, then {spec['iters']} timed ones per variant, interleaved. Load average "
        f"before: {spec['load_before']}, after: {spec['load_after']}.",
        "",
        "## Hook time per iteration (all buckets), median [min-max] over iterations",
        "",
        "| rank | variant | wall ms | thread CPU ms |",
        "|---|---|---|---|",
    ]
    for r in ranks:
        for v in variants:
            t = r["times"][v]
            lines.append(f"| {r['rank']} | {v} | {_fmt(t['wall_ms'])} | {_fmt(t['cpu_ms'])} |")
    lines += [
        "",
        f"## The floor: one pass over {ranks[0]['numel']:,} float32 elements on one core",
        "",
        "| pass | ms (best of 15, on each rank's core) |",
        "|---|---|",
        *[
            f"| {key} | " + " / ".join(f"{r['floor_ms'][key]:.2f}" for r in ranks) + " |"
            for key in ranks[0]["floor_ms"]
        ],
        "",
        f"## A profiled iteration by category (self CPU ms of the operations, median of "
        f"{spec['profiled']} profiled iterations; the profiler itself adds to each)",
        "",
        "| category | " + " | ".join(f"{v} ms ({ranks_label})" for v in variants) + " |",
        "|---|" + "---|" * len(variants),
    ]
    cats = [cat for cat, _ in CATEGORIES] + ["allocation", "other (views, bookkeeping)"]
    sums = {
        (v, r["rank"], c): sum(ms for f, op, ms, _ in r["tables"][v] if category(f, op) == c)
        for v in variants
        for r in ranks
        for c in cats
    }
    for c in [*cats, "total"]:
        cells = []
        for v in variants:
            vals = [
                sum(sums[(v, r["rank"], x)] for x in cats)
                if c == "total"
                else sums[(v, r["rank"], c)]
                for r in ranks
            ]
            cells.append(" / ".join(f"{x:.1f}" for x in vals))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for v in variants:
        per = [{(f, op): ms for f, op, ms, _ in r["tables"][v]} for r in ranks]
        keys = sorted({k for p in per for k in p}, key=lambda k: -sum(p.get(k, 0.0) for p in per))
        lines += [
            "",
            f"## Top operations, variant `{v}` (self CPU ms by function and operation, median "
            f"of {spec['profiled']} profiled iterations)",
            "",
            f"| function (file) | operation | {heads} |",
            "|---|---|" + "---|" * len(ranks),
        ]
        for key in keys[: spec["rows"]]:
            cells = " | ".join(f"{p.get(key, 0.0):.2f}" for p in per)
            lines.append(f"| {key[0]} | {key[1]} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hook", default="spardl")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--px", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--grads", type=int, default=3, help="distinct gradients, cycled")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--pin-from", type=int, default=0, help="-1: no pinning")
    ap.add_argument("--rows", type=int, default=18, help="rows of each profile table")
    ap.add_argument("--profiled", type=int, default=5, help="profiled iterations per variant")
    ap.add_argument("--out", type=Path, help="markdown file (default: print)")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:  # a worker
        spec = json.loads(args.spec.read_text())
        if spec["pin_from"] >= 0:
            os.sched_setaffinity(0, {spec["pin_from"] + args.rank})
        result = run_rank(spec, args.rank)
        Path(spec["dir"], f"rank{args.rank}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown or not variants:
        ap.error(f"--variants: choose from {sorted(VARIANTS)}")
    if args.pin_from >= 0 and args.pin_from + args.workers > os.cpu_count():
        ap.error(f"--pin-from {args.pin_from}: needs {args.workers} cores from there")
    with tempfile.TemporaryDirectory(prefix="zp_cpuprof_") as tmp:
        spec = {
            "hook": args.hook,
            "density": args.density,
            "world": args.workers,
            "px": args.px,
            "batch": args.batch,
            "grads": args.grads,
            "warmup": args.warmup,
            "iters": args.iters,
            "variants": variants,
            "pin_from": args.pin_from,
            "rows": args.rows,
            "profiled": args.profiled,
            "port": _free_port(),
            "dir": tmp,
            "load_before": [round(x, 2) for x in os.getloadavg()],
        }
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps(spec))
        procs = [
            subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--spec", str(spec_path)])
            for r in range(args.workers)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"workers failed: exit codes {codes}", file=sys.stderr)
            return 1
        spec["load_after"] = [round(x, 2) for x in os.getloadavg()]
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.workers)]
    text = render(spec, ranks, argv)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
