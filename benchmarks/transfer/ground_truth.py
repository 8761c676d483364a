"""Ground truth for the transfer benchmark: fine-tune every zoo model on every target.

Protocol (LogME/SFDA, scaled to a small CPU): full fine-tuning of all layers with a fresh head,
Adam, cross-entropy, cosine decay, a fixed number of epochs, at every learning rate of a small
grid; a model's ground truth on a target is its best test accuracy over the grid (the mean over
``--seeds`` seeds at each learning rate first; ``--extra-seeds`` more seeds at the best rate
then join that mean). Runs are independent, so they are spread over ``--jobs`` processes of one
thread each (``--device cuda``: all of them on the GPU), and every finished run is appended to
``<zoo>/gt_runs.jsonl`` keyed by checkpoint and data hashes, so a rerun only does what is new.

Writes ``<zoo>/ground_truth.json`` and the committed copy
``benchmarks/results/transfer_ground_truth.json``:
``{target: {model_id: {"acc": best, "best_lr": lr, "by_lr": {lr: acc}, "by_seed": ...}}}``,
plus ``<zoo>/ground_truth_meta.json``
(protocol and timings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import lru_cache
from multiprocessing import get_context
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.transfer.finetune_gt import (  # noqa: E402
    finetune,
    load_target,
    read_manifest,
    setup_torch,
    stable_seed,
)


@lru_cache(maxsize=64)
def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


@lru_cache(maxsize=8)
def _target(root: str, name: str):
    return load_target(Path(root), name)


def run_one(
    root: str, entry: dict, target: str, lr: float, seed: int, opts: dict, device: str = "cpu"
) -> dict:
    """One fine-tuning run (in a worker process)."""
    setup_torch(1, device)
    start = time.perf_counter()
    train_set, test_set = _target(root, target)
    acc = finetune(
        entry,
        Path(root),
        train_set,
        test_set,
        lr=lr,
        epochs=opts["epochs"],
        seed=stable_seed("gt", target, entry["id"], seed),
        batch_size=opts["batch_size"],
        device=device,
    )
    return {"acc": acc, "seconds": time.perf_counter() - start, "device": device}


def run_key(
    root: Path, entry: dict, target: str, lr: float, seed: int, opts: dict, device: str = "cpu"
) -> str:
    weights = "none" if entry["weights"] == "none" else file_hash(str(root / entry["weights"]))
    data = file_hash(str(root / "targets" / f"{target}-train.npz"))
    data += file_hash(str(root / "targets" / f"{target}-test.npz"))
    parts = [target, entry["id"], entry["arch"], weights, data, f"{lr:g}", str(seed)]
    parts += [f"{k}={opts[k]:g}" for k in sorted(opts)]  # 10 and 10.0 epochs: one key
    if device != "cpu":  # CPU keys predate the device option
        parts.append(f"device={device}")
    return "|".join(parts)


def _cost(root: Path, entry: dict, target: str) -> float:
    """A rough relative cost of one run (checkpoint bytes x input pixels x training images),
    to start the longest runs first so a pool does not end on one straggler."""
    size = entry.get("input_size", [3, 32, 32])
    ckpt = root / entry["weights"]
    weight = ckpt.stat().st_size if ckpt.exists() else 1e6
    data = (root / "targets" / f"{target}-train.npz").stat().st_size
    return weight * size[1] * size[2] * data


class Runner:
    """Runs fine-tuning jobs not yet in ``<zoo>/gt_runs.jsonl`` over ``jobs`` processes of one
    thread each, appending every finished run to the log as it ends (so a killed run loses
    only the runs in flight)."""

    def __init__(self, root: Path, opts: dict, jobs: int, device: str) -> None:
        self.root, self.opts, self.jobs, self.device = root, opts, jobs, device
        self.log_path = root / "gt_runs.jsonl"
        self.done: dict[str, dict] = {}
        if self.log_path.exists():
            lines = self.log_path.read_text().splitlines()
            for i, line in enumerate(lines):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    if i == len(lines) - 1:  # being appended by another process, or cut
                        break  # by a kill mid-write: that run is simply not done yet
                    raise
                self.done[rec["key"]] = rec
        self.ran = 0

    def key(self, entry: dict, target: str, lr: float, seed: int) -> str:
        return run_key(self.root, entry, target, lr, seed, self.opts, self.device)

    def run(self, wanted: list[tuple[dict, str, float, int]], label: str) -> None:
        jobs = []
        for entry, target, lr, seed in wanted:
            key = self.key(entry, target, lr, seed)
            if key not in self.done:
                jobs.append((key, entry, target, lr, seed))
        print(
            f"{label}: {len(wanted) - len(jobs)} of {len(wanted)} runs cached; running {len(jobs)}"
        )
        jobs.sort(key=lambda j: -_cost(self.root, j[1], j[2]))
        started = time.perf_counter()
        root, opts, device = str(self.root), self.opts, self.device
        with self.log_path.open("a") as log:

            def record(job, res):
                key, entry, target, lr, seed = job
                rec = {"key": key, "target": target, "model": entry["id"], "lr": lr, "seed": seed}
                rec.update(res)
                self.done[key] = rec
                log.write(json.dumps(rec) + "\n")
                log.flush()
                self.ran += 1

            def progress(n: int) -> None:
                if n % 10 == 0 or n == len(jobs):
                    print(
                        f"  {n}/{len(jobs)} runs, {time.perf_counter() - started:.0f}s", flush=True
                    )

            if self.jobs > 1 and len(jobs) > 1:
                with ProcessPoolExecutor(self.jobs, mp_context=get_context("spawn")) as pool:
                    futures = {
                        pool.submit(run_one, root, e, t, lr, s, opts, device): (k, e, t, lr, s)
                        for k, e, t, lr, s in jobs
                    }
                    for n, f in enumerate(as_completed(futures), start=1):
                        record(futures[f], f.result())
                        progress(n)
            else:
                for n, job in enumerate(jobs, start=1):
                    record(job, run_one(root, *job[1:], opts, device))
                    progress(n)


def compute(
    root: Path,
    targets: list[str],
    *,
    lrs: list[float],
    epochs: float = 10,
    seeds: int = 1,
    extra_seeds: int = 0,
    batch_size: int = 32,
    jobs: int = 2,
    device: str = "cpu",
) -> tuple[dict, dict]:
    """Ground truth of every model of the zoo at ``root`` on ``targets``: ``seeds`` seeds at
    every learning rate of ``lrs``; then ``extra_seeds`` more seeds at each model's best
    learning rate (best by the mean over the first ``seeds``), for the seed-to-seed ceiling at
    a fraction of the cost of running them at every rate. Returns (truth, meta).

    ``truth[target][model]``: ``acc`` (the mean over every seed run at ``best_lr``),
    ``best_lr``, ``by_lr`` (mean accuracy per rate over the seeds run there) and ``by_seed``
    (per rate, one accuracy per seed)."""
    entries = read_manifest(root)
    opts = {"epochs": epochs, "batch_size": batch_size}
    runner = Runner(root, opts, jobs, device)
    started = time.perf_counter()
    grid = [(e, t, lr, s) for t in targets for e in entries for lr in lrs for s in range(seeds)]
    runner.run(grid, "lr grid")

    def mean_at(entry: dict, target: str, lr: float, n: int) -> float:
        accs = [runner.done[runner.key(entry, target, lr, s)]["acc"] for s in range(n)]
        return sum(accs) / len(accs)

    best = {
        (t, e["id"]): max(lrs, key=lambda lr, e=e, t=t: mean_at(e, t, lr, seeds))
        for t in targets
        for e in entries
    }
    extra = [
        (e, t, best[t, e["id"]], s)
        for t in targets
        for e in entries
        for s in range(seeds, seeds + extra_seeds)
    ]
    if extra:
        runner.run(extra, "extra seeds at the best lr")
    elapsed = time.perf_counter() - started

    truth: dict[str, dict[str, dict]] = {}
    run_seconds = 0.0
    for target in targets:
        truth[target] = {}
        for entry in entries:
            top = best[target, entry["id"]]
            by_lr, by_seed = {}, {}
            for lr in lrs:
                n = seeds + (extra_seeds if lr == top else 0)
                recs = [runner.done[runner.key(entry, target, lr, s)] for s in range(n)]
                by_lr[f"{lr:g}"] = sum(r["acc"] for r in recs) / len(recs)
                by_seed[f"{lr:g}"] = [r["acc"] for r in recs]
                run_seconds += sum(r["seconds"] for r in recs)
            truth[target][entry["id"]] = {
                "acc": by_lr[f"{top:g}"],
                "best_lr": f"{top:g}",
                "by_lr": by_lr,
                "by_seed": by_seed,  # per lr, one accuracy per fine-tuning seed
            }
    meta = {
        "protocol": "full fine-tuning, fresh head, Adam, cosine decay, best test acc over lrs",
        "lrs": lrs,
        "seeds": seeds,
        "extra_seeds_at_best_lr": extra_seeds,
        **opts,
        "device": device,
        "models": len(entries),
        "targets": targets,
        "runs": len(grid) + len(extra),
        "runs_this_call": runner.ran,
        "jobs": jobs,
        "wall_seconds_this_call": elapsed,
        "sum_run_seconds": run_seconds,
    }
    return truth, meta


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default="benchmarks/transfer/zoo", help="folder built by build_zoo")
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="comma-separated learning rates")
    ap.add_argument("--epochs", type=float, default=10)
    ap.add_argument("--seeds", type=int, default=1, help="seeds averaged at each learning rate")
    ap.add_argument(
        "--extra-seeds", type=int, default=0, help="more seeds at each model's best lr only"
    )
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (every worker shares it)")
    ap.add_argument("--targets", nargs="*", help="target names (default: all in <zoo>/targets)")
    ap.add_argument("--results", default="benchmarks/results/transfer_ground_truth.json")
    args = ap.parse_args(argv)

    root = Path(args.zoo)
    targets = args.targets or sorted(
        p.name.removesuffix("-train.npz") for p in (root / "targets").glob("*-train.npz")
    )
    truth, meta = compute(
        root,
        targets,
        lrs=[float(s) for s in args.lrs.split(",")],
        epochs=args.epochs,
        seeds=args.seeds,
        extra_seeds=args.extra_seeds,
        batch_size=args.batch_size,
        jobs=args.jobs,
        device=args.device,
    )
    text = json.dumps(truth, indent=1) + "\n"
    (root / "ground_truth.json").write_text(text)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(text)
    (root / "ground_truth_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for target in targets:
        accs = sorted((v["acc"], k) for k, v in truth[target].items())
        print(
            f"{target:10s} acc min {accs[0][0]:.3f} ({accs[0][1]}) "
            f"max {accs[-1][0]:.3f} ({accs[-1][1]}) spread {accs[-1][0] - accs[0][0]:.3f}"
        )
    print(
        f"ground truth for {len(targets)} targets x {meta['models']} models in "
        f"{meta['wall_seconds_this_call']:.0f}s"
    )


if __name__ == "__main__":
    main()
