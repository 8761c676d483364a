"""One worker of the whole-iteration benchmark: real DDP training iterations with each hook.

Started by ``run.py --mode iteration`` once per (P, link), inside its own network namespace
(or on loopback), like ``worker.py``:

    python benchmarks/comm/iteration.py SPEC.json RANK

Recipe (a realistic gradient, not the degenerate one of ``worker.py``'s default): timm
``resnet18`` with ``zero_init_last=False`` (so no residual block starts with a zero BatchNorm
scale), the same random weights on every rank, a batch of ``batch`` random images of
``px`` x ``px`` pixels per rank (different on every rank and iteration), cross-entropy over
1000 classes, DDP with its default buckets, plain SGD (lr 0.01, no momentum). The fraction of
exact zeros in the local gradient is measured and reported (96 px, batch 2: about 0.1 %;
at 32 px with the default ``zero_init_last`` it is 94 %).

Per hook (``noop`` = torch's ``noop_hook``, the baseline of "time a hook adds"; ``dense``;
``powersgd`` rank 4; ours by name, ``spardl-tD`` = D teams, ``-async`` = ``async_comm``,
``-plain`` = the reference CPU paths of issue 19: ``select.CPU_GROUPED``,
``select.CPU_KERNEL`` and ``exchange.SPARSE_AVERAGE`` off, the code before that work;
``-grouped`` = the torch paths of issue 19 without the compiled pass: ``select.CPU_KERNEL``
off) a fresh DDP wraps the model
restored to the same initial weights; ``warmup`` untimed iterations, then ``iters`` timed
ones: barrier, forward + backward (DDP runs the hook inside backward and waits for it), one
wall time per iteration; the optimizer step is outside the timed region. Also recorded: the
process CPU seconds, the hook's own ``state.stats`` (bytes, select / comm seconds) and the
bytes this worker's network interface really sent (``/proc/net/dev`` of its namespace:
payload plus TCP/IP headers and the barrier) over the timed iterations, and how many block
selections took the compiled pass's candidates or its torch fallback (``cpu_kernels.COUNTS``).
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zoopick.training.comm import exchange, make_hook, select  # noqa: E402

PLAIN = "-plain"  # label suffix: the reference CPU paths (see the module docstring)
GROUPED = "-grouped"  # label suffix: issue 19's torch paths, without the compiled pass


def use_paths(label: str) -> None:
    """The CPU paths of ``label``: the reference (plain scan, full division), the torch
    paths of issue 19 (grouped scan, sparse average), or the defaults (and the compiled
    pass)."""
    plain = label.endswith(PLAIN)
    select.CPU_GROUPED = exchange.SPARSE_AVERAGE = not plain
    select.CPU_KERNEL = not (plain or label.endswith(GROUPED))


def kernel_counts() -> dict[str, int]:
    """Block selections so far on the compiled pass's candidates and on its torch fallback
    (zeros where numba is missing)."""
    kernels = select._load_cpu_kernels()
    counts = {} if kernels is None else kernels.COUNTS
    return {"kernel": counts.get("kernel", 0), "fallback": counts.get("fallback", 0)}


def iface_tx_rx(iface: str) -> tuple[int, int]:
    """(tx bytes, rx bytes) of ``iface`` from this network namespace's ``/proc/net/dev``."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        if name.strip() == iface:
            fields = rest.split()
            return int(fields[8]), int(fields[0])
    return 0, 0


def attach(ddp: DDP, label: str, density: float, spec: dict[str, Any]):
    """Register the hook for ``label``; returns its state (ours) or None."""
    if label == "noop":
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        ddp.register_comm_hook(None, noop_hook)
        return None
    if label == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=spec["powersgd_rank"],
            start_powerSGD_iter=spec["powersgd_start"],
        )

        def powersgd_waited(st, bucket):  # unannotated: DDP rejects a string annotation
            # bucket by bucket, like our synchronous hooks: PowerSGD's callbacks issue further
            # all-reduces from gloo's threads, and buckets in flight together ordered them
            # differently on different ranks here (gloo "collective mismatch")
            result = psgd.powerSGD_hook(st, bucket).wait()
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(result)
            return fut

        ddp.register_comm_hook(state, powersgd_waited)
        return None
    name, options = label.removesuffix(PLAIN).removesuffix(GROUPED), {}
    if name.endswith("-async"):  # the FIFO communication thread (async_comm=True)
        name, options = name[: -len("-async")], {"async_comm": True}
    if name.startswith("spardl-t"):
        name, options = "spardl", {**options, "teams": int(name[len("spardl-t") :])}
    state, hook = make_hook(name, density=1.0 if label == "dense" else density, **options)
    ddp.register_comm_hook(state, hook)
    return state


def run_config(label, density, spec, model, initial, iface) -> dict[str, Any]:
    rank = dist.get_rank()
    model.load_state_dict(initial)
    ddp = DDP(model)
    state = attach(ddp, label, density, spec)
    use_paths(label)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    warmup = spec["warmup"] + (spec["powersgd_start"] if label == "powersgd" else 0)
    px, batch = spec["px"], spec["batch"]
    iters: list[dict[str, float]] = []
    zero_fraction = None
    tx0 = rx0 = 0
    counts0 = kernel_counts()
    for it in range(warmup + spec["iters"]):
        gen = torch.Generator().manual_seed(10_000 * rank + it)
        x = torch.randn(batch, 3, px, px, generator=gen)
        y = torch.randint(0, 1000, (batch,), generator=gen)
        if it == warmup:
            tx0, rx0 = iface_tx_rx(iface)
            counts0 = kernel_counts()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        cpu0, t0 = time.process_time(), time.perf_counter()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if label == "noop" and zero_fraction is None:
            g = torch.cat([p.grad.flatten() for p in model.parameters()])  # the local gradient
            zero_fraction = float((g == 0).float().mean())
        opt.step()
        if it < warmup:
            continue
        rec = {"wall_s": wall, "cpu_s": cpu}
        if state is not None:
            st = state.stats[-1]
            for key in ("bytes_sent", "select_s", "comm_s", "nnz", "numel", "buckets"):
                rec[key] = float(st[key])
        iters.append(rec)
    dist.barrier()
    use_paths("")
    tx1, rx1 = iface_tx_rx(iface)
    counts = {key: n - counts0[key] for key, n in kernel_counts().items()}
    n = spec["iters"]
    del ddp
    return {
        "hook": label,
        "density": density,
        "iters": iters,
        "wire_tx_per_iter": (tx1 - tx0) / n,
        "wire_rx_per_iter": (rx1 - rx0) / n,
        "zero_fraction": zero_fraction,
        "kernel_counts": counts,
    }


def main(spec_path: str, rank: int) -> int:
    spec = json.loads(Path(spec_path).read_text())
    faulthandler.register(signal.SIGUSR1)
    torch.set_num_threads(1)
    world = spec["world"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=spec["timeout"]),
    )
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    import timm

    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, zero_init_last=False)
    model.train()
    initial = copy.deepcopy(model.state_dict())
    out: dict[str, Any] = {"rank": rank, "numel": sum(p.numel() for p in model.parameters())}
    out["configs"] = []
    for label, density in spec["configs"]:
        t0 = time.perf_counter()
        out["configs"].append(run_config(label, density, spec, model, initial, iface))
        # written after every configuration: a later hang keeps what was measured
        Path(spec["out_dir"], f"rank{rank}.json").write_text(json.dumps(out))
        if rank == 0:
            walls = sorted(r["wall_s"] for r in out["configs"][-1]["iters"])
            print(
                f"  P={world} {spec['link']}: {label:<10} density={density} "
                f"median {walls[len(walls) // 2] * 1e3:8.1f} ms/iter "
                f"({time.perf_counter() - t0:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
