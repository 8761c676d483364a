"""Ground truth for the transfer benchmark: fine-tune every zoo model on every target.

Protocol (LogME/SFDA, scaled to a small CPU): full fine-tuning of all layers with a fresh head,
Adam, cross-entropy, cosine decay, a fixed number of epochs, at every learning rate of a small
grid; a model's ground truth on a target is its best test accuracy over the grid (the mean over
``--seeds`` seeds at each learning rate first). Runs are independent, so they are spread over
``--jobs`` processes of one thread each, and every finished run is appended to
``<zoo>/gt_runs.jsonl`` keyed by checkpoint and data hashes, so a rerun only does what is new.

Writes ``<zoo>/ground_truth.json`` and the committed copy
``benchmarks/results/transfer_ground_truth.json``:
``{target: {model_id: {"acc": best, "by_lr": {lr: acc}}}}``, plus ``<zoo>/ground_truth_meta.json``
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


def run_one(root: str, entry: dict, target: str, lr: float, seed: int, opts: dict) -> dict:
    """One fine-tuning run (in a worker process)."""
    setup_torch(1)
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
    )
    return {"acc": acc, "seconds": time.perf_counter() - start}


def run_key(root: Path, entry: dict, target: str, lr: float, seed: int, opts: dict) -> str:
    weights = "none" if entry["weights"] == "none" else file_hash(str(root / entry["weights"]))
    data = file_hash(str(root / "targets" / f"{target}-train.npz"))
    data += file_hash(str(root / "targets" / f"{target}-test.npz"))
    return "|".join(
        [target, entry["id"], entry["arch"], weights, data, f"{lr:g}", str(seed)]
        + [f"{k}={opts[k]:g}" for k in sorted(opts)]  # 10 and 10.0 epochs: one key
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default="benchmarks/transfer/zoo", help="folder built by build_zoo")
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="comma-separated learning rates")
    ap.add_argument("--epochs", type=float, default=10)
    ap.add_argument("--seeds", type=int, default=1, help="seeds averaged at each learning rate")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--targets", nargs="*", help="target names (default: all in <zoo>/targets)")
    ap.add_argument("--results", default="benchmarks/results/transfer_ground_truth.json")
    args = ap.parse_args(argv)

    root = Path(args.zoo)
    entries = read_manifest(root)
    targets = args.targets or sorted(
        p.name.removesuffix("-train.npz") for p in (root / "targets").glob("*-train.npz")
    )
    lrs = [float(s) for s in args.lrs.split(",")]
    opts = {"epochs": args.epochs, "batch_size": args.batch_size}

    log_path = root / "gt_runs.jsonl"
    done: dict[str, dict] = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            rec = json.loads(line)
            done[rec["key"]] = rec
    jobs = []
    for target in targets:
        for entry in entries:
            for lr in lrs:
                for seed in range(args.seeds):
                    key = run_key(root, entry, target, lr, seed, opts)
                    if key not in done:
                        jobs.append((key, entry, target, lr, seed))
    total_runs = len(targets) * len(entries) * len(lrs) * args.seeds
    print(f"{total_runs - len(jobs)} of {total_runs} fine-tuning runs cached; running {len(jobs)}")

    started = time.perf_counter()
    with log_path.open("a") as log:

        def record(job, res):
            key, entry, target, lr, seed = job
            rec = {"key": key, "target": target, "model": entry["id"], "lr": lr, "seed": seed}
            rec.update(res)
            done[key] = rec
            log.write(json.dumps(rec) + "\n")
            log.flush()

        if args.jobs > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
                futures = {
                    pool.submit(run_one, str(root), e, t, lr, s, opts): (k, e, t, lr, s)
                    for k, e, t, lr, s in jobs
                }
                for n, f in enumerate(as_completed(futures), start=1):
                    job = futures[f]
                    record(job, f.result())
                    if n % 10 == 0 or n == len(jobs):
                        el = time.perf_counter() - started
                        print(f"  {n}/{len(jobs)} runs, {el:.0f}s", flush=True)
        else:
            for n, job in enumerate(jobs, start=1):
                record(job, run_one(str(root), *job[1:], opts))
                if n % 10 == 0 or n == len(jobs):
                    print(f"  {n}/{len(jobs)} runs, {time.perf_counter() - started:.0f}s")
    elapsed = time.perf_counter() - started

    truth: dict[str, dict[str, dict]] = {}
    run_seconds = 0.0
    for target in targets:
        truth[target] = {}
        for entry in entries:
            by_lr, by_seed = {}, {}
            for lr in lrs:
                recs = [done[run_key(root, entry, target, lr, s, opts)] for s in range(args.seeds)]
                by_lr[f"{lr:g}"] = sum(r["acc"] for r in recs) / len(recs)
                by_seed[f"{lr:g}"] = [r["acc"] for r in recs]
                run_seconds += sum(r["seconds"] for r in recs)
            truth[target][entry["id"]] = {
                "acc": max(by_lr.values()),
                "by_lr": by_lr,
                "by_seed": by_seed,  # per lr, one accuracy per fine-tuning seed
            }

    text = json.dumps(truth, indent=1) + "\n"
    (root / "ground_truth.json").write_text(text)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(text)
    meta = {
        "protocol": "full fine-tuning, fresh head, Adam, cosine decay, best test acc over lrs",
        "lrs": lrs,
        "seeds": args.seeds,
        **opts,
        "models": len(entries),
        "targets": targets,
        "runs": total_runs,
        "runs_this_call": len(jobs),
        "jobs": args.jobs,
        "wall_seconds_this_call": elapsed,
        "sum_run_seconds": run_seconds,
    }
    (root / "ground_truth_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for target in targets:
        accs = sorted((v["acc"], k) for k, v in truth[target].items())
        print(
            f"{target:10s} acc min {accs[0][0]:.3f} ({accs[0][1]}) "
            f"max {accs[-1][0]:.3f} ({accs[-1][1]}) spread {accs[-1][0] - accs[0][0]:.3f}"
        )
    print(f"ground truth for {len(targets)} targets x {len(entries)} models in {elapsed:.0f}s")


if __name__ == "__main__":
    main()
