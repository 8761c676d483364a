"""What the ``ray`` training backend costs against ``local``, on this machine, in one run.

The same fine-tune (a timm architecture with seeded random weights, input 3x32x32; a seeded
per-class subset of Fashion-MNIST's training split, its test split subsampled for the test
accuracy; spardl at ``--density``; ``--workers`` data-parallel workers, gloo on the CPU) runs:

1. ``local``: ``torchrun --standalone`` (``training.backends.spawn``, kind local);
2. ``ray``: the Ray driver on a local Ray cluster that this script starts
   (``ray.cluster_utils.Cluster``: a head with no CPUs and ``--workers`` nodes of 1 CPU each, so
   every worker has a node of its own, like a pool of one-GPU machines); the cluster's start is
   timed apart, as a pool is started once, not per job;
3. ``ray`` again, a node removed after the first epoch and a replacement added at once: the
   recovery time (node lost -> the run's ``resumed`` event; -> its next epoch).

Measured from the parent, on the lines each backend prints as they arrive: the time from the
start of the child process to its first epoch record, the time before the first step (that,
minus the first epoch's own training time as the record reports it: compute + select +
communicate seconds; evaluation after the epoch is not subtracted, so this overstates the wait
a little), and the per-epoch wall time (the interval between consecutive epoch records, epochs
2.. ; the first epoch carries the start-up; the ray driver sees rank 0's records by following
its metrics file every 0.25 s, so single intervals there are quantised to that). The training
time each record reports (compute + select + communicate, measured inside the workers) is
shown beside it. Ratios ray / local. Goals (issue 17): ray adds
under 10 % per epoch to local at equal worker count, and under 30 s before the first step.

On this 2-core machine the two workers share the cores with the cluster's own processes
(raylets, GCS): a real pool has them on other machines, so the per-epoch ratio here is an upper
bound of what Ray's bookkeeping costs, not a measurement of a pool.

    python benchmarks/pool/run.py --data ../shared/datasets/fashion-mnist.npz
    python benchmarks/pool/run.py --data ../shared/datasets/fashion-mnist.npz \\
        --per-class 60 --epochs 3 --out /tmp/pool

Writes ``pool.json`` and ``pool.md`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zoopick.selection.zoo import write_zoo  # noqa: E402
from zoopick.training.backends import Backend, spawn  # noqa: E402
from zoopick.training.config import (  # noqa: E402
    EpochRecord,
    FinetuneConfig,
    RunEvent,
    parse_line,
)

GOAL_EPOCH_OVERHEAD = 0.10
GOAL_FIRST_STEP_S = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="Keras-layout npz (Fashion-MNIST)")
    ap.add_argument("--per-class", type=int, default=100, help="training images a class")
    ap.add_argument("--test-per-class", type=int, default=20)
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-recovery", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    return ap.parse_args(argv)


def write_inputs(args: argparse.Namespace, tmp: Path) -> tuple[Path, Path, Path, dict[str, Any]]:
    """A seeded class-balanced subset of the training split, a test subset, a one-model zoo."""
    with np.load(args.data) as npz:
        x_train, y_train = npz["x_train"], npz["y_train"]
        x_test, y_test = npz["x_test"], npz["y_test"]
    rng = np.random.default_rng(args.seed)
    classes = int(y_train.max()) + 1

    def subset(y: np.ndarray, n: int) -> np.ndarray:
        keep = [rng.permutation(np.flatnonzero(y == c))[:n] for c in range(classes)]
        return np.sort(np.concatenate(keep))

    tr, te = subset(y_train, args.per_class), subset(y_test, args.test_per_class)
    train, test = tmp / "train.npz", tmp / "test.npz"
    np.savez(train, x=x_train[tr], y=y_train[tr])
    np.savez(test, x=x_test[te], y=y_test[te])
    zoo = write_zoo(
        [
            {
                "id": f"{args.arch}-random",
                "arch": args.arch,
                "weights": "none",
                "num_classes": classes,
                "input_size": [3, 32, 32],
                "mean": [0.5, 0.5, 0.5],
                "std": [0.5, 0.5, 0.5],
                "interpolation": "bilinear",
                "crop_pct": 1.0,
            }
        ],
        tmp / "zoo" / "zoo.json",
    )
    pixels = x_train[tr]
    facts = {
        "train_images": int(len(tr)),
        "test_images": int(len(te)),
        "classes": classes,
        # a degenerate input check: real images, not blank ones
        "pixel_mean": float(pixels.mean()),
        "pixel_std": float(pixels.std()),
        "zero_pixel_share": float((pixels == 0).mean()),
    }
    return zoo, train, test, facts


class Follow:
    """Reads a run's stdout lines as they arrive, stamping each with the time it was seen."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.start = time.monotonic()
        self.lines: list[tuple[float, EpochRecord | RunEvent]] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._out, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(proc.stderr), daemon=True).start()

    def _out(self) -> None:
        for line in self.proc.stdout:
            record = parse_line(line)
            if isinstance(record, EpochRecord | RunEvent):
                self.lines.append((time.monotonic() - self.start, record))

    def epochs(self) -> list[tuple[float, EpochRecord]]:
        return [(t, r) for t, r in list(self.lines) if isinstance(r, EpochRecord)]

    def wait_for(self, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "".join(self.stderr)[-2000:]
                raise RuntimeError(f"the run ended or timed out first: {tail}")
            time.sleep(0.05)


def timings(follow: Follow) -> dict[str, Any]:
    epochs = follow.epochs()
    if not epochs:
        raise RuntimeError("no epoch: " + "".join(follow.stderr)[-2000:])
    t1, first = epochs[0]
    trained = (first.compute_seconds or 0) + (first.select_seconds or 0) + (first.comm_seconds or 0)
    gaps = [b[0] - a[0] for a, b in zip(epochs, epochs[1:], strict=False)]
    inside = [
        (r.compute_seconds or 0) + (r.select_seconds or 0) + (r.comm_seconds or 0)
        for _, r in epochs[1:]
    ]
    return {
        "train_s_inside": inside,
        "train_median_s_inside": statistics.median(inside) if inside else None,
        "first_epoch_s": t1,
        "before_first_step_s": t1 - trained,
        "epoch_s": gaps,
        "epoch_median_s": statistics.median(gaps) if gaps else None,
        "final_test_acc": epochs[-1][1].test_accuracy,
        "bytes_sent_per_epoch": epochs[-1][1].bytes_sent,
        "dense_bytes_per_epoch": epochs[-1][1].dense_bytes,
        "workers": epochs[-1][1].workers,
    }


def run(
    cfg: FinetuneConfig, backend: Backend, timeout: float, during=None
) -> tuple[Follow, dict[str, Any]]:
    """Run ``cfg`` to its end; ``during(follow)`` runs meanwhile and returns facts of its own."""
    proc = spawn(cfg, backend)
    follow = Follow(proc)
    facts: dict[str, Any] = {}
    try:
        if during is not None:
            facts = during(follow)
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.2)
    if code != 0:
        raise RuntimeError(f"{backend.kind} run failed: " + "".join(follow.stderr)[-2000:])
    return follow, facts


def run_recovery(cfg: FinetuneConfig, backend: Backend, cluster, timeout: float) -> dict[str, Any]:
    """Remove a worker node after the first epoch, add a replacement at once."""

    def lose_a_node(follow: Follow) -> dict[str, Any]:
        follow.wait_for(lambda: len(follow.epochs()) >= 1, timeout)
        lost_at = time.monotonic() - follow.start
        cluster.remove_node(cluster.list_all_nodes()[-1], allow_graceful=False)
        cluster.add_node(num_cpus=1)
        return {"node_lost_at_s": lost_at}

    follow, facts = run(cfg, backend, timeout, during=lose_a_node)
    lost_at = facts["node_lost_at_s"]
    resumed = [t for t, r in follow.lines if isinstance(r, RunEvent) and r.event == "resumed"]
    after = [t for t, _ in follow.epochs() if resumed and t > resumed[0]]
    return {
        "node_lost_at_s": lost_at,
        "resumed_after_s": (resumed[0] - lost_at) if resumed else None,
        "next_epoch_after_s": (after[0] - lost_at) if after else None,
        "epochs_seen": sorted({r.epoch for _, r in follow.epochs()}),
        "resumed": bool(resumed),
    }


def report(result: dict[str, Any]) -> str:
    local, ray = result["local"], result["ray"]
    r = result["ratios"]
    lines = [
        "# Training backends: ray against local (benchmarks/pool)",
        "",
        f"{result['machine']['cpus']} CPUs, {result['machine']['python']}, torch "
        f"{result['machine']['torch']}, ray {result['machine']['ray']}. "
        f"{result['args']['arch']} (random init), {result['inputs']['train_images']} "
        f"Fashion-MNIST training images ({result['inputs']['classes']} classes; pixel mean "
        f"{result['inputs']['pixel_mean']:.1f}, std {result['inputs']['pixel_std']:.1f}; "
        f"{100 * result['inputs']['zero_pixel_share']:.0f} % zero pixels: the black background "
        f"of the real images), spardl at density {result['args']['density']}, "
        f"{result['args']['workers']} workers, {result['args']['epochs']} epochs, batch "
        f"{result['args']['batch_size']}. Ray: a local cluster, a head with no CPUs and one "
        f"1-CPU node per worker (started in {result['cluster_start_s']:.1f} s, not counted).",
        "",
        "| | local | ray | ray / local |",
        "|---|---|---|---|",
        f"| first epoch record after start (s) | {local['first_epoch_s']:.1f} | "
        f"{ray['first_epoch_s']:.1f} | {r['first_epoch']:.2f} |",
        f"| before the first step (s) | {local['before_first_step_s']:.1f} | "
        f"{ray['before_first_step_s']:.1f} | {r['before_first_step']:.2f} |",
        f"| per epoch, median of epochs 2.. (s) | {local['epoch_median_s']:.2f} | "
        f"{ray['epoch_median_s']:.2f} | {r['epoch']:.3f} |",
        f"| training time per epoch, as the workers measured it (s) | "
        f"{local['train_median_s_inside']:.2f} | {ray['train_median_s_inside']:.2f} | "
        f"{ray['train_median_s_inside'] / local['train_median_s_inside']:.3f} |",
        f"| final test accuracy | {local['final_test_acc']:.3f} | {ray['final_test_acc']:.3f} | "
        "(same seed, same arithmetic) |",
        f"| bytes sent per worker and epoch | {local['bytes_sent_per_epoch']:.3g} | "
        f"{ray['bytes_sent_per_epoch']:.3g} | (dense: {local['dense_bytes_per_epoch']:.3g}) |",
        "",
        f"Goals: ray adds under {100 * GOAL_EPOCH_OVERHEAD:.0f} % per epoch: "
        f"{'met' if result['goals']['epoch'] else 'not met'} "
        f"({100 * (r['epoch'] - 1):+.1f} %); under {GOAL_FIRST_STEP_S:.0f} s before the first "
        f"step: {'met' if result['goals']['first_step'] else 'not met'} "
        f"({ray['before_first_step_s']:.1f} s).",
    ]
    rec = result.get("recovery")
    if rec:
        lines += [
            "",
            f"Recovery (ray, a node removed after epoch 1 and a replacement added at once): "
            f"the run resumed from its checkpoint {rec['resumed_after_s']:.1f} s after the loss "
            f"and printed its next epoch {rec['next_epoch_after_s']:.1f} s after it; epochs seen "
            f"{rec['epochs_seen']}.",
        ]
    lines += ["", "Per-epoch intervals (s): local "
              + ", ".join(f"{g:.2f}" for g in local["epoch_s"]) + "; ray "
              + ", ".join(f"{g:.2f}" for g in ray["epoch_s"]) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray
    import torch
    from ray.cluster_utils import Cluster

    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        zoo, train, test, facts = write_inputs(args, tmp)

        def config(name: str) -> FinetuneConfig:
            return FinetuneConfig(
                zoo=str(zoo), model=f"{args.arch}-random", data=str(train), test_data=str(test),
                out=str(tmp / name), workers=args.workers, epochs=args.epochs,
                batch_size=args.batch_size, compressor="spardl", density=args.density,
                seed=args.seed, lr=0.05,
            )  # fmt: skip

        print("local ...", flush=True)
        local = timings(run(config("local"), Backend(), args.timeout)[0])
        t0 = time.monotonic()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(args.workers):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        started = time.monotonic() - t0
        try:
            pool = Backend(kind="ray", ray_address=cluster.address, placement="STRICT_SPREAD")
            print("ray ...", flush=True)
            on_ray = timings(run(config("ray"), pool, args.timeout)[0])
            recovery = None
            if not args.skip_recovery:
                print("ray, a node lost ...", flush=True)
                recovery = run_recovery(config("recovery"), pool, cluster, args.timeout)
        finally:
            cluster.shutdown()

    ratios = {
        "first_epoch": on_ray["first_epoch_s"] / local["first_epoch_s"],
        "before_first_step": on_ray["before_first_step_s"] / local["before_first_step_s"],
        "epoch": on_ray["epoch_median_s"] / local["epoch_median_s"],
    }
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ray": ray.__version__,
        },
        "inputs": facts,
        "cluster_start_s": started,
        "local": local,
        "ray": on_ray,
        "recovery": recovery,
        "ratios": ratios,
        "goals": {
            "epoch": ratios["epoch"] - 1 < GOAL_EPOCH_OVERHEAD,
            "first_step": on_ray["before_first_step_s"] < GOAL_FIRST_STEP_S,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pool.json").write_text(json.dumps(result, indent=2))
    text = report(result)
    (args.out / "pool.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
