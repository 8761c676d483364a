"""One worker of the communication benchmark: every hook x density in sequence, in one process.

Started by ``run.py`` once per (P, link), inside its own network namespace (or on loopback),
with ``MASTER_ADDR``/``MASTER_PORT``/``GLOO_SOCKET_IFNAME`` in the environment:

    python benchmarks/comm/worker.py SPEC.json RANK

The gradient is the real one of the model named in the spec: a backward pass of a random
batch (``batch`` images of ``px`` x ``px``, default 2 at 96 px, different on every rank)
through ``timm`` ``resnet18`` (11.7M parameters) built with ``zero_init_last=False``,
computed ``grads`` times up front and cycled. (The earlier recipe, 2 images at 32 px with
timm's default ``zero_init_last``, gave a gradient of 94-99 % exact zeros: degenerate.) The
backward pass is outside the timed region here; ``iteration.py`` times whole iterations.
``params: N`` instead uses N synthetic parameters (heavy-tailed random gradients in
256K-element tensors) for quick runs. The parameters are cut into buckets the way DDP does
it (reverse parameter order, a 1 MiB first bucket, then 25 MiB), each a
``zoopick.training.comm.SimpleBucket``, and the hook is called bucket by bucket exactly as
DDP calls it.

Per iteration and rank it records the wall time of all hook calls (after a barrier, so the
ranks start together), the process CPU time, and the hook's own ``state.stats`` record
(bytes, select / communicate seconds). Torch's PowerSGD keeps no such record: its bytes are
counted by wrapping ``torch.distributed.all_reduce`` while it runs (ring model, like ours) and
its time is not split.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zoopick.training.comm import SimpleBucket, make_hook  # noqa: E402

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb
SYNTHETIC_CHUNK = 1 << 18


def model_gradients(
    params: str, rank: int, count: int, px: int = 96, batch: int = 2
) -> tuple[list[torch.Tensor], list]:
    """(parameters, ``count`` gradient lists) for ``params`` ("resnet18" or an element count)."""
    if params.isdigit():
        n = int(params)
        sizes = [SYNTHETIC_CHUNK] * (n // SYNTHETIC_CHUNK)
        if n % SYNTHETIC_CHUNK:
            sizes.append(n % SYNTHETIC_CHUNK)
        tensors = [torch.zeros(s) for s in sizes]
        grads = []
        for g in range(count):
            gen = torch.Generator().manual_seed(1000 * rank + g)
            scale = [10 ** (-2 * torch.rand(1, generator=gen).item()) for _ in sizes]
            grads.append(
                [
                    torch.randn(s, generator=gen) * torch.randn(s, generator=gen).exp() * c
                    for s, c in zip(sizes, scale, strict=True)
                ]
            )
        return tensors, grads

    import timm

    torch.manual_seed(0)  # the same weights on every rank, as under DDP
    try:  # no residual block starting from a zero BatchNorm scale (a degenerate gradient)
        model = timm.create_model(params, pretrained=False, zero_init_last=False)
    except TypeError:  # a model without that option
        model = timm.create_model(params, pretrained=False)
    model.train()
    gen = torch.Generator().manual_seed(1000 + rank)
    grads = []
    for _ in range(count):
        model.zero_grad(set_to_none=True)
        x = torch.randn(batch, 3, px, px, generator=gen)
        y = torch.randint(0, model.num_classes, (batch,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
    params_list = [p.detach() for p in model.parameters()]
    return params_list, grads


def ddp_buckets(sizes_bytes: list[int]) -> list[list[int]]:
    """Parameter indices per bucket as DDP assigns them: reverse order, a bucket closes once it
    reaches its cap (1 MiB for the first, 25 MiB after)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        filled += sizes_bytes[i]
        cap = FIRST_BUCKET_BYTES if not buckets else BUCKET_BYTES
        if filled >= cap:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


@contextmanager
def count_allreduce(world: int, counter: dict[str, float]):
    """Count bytes of every ``dist.all_reduce`` in the block (ring model: 2(P-1)/P each way)."""
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        b = tensor.numel() * tensor.element_size() * 2 * (world - 1) / world
        counter["bytes_sent"] += b
        counter["bytes_recv"] += b
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield
    finally:
        dist.all_reduce = original


def make(label: str, density: float | None, spec: dict[str, Any]):
    """(state, hook, is_ours) for a benchmark label."""
    if label == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=spec["powersgd_rank"],
            start_powerSGD_iter=spec["powersgd_start"],
        )
        return state, psgd.powerSGD_hook, False
    name, options = label, {}
    if label.startswith("spardl-t"):
        name, options = "spardl", {"teams": int(label[len("spardl-t") :])}
    state, hook = make_hook(name, density=density if density is not None else 1.0, **options)
    return state, hook, True


def run_config(
    label: str,
    density: float | None,
    spec: dict[str, Any],
    buckets: list[SimpleBucket],
    bucket_grads: list[list[list[torch.Tensor]]],
) -> list[dict[str, float]]:
    world = dist.get_world_size()
    state, hook, ours = make(label, density, spec)
    warmup = spec["warmup"] + (spec["powersgd_start"] if label == "powersgd" else 0)
    records = []
    for it in range(warmup + spec["iters"]):
        grads = bucket_grads[it % len(bucket_grads)]
        for bucket, g in zip(buckets, grads, strict=True):
            bucket.set_gradients(g)
        counter = {"bytes_sent": 0.0, "bytes_recv": 0.0}
        dist.barrier()
        cpu0, t0 = time.process_time(), time.perf_counter()
        if ours:
            for bucket in buckets:
                hook(state, bucket).wait()
        else:
            # one bucket at a time, like our (synchronous) hooks: PowerSGD's callbacks issue
            # further all-reduces from gloo's threads, and several buckets in flight could
            # order them differently on different ranks (a hang, seen here)
            with count_allreduce(world, counter):
                for bucket in buckets:
                    hook(state, bucket).wait()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if it < warmup:
            continue
        rec = {"wall_s": wall, "cpu_s": cpu}
        if ours:
            st = state.stats[-1]
            for key in ("bytes_sent", "bytes_recv", "select_s", "comm_s", "nnz", "numel"):
                rec[key] = float(st[key])
        else:
            rec.update(counter)
            rec["numel"] = float(sum(b.buffer().numel() for b in buckets))
        records.append(rec)
    del state
    gc.collect()
    return records


def main(spec_path: str, rank: int) -> int:
    spec = json.loads(Path(spec_path).read_text())
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a worker hangs
    torch.set_num_threads(1)
    world = spec["world"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=spec["timeout"]),
    )
    params, grads = model_gradients(
        spec["params"], rank, spec["grads"], spec.get("px", 96), spec.get("batch", 2)
    )
    groups = ddp_buckets([p.numel() * 4 for p in params])
    buckets = [
        SimpleBucket([params[i] for i in idx], index=b, is_last=b == len(groups) - 1)
        for b, idx in enumerate(groups)
    ]
    bucket_grads = [[[g[i] for i in idx] for idx in groups] for g in grads]
    out: dict[str, Any] = {
        "rank": rank,
        "bucket_numel": [b.buffer().numel() for b in buckets],
        # exact zeros in each bucket of the first gradient: a degenerate gradient (mostly
        # zeros) flatters threshold and block schemes, so the report shows it
        "bucket_zero_fraction": [
            sum(int((grads[0][i] == 0).sum()) for i in idx) / max(1, buckets[b].buffer().numel())
            for b, idx in enumerate(groups)
        ],
        "configs": [],
    }
    for label, density in spec["configs"]:
        t0 = time.perf_counter()
        recs = run_config(label, density, spec, buckets, bucket_grads)
        out["configs"].append({"hook": label, "density": density, "iters": recs})
        if rank == 0:
            wall = sorted(r["wall_s"] for r in recs)[len(recs) // 2]
            print(
                f"  P={world} {spec['link']}: {label:<10} density={density} "
                f"median {wall * 1e3:8.1f} ms/iter ({time.perf_counter() - t0:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    Path(spec["out_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter teardown (seconds with torch loaded)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
