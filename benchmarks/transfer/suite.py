"""The transfer suite (issue 20): every zoo x every target, every candidate metric judged
against two ground truths, the default ``select_by`` picked by the pre-registered rule.

For each zoo of ``zoos.ZOOS`` (built by ``build_zoo.build``) and each target of
``tasks.TARGETS``, one *cell*:

1. ground truth as the field measures it (``ground_truth.compute``: full fine-tuning, best
   test accuracy over an lr grid, extra seeds at each model's best lr for the seed-to-seed
   ceiling);
2. ground truth as a zoopick user gets it (``service_gt.compute``: the service's own trainer
   at ``FinetuneOptions``' defaults, one seed);
3. every registered metric, ``run.VARIANTS`` and the fixed rank ensembles of
   :data:`ENSEMBLES` score the zoo from one forward pass over the target's training split
   (``run.score_target``), each ranking judged against both truths.

Resumable: fine-tuning runs are logged as they finish and forward passes cached; a cell whose
plan (zoo build, target, protocol, candidates, metric code: ``cell_plan``) is in the results
is skipped, and a zoo whose every cell is is not built. The results are rewritten after every
cell, marked ``partial`` until every cell is done. The summary (per zoo, per target,
leave-one-zoo-out, bootstrap interval over targets, the rule's pick, the goals) is recomputed
from the cells each time.

    python benchmarks/transfer/suite.py --quick                     # minutes: not a result
    python benchmarks/transfer/suite.py --jobs 16 --device auto     # the full suite
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.transfer import build_zoo, ground_truth, run, service_gt, tasks, zoos  # noqa: E402
from benchmarks.transfer.run_logs import merge_run_logs  # noqa: E402
from benchmarks.transfer.suite_report import (  # noqa: E402
    metrics_speed_summary,
    summarise,
    write_markdown,
)
from benchmarks.transfer.suite_stats import rank_ensemble  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# Fixed rank ensembles of complementary metrics (PREREGISTRATION.md): Gaussian evidence
# (logme), class separation (fsms), feature-label correlation (parc); plus a label-likelihood
# (nleep) and a non-parametric one (knn). Members at their default options; never tuned.
ENSEMBLES: dict[str, tuple[str, ...]] = {
    "ens:logme+fsms+parc": ("logme", "fsms", "parc"),
    "ens:logme+fsms+parc+nleep+knn": ("logme", "fsms", "parc", "nleep", "knn"),
}


@dataclass(frozen=True)
class Mode:
    """What a suite run does: the full protocol, or ``--quick``'s smoke-test subset."""

    name: str
    scale: float  # build_zoo --scale (image counts of sources and targets)
    lrs: tuple[float, ...]
    epochs: float
    seeds: int  # seeds at every lr
    extra_seeds: int  # more seeds at each model's best lr
    service_changes: dict = field(default_factory=dict)  # changes to the service defaults
    targets: tuple[str, ...] | None = None  # None: every target
    quick_models: bool = False  # each zoo spec's quick subset only
    results: str = "transfer_suite"

    def runs_dir(self, out: Path) -> Path:
        """Where the finished fine-tuning runs of every zoo are kept (committed), so that a
        cell stopped with a session resumes in the next one."""
        return out / f"{self.results}_runs"


FULL = Mode("full", 1.0, (1e-3, 3e-3, 1e-2), 10, 1, 2)
QUICK = Mode(
    "quick",
    0.25,
    (3e-3,),
    2,
    1,
    0,
    service_changes={"epochs": 1},
    targets=("chars62", "photo64", "shirts2"),
    quick_models=True,
    results="transfer_suite_quick",
)


def zoo_folder(mode: Mode, zoo: str) -> Path:
    if mode.name == "full":
        return build_zoo.default_out(zoo)
    return Path("benchmarks/transfer/zoos") / mode.name / zoo


def candidates() -> tuple[list[str], dict[str, tuple[str, dict]], list[str]]:
    """(registered metrics, the variants of run.py whose metric exists, every candidate)."""
    from zoopick.selection.metrics import available

    base = list(available())
    variants = {v: bv for v, bv in run.VARIANTS.items() if bv[0] in base}
    ensembles = [e for e, members in ENSEMBLES.items() if set(members) <= set(base)]
    return base, variants, base + list(variants) + ensembles


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def metric_code_digest() -> str:
    """What the candidates' code is: a change to a metric (or to ranking) reopens every cell."""
    h = hashlib.sha256()
    for p in sorted((REPO / "selection" / "metrics").glob("*.py")) + [REPO / "selection/rank.py"]:
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def zoo_hashes(root: Path) -> dict[str, str]:
    files = sorted(root.glob("ckpt/*.safetensors")) + sorted(root.glob("targets/*.npz"))
    return {str(p.relative_to(root)): _sha256(p) for p in files}


def record_hashes(path: Path, zoo: str, settings: dict, hashes: dict[str, str]) -> None:
    """Keep the build's sha256 in ``path`` (one entry a zoo) and say which files differ from
    an earlier record: builds are byte-identical on one machine, not across CPUs or torch
    builds (README), so a difference is reported, not fatal."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    old = doc.get(zoo, {})
    files = hashes
    if old.get("settings") == settings:
        differ = sorted(k for k, v in hashes.items() if old["files"].get(k, v) != v)
        if differ:
            print(f"  {zoo}: {len(differ)} files differ from {path}: {differ[:5]}", flush=True)
        files = {**hashes, **old["files"]}  # the first record stays; new files join it
        if files == old["files"]:
            return
    doc[zoo] = {
        "note": f"sha256 of the {zoo} zoo, built {dt.date.today().isoformat()} on "
        f"{platform.machine()} (torch {_torch_version()})",
        "settings": settings,
        "files": files,
    }
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _torch_version() -> str:
    import torch

    return torch.__version__


def cell_files(hashes: dict[str, str], target: str) -> dict[str, str]:
    """The sha256 of what one cell reads: every checkpoint and the target's splits."""
    return {k: v for k, v in hashes.items() if k.startswith("ckpt/") or f"/{target}-" in k}


def build_digest(spec: zoos.ZooSpec, settings: dict, only: list[str] | None) -> str:
    """What a zoo's files are made from: the build settings and each model's spec."""
    models = {m.id: build_zoo.checkpoint_spec(m) for m in spec.models if not only or m.id in only}
    doc = {"settings": settings, "models": models}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def cell_plan(mode: Mode, digest: str, target: str, cands: list[str]) -> str:
    """What a cell measures, whatever machine measures it: the protocol, the zoo's build
    digest, the target, the candidates and the metrics' code. A cell whose plan is in the
    results is done.

    Why not the checkpoints' bytes: a seeded build is byte-identical on one machine but not
    across CPUs (the base zoo, built with ATen pinned to AVX2 on two sessions' machines,
    matched in 1 of 21 checkpoints), and the suite needs several sessions, each on a fresh
    machine. Each cell is measured whole on one build (its truth and its scores read the
    same checkpoints, whose sha256 the cell keeps as ``files``); cells of one zoo may come
    from builds of different machines, alike but for floating-point order."""
    doc = {
        "mode": asdict(mode),
        "build": digest,
        "target": target,
        "candidates": cands,
        "metric_code": metric_code_digest(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def cells_done(res: dict, zoo: str, plans: dict[str, str]) -> list[str]:
    """The targets of ``plans`` (target: plan) whose cell of ``zoo`` is done to that plan."""
    cells = res["cells"]
    return [
        t
        for t, plan in plans.items()
        if cells.get(f"{zoo}/{t}", {}).get("status") == "done"
        and cells[f"{zoo}/{t}"].get("plan") == plan
    ]


def score_cell(root: Path, target: str, field_truth: dict, service_truth: dict, threads: int):
    """Every candidate's scores and its judgement against both truths, for one cell."""
    import torch

    from zoopick.selection.data import load_dataset
    from zoopick.selection.rank import evaluate
    from zoopick.selection.zoo import load_zoo

    torch.set_num_threads(threads)
    base, variants, cands = candidates()
    zoo = load_zoo(root / "zoo.json")
    dataset = load_dataset(root / "targets" / f"{target}-train.npz")
    truth = {m: r["acc"] for m, r in field_truth.items()}
    per = run.score_target(
        zoo, dataset, truth, base, variants, cache_dir="benchmarks/transfer/cache", device="cpu"
    )
    scores = {m: r["scores"] for m, r in per["metrics"].items()}
    for name, members in ENSEMBLES.items():
        if name in cands:
            s = rank_ensemble(scores, members)
            per["metrics"][name] = {
                **evaluate(s, truth),
                "seconds": sum(per["metrics"][m]["seconds"] for m in members),
                "top": [max(s, key=s.get)],
                "scores": s,
            }
    service = {m: r["acc"] for m, r in service_truth.items()}
    judged = {
        c: {
            "field": {k: per["metrics"][c][k] for k in run.EVAL_KEYS},
            "service": evaluate(per["metrics"][c]["scores"], service),
            "seconds": per["metrics"][c]["seconds"],
            "top": per["metrics"][c]["top"],
            "scores": per["metrics"][c]["scores"],
        }
        for c in cands
    }
    return {
        "candidates": judged,
        "forward_seconds": per["forward_seconds"],
        "forward_cached": per["forward_cached"],
        "rank_seconds": per["rank_seconds"],
        "random": per["random"],
        "inputs": per.get("inputs"),
    }


def zoo_models(manifest: list[dict], build: dict) -> list[dict]:
    """The zoo's models as the report lists them: from the manifest, with what pretraining
    achieved on the model's source (build.json's ``source_train_acc``; None for a random
    model or a build that did not record it)."""
    built = build.get("models", {})
    return [
        {
            "id": m["id"],
            "arch": m["arch"],
            "head": m["num_classes"],
            "size": m["input_size"][1],
            "source": m["source"],
            "source_acc": built.get(m["id"], {}).get("source_train_acc"),
            "source_classes": built.get(m["id"], {}).get("num_classes"),
        }
        for m in manifest
    ]


def refresh_zoo_models(res: dict) -> None:
    """Fill each zoo's model list from its folder's manifest and build.json where they are
    on this machine (``--report-only`` after a build the running suite recorded less of)."""
    for z in res.get("zoos", {}).values():
        root = Path(z.get("folder", ""))
        if (root / "build.json").is_file() and (root / "zoo.json").is_file():
            build = json.loads((root / "build.json").read_text())
            z["models"] = zoo_models(ground_truth.read_manifest(root), build)


def keep_run_logs(res: dict, runs_dir: Path) -> dict[str, int]:
    """Copy the fine-tuning runs of each zoo folder that is on this machine into
    ``runs_dir/<zoo>`` (``merge_run_logs``); returns how many were new, by zoo.

    The suite keeps a cell's runs beside the results only once its truth is complete, so a
    suite stopped in the middle of a cell (a session's end) would leave that cell's finished
    runs in the git-ignored zoo folder, lost with the machine; ``--report-only`` after the
    stop keeps them for the next session (keyed by checkpoint and data hashes, they are
    reused only by a build that gives the same bytes)."""
    kept: dict[str, int] = {}
    for zname, z in res.get("zoos", {}).items():
        folder = z.get("folder")
        if folder and Path(folder).is_dir():
            kept[zname] = merge_run_logs(Path(folder), runs_dir / zname)
    return kept


def load_results(path: Path, mode: Mode) -> dict:
    if path.exists():
        res = json.loads(path.read_text())
        if res.get("mode", {}).get("name") == mode.name:
            return res
    return {"mode": asdict(mode), "cells": {}, "zoos": {}, "targets": {}}


def save(res: dict, json_path: Path, md_path: Path, expected: list[str]) -> None:
    """Rewrite the results (atomically) and their report; ``partial`` until every expected
    cell is done."""
    done = sum(res["cells"].get(k, {}).get("status") == "done" for k in expected)
    res["status"] = "complete" if done == len(expected) else "partial"
    res["cells_done"], res["cells_expected"] = done, len(expected)
    speed = metrics_speed_summary(json_path.parent / "metrics_speed.json")
    if speed:
        res["metrics_speed"] = speed
    res["summary"] = summarise(res)
    tmp = json_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, json_path)
    write_markdown(md_path, res)


class Races:
    """Issue 18's held-out judgement, cell by cell (``--race``): a held-out cell's target is
    raced right after the cell is scored, while the zoo's folder holds the build the cell's
    truth was measured on (the next machine's build may differ), and merged into
    ``race_<zoo>`` (``benchmarks/race/PREREGISTRATION.md``). A race trains on one thread, so
    it runs in a process of its own beside the next cell's fine-tunes; races run one at a
    time (each merges into the same file), and the suite waits for the last one."""

    def __init__(self, device: str, out: Path) -> None:
        self.device, self.out = device, out  # race_<zoo>.json beside the suite's results
        self.running: tuple[str, subprocess.Popen] | None = None
        self.failed: list[str] = []

    def start(self, root: Path, zoo: str, target: str) -> None:
        from benchmarks.race import truth as race_truth

        if race_truth.role(zoo) != "held out":
            return
        self.wait()
        log = root / f"race_{target}.log"
        cmd = [sys.executable, str(REPO / "benchmarks" / "race" / "run.py"), "--zoo", str(root)]
        cmd += ["--targets", target, "--truth-device", self.device, "--merge"]
        cmd += ["--out", str((self.out / f"race_{zoo}").resolve())]
        print(f"   racing {zoo}/{target} in the background (log: {log})", flush=True)
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        self.running = (f"{zoo}/{target} (log: {log})", proc)

    def raced(self, zoo: str, target: str) -> bool:
        """Whether ``race_<zoo>.json`` has the target."""
        path = self.out / f"race_{zoo}.json"
        return path.exists() and target in json.loads(path.read_text()).get("targets", {})

    def wait(self) -> None:
        if self.running is None:
            return
        cell, proc = self.running
        self.running = None
        if proc.wait() != 0:
            self.failed.append(cell)
            print(f"   the race of {cell} failed (exit {proc.returncode})", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the minutes-long subset (not a result)")
    ap.add_argument("--zoos", nargs="*", choices=sorted(zoos.ZOOS), help="default: all")
    ap.add_argument("--targets", nargs="*", choices=sorted(tasks.TARGETS), help="default: all")
    ap.add_argument("--fmnist", default="../shared/datasets/fashion-mnist.npz")
    ap.add_argument("--jobs", type=int, default=2, help="processes (build, fine-tunes)")
    ap.add_argument("--threads", type=int, help="torch threads for scoring (default --jobs)")
    ap.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda", "auto"), help="field fine-tunes"
    )
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument(
        "--truth-only",
        action="store_true",
        help="build and fine-tune (both ground truths) without scoring: no metric result is "
        "seen while a metric may still change (PREREGISTRATION.md)",
    )
    ap.add_argument(
        "--race",
        action="store_true",
        help="after each cell of a held-out zoo, race its target (benchmarks/race/run.py "
        "--merge) on the build its truth was measured on",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the summary and report from the results file, and keep the finished "
        "fine-tuning runs of zoo folders on this machine (a stopped cell's too); build and run "
        "nothing",
    )
    args = ap.parse_args(argv)

    mode = QUICK if args.quick else FULL
    if args.report_only:
        out = Path(args.out)
        json_path, md_path = out / f"{mode.results}.json", out / f"{mode.results}.md"
        if not json_path.is_file():
            raise SystemExit(f"no results to report at {json_path}")
        expected = [f"{z}/{t}" for z in zoos.ZOOS for t in (mode.targets or tasks.TARGETS)]
        res = load_results(json_path, mode)
        refresh_zoo_models(res)
        for zname, n in keep_run_logs(res, mode.runs_dir(out)).items():
            print(f"{zname}: {n} fine-tuning runs kept from its folder", flush=True)
        save(res, json_path, md_path, expected)
        print(f"rewrote {md_path}")
        return
    if not Path(args.fmnist).is_file():
        raise SystemExit(
            f"Fashion-MNIST not found at {args.fmnist}: pass --fmnist PATH (Keras npz layout; "
            "every zoo's targets fmnist4 and shirts2 are cut from it)"
        )
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    zoo_names = args.zoos or list(zoos.ZOOS)
    targets = args.targets or list(mode.targets or tasks.TARGETS)
    threads = args.threads or args.jobs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{mode.results}.json", out / f"{mode.results}.md"
    res = load_results(json_path, mode)
    _, _, cands = candidates()
    res["candidates"] = cands
    res["ensembles"] = {k: list(v) for k, v in ENSEMBLES.items() if k in cands}
    res["near"] = {z: list(zoos.NEAR.get(z, ())) for z in zoos.ZOOS}
    res["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "jobs": args.jobs,
        "threads": threads,
        "field_device": device,
    }
    # the suite is every zoo x every target of the mode, whatever this call was asked to do
    expected = [f"{z}/{t}" for z in zoos.ZOOS for t in (mode.targets or tasks.TARGETS)]
    started = time.perf_counter()
    incomplete: list[str] = []
    races = Races(device, out)
    race_on = args.race and mode.name == "full"  # the quick subset is not a result
    for zname in zoo_names:
        spec = zoos.ZOOS[zname]
        root = zoo_folder(mode, zname)
        only = list(spec.quick) if mode.quick_models else None
        t0 = time.perf_counter()
        digest = build_digest(spec, build_zoo.build_settings(spec, scale=mode.scale), only)
        plans = {t: cell_plan(mode, digest, t, cands) for t in targets}
        done = cells_done(res, zname, plans)
        if len(done) == len(plans):  # nothing to build for (a new machine would pretrain)
            print(f"{zname}: every cell done, zoo not built", flush=True)
            continue
        kept_runs = mode.runs_dir(out) / zname
        merged = merge_run_logs(kept_runs, root)
        if merged:
            print(f"{zname}: {merged} fine-tuning runs merged from {kept_runs}", flush=True)
        build = build_zoo.build(
            spec, root, fmnist=args.fmnist, scale=mode.scale, jobs=args.jobs, only=only
        )
        hashes = zoo_hashes(root)
        if mode.name == "full":
            record_hashes(out / "transfer_suite_hashes.json", zname, build["settings"], hashes)
        models = ground_truth.read_manifest(root)
        res["zoos"][zname] = {
            "description": spec.description,
            "folder": str(root),
            "models": zoo_models(models, build),
            "build_settings": build["settings"],
            "build_seconds_sum": sum(v.get("seconds", 0) for v in build["models"].values()),
            "build_wall_this_call": time.perf_counter() - t0,
            "hashes": hashes,
        }
        res["targets"].update(
            {
                t: {**build["targets"][t], "near": [z for z in zoos.NEAR if t in zoos.NEAR[z]]}
                for t in targets
            }
        )
        for target in targets:
            key = f"{zname}/{target}"
            if target in done:
                print(f"{key}: done before, skipped", flush=True)
                measured_here = res["cells"][key].get("files") == cell_files(hashes, target)
                if race_on and measured_here and not races.raced(zname, target):
                    races.start(root, zname, target)  # its race failed or never ran
                continue
            print(f"== {key}", flush=True)
            t1 = time.perf_counter()
            field_truth, field_meta = ground_truth.compute(
                root,
                [target],
                lrs=list(mode.lrs),
                epochs=mode.epochs,
                seeds=mode.seeds,
                extra_seeds=mode.extra_seeds,
                jobs=args.jobs,
                device=device,
            )
            t2 = time.perf_counter()
            options = service_gt.default_options(**mode.service_changes)
            try:
                service_truth, service_meta = service_gt.compute(
                    root, [target], jobs=args.jobs, options=options
                )
            except RuntimeError as exc:  # failed runs: keep the rest, go on to the next cell
                merge_run_logs(root, kept_runs)
                incomplete.append(f"{key}: {exc}")
                print(f"   {key} incomplete: {exc}", flush=True)
                continue
            t3 = time.perf_counter()
            merge_run_logs(root, kept_runs)
            if args.truth_only:
                print(f"   truth of {key} in {t3 - t1:.0f}s (not scored: --truth-only)", flush=True)
                continue
            scored = score_cell(root, target, field_truth[target], service_truth[target], threads)
            res["cells"][key] = {
                "zoo": zname,
                "target": target,
                "status": "done",
                "plan": plans[target],
                "files": cell_files(hashes, target),
                "truth": {"field": field_truth[target], "service": service_truth[target]},
                "ceiling": run.seed_agreement(field_truth[target]),
                **scored,
                "compute": {
                    "field_wall": t2 - t1,
                    "field_run_seconds": field_meta["sum_run_seconds"],
                    "field_runs": field_meta["runs"],
                    "service_wall": t3 - t2,
                    "service_run_seconds": service_meta["sum_run_seconds"],
                    "service_runs": service_meta["runs"],
                    "score_wall": time.perf_counter() - t3,
                    "machine": res["machine"],
                },
                "protocol": {"field": field_meta, "service": service_meta},
            }
            save(res, json_path, md_path, expected)
            best = max(cands, key=lambda c: scored["candidates"][c]["field"]["weighted_tau"])
            print(f"   done in {time.perf_counter() - t1:.0f}s; best w-tau {best}", flush=True)
            if race_on:
                races.start(root, zname, target)
    races.wait()
    if races.failed:
        incomplete += [f"the race of {cell} failed" for cell in races.failed]
    if incomplete:  # rerun: the logged runs are kept, only the failed ones run again
        raise SystemExit("cells or races left incomplete:\n" + "\n".join(incomplete))
    if args.truth_only:
        print(f"truth-only: fine-tuning runs kept in {out / f'{mode.results}_runs'}")
        return
    res["wall_seconds_last_call"] = time.perf_counter() - started
    save(res, json_path, md_path, expected)
    print(f"{res['status']}: {res['cells_done']} of {len(expected)} cells -> {md_path}")


if __name__ == "__main__":
    main()
