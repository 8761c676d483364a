"""Host time a hook spends per bucket call, apart from its kernels (issue 19): a CPU proxy.

On the lent H100 the ResNet-50 iteration is host-bound and a sparse hook's added time follows
the host time of ``backward()``; ``gpu_host.py`` put most of it in Python run inside DDP's
``AccumulateGrad`` (the hook's own code), with hundreds of per-parameter slices and views per
iteration. That part does not need a GPU to measure: here every hook is called directly on a
``SimpleBucket`` laid out like DDP's (``--params`` parameters of ``--numel`` elements each,
ResNet-50's 161 parameters over 4 buckets of 25 MB is about 40 per bucket), small enough
that the kernels themselves cost little, on the device selection path
(``select.CPU_SHORTCUTS`` off: the code a CUDA tensor takes, minus Triton). Baseline in the
same run: torch's ``noop_hook``, which returns its bucket. Wall time per call, median of
``--calls`` after ``--warmup``, with ``--repeats`` interleaved repeats (min of the medians).

A label ``name+graph`` (``cuda_graphs=True``) runs the graphed path's host code, the code
a replayed bucket runs on a GPU host, with CPU stand-ins for what only CUDA has
(:func:`graph_proxy`): a bucket is "captured" by running its step once, eagerly, and a
"replay" does nothing, so the figure is the hook's host work around a replay, without the
replay's launch and without the cost of the CUDA events a timed replay records (one call in
``graphs.TIME_EVERY``).

This is an estimate of host work on this machine's CPU, labelled as such: the GPU host's
figures are ``gpu_host.py``'s and ``gpu_hooks.py``'s, which this does not replace.

    python benchmarks/comm/host_overhead.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zoopick.training.comm import SimpleBucket, make_hook, select  # noqa: E402

HOOKS = "noop,topk,gaussiank,spardl,dfs,exdyna,spardl+graph,gaussiank+graph"


class _StandInGraph:
    """``torch.cuda.CUDAGraph`` on a CPU: the capture ran the step eagerly; a replay is free."""

    def replay(self) -> None:
        pass


class _StandInEvent:
    """A CUDA event on a CPU (``hostread.recorded_event``): always complete, no time between
    two."""

    @classmethod
    def recorded(cls, device: torch.device, *, timing: bool = False) -> _StandInEvent:
        return cls()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _StandInEvent) -> float:
        return 0.0


@contextmanager
def graph_proxy() -> Iterator[None]:
    """Within the block, ``graphs.BucketGraphs`` takes CPU buckets: its own code runs as on
    a GPU host, with the CUDA parts stood in for (see the module doc)."""
    from zoopick.training.comm import graphs, hostread

    eligible = graphs.BucketGraphs._eligible
    saved = (torch.cuda.CUDAGraph, torch.cuda.graph, hostread.recorded_event)

    @contextmanager
    def capture(graph, **_options):  # the step runs eagerly once, as the capture's call
        yield

    class _OnCuda:  # the predicate's one device question, answered yes for a CPU bucket
        is_cuda = True

    def cpu_eligible(state, buf, unused, density):
        return eligible(state, _OnCuda(), unused, density)

    graphs.BucketGraphs._eligible = staticmethod(cpu_eligible)
    torch.cuda.CUDAGraph, torch.cuda.graph, hostread.recorded_event = (
        _StandInGraph, capture, _StandInEvent.recorded,
    )  # fmt: skip
    try:
        yield
    finally:
        graphs.BucketGraphs._eligible = staticmethod(eligible)
        torch.cuda.CUDAGraph, torch.cuda.graph, hostread.recorded_event = saved


def time_hook(label: str, args, params: list[torch.Tensor], grads: list[torch.Tensor]) -> float:
    """Median wall microseconds per hook call over ``--calls`` calls on a fresh state."""
    name, *variants = label.split("+")
    if name == "noop":
        state, hook = None, noop_hook
    else:
        state, hook = make_hook(name, density=args.density, cuda_graphs="graph" in variants)
    # not the last bucket of an iteration: the stats' per-iteration close is 1 call in many
    bucket = SimpleBucket(params, is_last=False)
    times = []
    with graph_proxy() if "graph" in variants else nullcontext():
        for i in range(args.warmup + args.calls):
            bucket.set_gradients(grads)
            if state is not None and i % 4 == 0:  # an iteration of four buckets
                state.stats.finish()
                state.iteration += 1
            t0 = time.perf_counter()
            hook(state, bucket).wait()
            times.append(time.perf_counter() - t0)
    if state is not None and "graph" in variants:
        assert state.graphs.replays >= args.calls, "the graphed path did not run"
    return 1e6 * statistics.median(times[args.warmup :])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hooks", default=HOOKS)
    ap.add_argument("--params", type=int, default=40)
    ap.add_argument("--numel", type=int, default=256)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    select.CPU_SHORTCUTS = False  # the device path
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(args.numel)) for _ in range(args.params)]
    for p in params:
        p.grad = torch.zeros_like(p)
    grads = [torch.randn(args.numel, generator=gen) for _ in params]
    labels = args.hooks.split(",")
    runs: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(args.repeats):
        for label in labels:
            runs[label].append(time_hook(label, args, params, grads))
    dist.destroy_process_group()
    us = {label: min(v) for label, v in runs.items()}
    base = us.get("noop", 0.0)
    result = {"options": {k: str(v) for k, v in vars(args).items()}, "us_per_call": us,
              "added_us": {k: v - base for k, v in us.items()}, "runs": runs}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comm_host_overhead.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Host time per hook call (CPU proxy; see `benchmarks/comm/host_overhead.py`)",
        "",
        f"{args.params} parameters of {args.numel} elements per bucket, density "
        f"{args.density}, device selection path on this machine's CPU, one thread; median "
        f"of {args.calls} calls, best of {args.repeats} interleaved repeats. An estimate of "
        "host work, not a GPU measurement. `+graph`: the graphed path's host code around a "
        "replay, with CPU stand-ins for the graph and its events (the script's docstring).",
        "",
        "| hook | us per call | added over noop |",
        "|---|---|---|",
        *[f"| {k} | {v:.0f} | {v - base:.0f} |" for k, v in us.items()],
    ]
    (args.out / "comm_host_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
