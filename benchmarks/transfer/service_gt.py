"""Ground truth as a zoopick user gets it: every zoo model fine-tuned on every target by the
service's own trainer (``zoopick.training.finetune``) at ``FinetuneOptions``' defaults, one
seed (the default seed), the same run a job with an empty ``finetune`` body starts.

The field's protocol (``ground_truth.py``: full fine-tuning, best over an lr grid) says which
model *can* transfer best; this says which one the user will *get* best with what the
service does by default (today: SGD with momentum, lr 0.01, 3 epochs, 2 data-parallel workers
with spardl at 1 % density). A metric is judged against both.

Each run is the trainer started as the service's local backend starts it
(``training.launch.spawn_local``: torchrun for 2 workers), on the CPU (gloo; a GPU is hidden
from it: two workers on one GPU is not a layout the service runs) with one thread a worker.
Finished runs are appended to ``<zoo>/service_runs.jsonl``, keyed by checkpoint and data hashes
and the options, so a rerun only does what is new.

    python benchmarks/transfer/service_gt.py --zoo benchmarks/transfer/zoos/fonts --jobs 8
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.transfer.finetune_gt import environment, read_manifest  # noqa: E402
from benchmarks.transfer.ground_truth import file_hash  # noqa: E402


def default_options(**changes):
    """The service's fine-tune defaults (``FinetuneOptions()``), with ``changes`` (the quick
    suite shortens the run; the full suite changes nothing)."""
    from zoopick.training.config import FinetuneOptions

    return FinetuneOptions(**changes)


def run_one(root: Path, model_id: str, target: str, options, scratch: Path) -> dict:
    """One run of the service's trainer; its last epoch's test accuracy."""
    from zoopick.training.config import EpochRecord, FinetuneConfig, TrainerError, parse_line
    from zoopick.training.launch import spawn_local

    out = Path(tempfile.mkdtemp(prefix=f"{target}-{model_id}-", dir=scratch))
    cfg = FinetuneConfig.for_run(
        options,
        zoo=str((root / "zoo.json").resolve()),
        model=model_id,
        data=str((root / "targets" / f"{target}-train.npz").resolve()),
        test_data=str((root / "targets" / f"{target}-test.npz").resolve()),
        out=str(out),
    )
    start = time.perf_counter()
    try:
        proc = spawn_local(cfg)
        stdout, stderr = proc.communicate()
        records = [parse_line(line) for line in stdout.splitlines()]
        epochs = [r for r in records if isinstance(r, EpochRecord)]
        errors = [r for r in records + [parse_line(x) for x in stderr.splitlines()] if r]
        errors = [r for r in errors if isinstance(r, TrainerError)]
        if proc.returncode != 0 or not epochs or epochs[-1].test_accuracy is None:
            why = errors[0].error if errors else stderr.strip().splitlines()[-3:]
            # the whole stderr, kept: torchrun's summary (the lines above) rarely says why a
            # rank died (a SIGABRT of a synth/fmnist4 run, 2026-11-27, did not reproduce)
            log = root / "failed" / f"{target}-{model_id}-{int(time.time())}.log"
            log.parent.mkdir(exist_ok=True)
            log.write_text(f"exit {proc.returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
            raise RuntimeError(
                f"{model_id} on {target}: trainer exit {proc.returncode}: {why} (log: {log})"
            )
        return {
            "acc": epochs[-1].test_accuracy,
            "curve": [r.test_accuracy for r in epochs],
            "seconds": time.perf_counter() - start,
        }
    finally:
        shutil.rmtree(out, ignore_errors=True)


def compute(
    root: Path, targets: list[str], *, jobs: int = 2, options=None
) -> tuple[dict[str, dict[str, dict]], dict]:
    """(truth, meta): ``truth[target][model] = {"acc", "curve"}`` for every model of the zoo at
    ``root``. ``jobs`` counts cores: ``jobs // workers`` runs go at once, one thread a worker."""
    options = options or default_options()
    opts_text = options.model_dump_json()
    entries = read_manifest(root)
    log_path = root / "service_runs.jsonl"
    done: dict[str, dict] = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["key"]] = rec

    def key(entry: dict, target: str) -> str:
        data = file_hash(str(root / "targets" / f"{target}-train.npz"))
        data += file_hash(str(root / "targets" / f"{target}-test.npz"))
        weights = file_hash(str(root / entry["weights"]))
        return "|".join([target, entry["id"], weights, data, opts_text])

    wanted = [(e, t) for t in targets for e in entries]
    todo = [(e, t) for e, t in wanted if key(e, t) not in done]
    print(
        f"service defaults: {len(wanted) - len(todo)} of {len(wanted)} runs cached; "
        f"running {len(todo)}",
        flush=True,
    )
    at_once = max(1, jobs // options.max_workers)
    failed: list[str] = []
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="zoopick-service-gt-"))
    try:
        # the trainer's workers (started with a copy of this environment) each get one thread
        # and never see a GPU; the suite's next GPU fine-tunes get the environment back
        with (
            environment(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),
            log_path.open("a") as log,
            ThreadPoolExecutor(at_once) as pool,
        ):
            futures = {
                pool.submit(run_one, root, e["id"], t, options, scratch): (e, t) for e, t in todo
            }
            for n, f in enumerate(as_completed(futures), start=1):
                entry, target = futures[f]
                rec = {"key": key(entry, target), "target": target, "model": entry["id"]}
                try:
                    rec.update(f.result())
                except Exception as exc:  # one failed run must not stop the others
                    failed.append(f"{target}/{entry['id']}: {exc!r}")
                    print(f"  FAILED {failed[-1]}", flush=True)
                    continue
                done[rec["key"]] = rec
                log.write(json.dumps(rec) + "\n")
                log.flush()
                if n % 10 == 0 or n == len(todo):
                    print(
                        f"  {n}/{len(todo)} runs, {time.perf_counter() - started:.0f}s", flush=True
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if failed:  # the finished runs are logged; a rerun retries only these
        raise RuntimeError(f"{len(failed)} service fine-tunes failed: " + "; ".join(failed))
    truth = {
        t: {
            e["id"]: {"acc": done[key(e, t)]["acc"], "curve": done[key(e, t)]["curve"]}
            for e in entries
        }
        for t in targets
    }
    meta = {
        "protocol": "zoopick's own fine-tune (zoopick.training.finetune) at FinetuneOptions "
        "defaults, one seed, CPU (gloo), one thread a worker; test accuracy after the last epoch",
        "options": json.loads(opts_text),
        "runs": len(wanted),
        "runs_this_call": len(todo),
        "wall_seconds_this_call": time.perf_counter() - started,
        "sum_run_seconds": sum(done[key(e, t)]["seconds"] for e, t in wanted),
    }
    return truth, meta


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default="benchmarks/transfer/zoo", help="folder built by build_zoo")
    ap.add_argument("--jobs", type=int, default=2, help="cores to use (2 per run)")
    ap.add_argument("--targets", nargs="*", help="target names (default: all in <zoo>/targets)")
    args = ap.parse_args(argv)
    root = Path(args.zoo)
    targets = args.targets or sorted(
        p.name.removesuffix("-train.npz") for p in (root / "targets").glob("*-train.npz")
    )
    truth, meta = compute(root, targets, jobs=args.jobs)
    (root / "service_truth.json").write_text(
        json.dumps({"meta": meta, "truth": truth}, indent=1) + "\n"
    )
    for target in targets:
        accs = sorted((v["acc"], k) for k, v in truth[target].items())
        print(f"{target:10s} min {accs[0][0]:.3f} max {accs[-1][0]:.3f} ({accs[-1][1]})")


if __name__ == "__main__":
    main()
