"""Two-stage selection on a transfer zoo: does racing the metric's shortlist with short
fine-tunes pick the model that fine-tunes best, and at what compute?

For every target of a zoo built by ``benchmarks/transfer`` (the first zoo, or one of the
suite's), against its fine-tuned ground truth (``truth.py``), this compares in one run:

* **metric only**: the top-1 of ``--select-by`` (no training; what a job without
  ``selection`` picks). Spending any compute fine-tuning that model longer changes its
  accuracy, not which model it is, so its rel@1 is also that of "the metric's top-1, trained
  longer with the same compute" at every budget;
* **race k=K at budget F**, per variant (``variants.py``: the rule that judges a rung and the
  rung's learning-rate schedule): the metric's K best race by the service's plan
  (``zoopick.training.race.plan``: rung sizes, equal shares) within F x the compute of
  fine-tuning every model once;
* **every model, same budget**: the whole zoo races (the baseline a user could run instead).

Compute is counted in optimizer steps (batch 32) by the training loop; "fine-tune every model
once" is ``models x 3 epochs x steps per epoch of the full training split`` (the service's
default fine-tune length). Candidates fully fine-tune (fresh head, Adam at lr 1e-2, the
first zoo's ground-truth rate) on the training split less a stratified 20 % validation share;
the test split, which the ground truth's accuracies come from, is never used. Deterministic:
seeded, one thread a process.

    python benchmarks/race/run.py --zoo benchmarks/transfer/zoo \\
        --ground-truth benchmarks/results/transfer_ground_truth.json   # development (base)
    python benchmarks/race/run.py --zoo benchmarks/transfer/zoos/fonts   # held out (suite truth)

Writes ``benchmarks/results/race_<zoo>.{json,md}`` (``--out`` to change); ``--merge`` adds
``--targets`` to what is there (the suite's ``--race`` races each held-out cell this way, on
the build its truth was measured on: builds differ between machines).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.race import goals  # noqa: E402
from benchmarks.race import truth as truths  # noqa: E402
from benchmarks.race.paired import SIGNIFICANCE  # noqa: E402
from benchmarks.race.pool import Pool, Recipe, run_race, split_target  # noqa: E402
from benchmarks.race.variants import SERVICE, resolve  # noqa: E402
from benchmarks.transfer.finetune_gt import load_target, read_manifest, setup_torch  # noqa: E402
from benchmarks.transfer.suite import cell_files, zoo_hashes  # noqa: E402
from benchmarks.transfer.tasks import TARGETS  # noqa: E402
from zoopick.training import race  # noqa: E402


def metric_scores(root: Path, target: str, metric: str, cache: str | None) -> dict[str, float]:
    from zoopick.selection.data import load_dataset
    from zoopick.selection.rank import rank_zoo
    from zoopick.selection.zoo import load_zoo

    ranking = rank_zoo(
        load_zoo(root / "zoo.json"),
        load_dataset(root / "targets" / f"{target}-train.npz"),
        [metric],
        cache_dir=cache,
    )
    if ranking.errors:  # a benchmark judges the whole zoo or nothing
        raise SystemExit(f"{target}: {metric} left models out: {ranking.errors}")
    return {m.id: m.scores[metric] for m in ranking.models}


def metric_code_digest() -> str:
    """The metrics' code (the suite's digest): stage 1 changes when it does."""
    from benchmarks.transfer.suite import metric_code_digest as digest

    return digest()


def order_scores(order: list[str]) -> dict[str, float]:
    """A ranking (best first) as scores for ``rank.evaluate``."""
    return {m: float(len(order) - i) for i, m in enumerate(order)}


def run_target(target: str, truth_t: dict[str, dict], args: argparse.Namespace) -> dict[str, Any]:
    """Every race of one target (in a worker process: one thread, deterministic)."""
    from benchmarks.transfer.run import seed_agreement
    from zoopick.selection.rank import evaluate

    setup_torch(1, args.device)
    root = Path(args.zoo)
    entries = {e["id"]: e for e in read_manifest(root)}
    ids = list(entries)
    truth = {m: truth_t[m]["acc"] for m in ids}
    best_acc = max(truth.values())
    train, _ = load_target(root, target)
    data = split_target(target, train, args.validation_fraction, args.seed)
    scores = metric_scores(root, target, args.select_by, args.cache_dir)
    order = sorted(ids, key=lambda m: (-scores[m], ids.index(m)))
    full_cost = int(len(ids) * args.full_epochs * (data.n_train // args.batch_size))
    ceiling = seed_agreement(truth_t)

    def rel(m: str) -> float:
        return truth[m] / best_acc

    row: dict[str, Any] = {
        "classes": data.classes,
        "train": data.n_train,
        "race_train": len(data.y_train),
        "validation": len(data.y_val),
        "full_cost_steps": full_cost,
        "truth_spread": [min(truth.values()), best_acc],
        "ceiling_wtau": ceiling["weighted_tau"] if ceiling else None,
        "metric_order": order,
        "metric_only": {"choice": order[0], "rel@1": rel(order[0]), "steps": 0},
        "races": [],
    }
    variants = [resolve(v) for v in args.variants]
    every = [resolve(v) for v in args.every_model]
    started = time.perf_counter()
    for frac in args.budgets:
        budget = int(math.floor(frac * full_cost))
        for k in [*args.shortlists, len(ids)]:
            racing = every if k == len(ids) else variants
            if not racing:
                continue
            shortlist = order[:k]
            try:
                rungs = race.plan(k, budget)
            except race.BudgetTooSmall as exc:
                row["races"].append({"k": k, "budget": frac, "error": str(exc)})
                continue
            for schedule in dict.fromkeys(v.schedule for v in racing):
                recipe = Recipe(args.lr, args.batch_size, schedule, args.seed, args.device)
                pool = Pool(entries, root, data, rungs, recipe)
                for v in (v for v in racing if v.schedule == schedule):
                    out = run_race(
                        pool,
                        shortlist,
                        lambda m, lp, place, v=v: v.result(m, lp, place, data.y_val),
                        v.ranker(args.significance),
                    )
                    assert out["steps"] <= budget, (out["steps"], budget)  # never exceeded
                    sub = {m: truth[m] for m in shortlist}
                    race_eval = evaluate(order_scores(out["order"]), sub)
                    row["races"].append(
                        {
                            "variant": v.name,
                            "k": k,
                            "every_model": k == len(ids),
                            "budget": frac,
                            "budget_steps": budget,
                            "steps": out["steps"],
                            "compute": out["steps"] / full_cost,
                            "choice": out["winner"],
                            "rel@1": rel(out["winner"]),
                            "shortlist_best_rel": max(rel(m) for m in shortlist),
                            "race_wtau": race_eval["weighted_tau"],
                            "metric_wtau_on_shortlist": evaluate(
                                {m: scores[m] for m in shortlist}, sub
                            )["weighted_tau"],
                            "rungs": out["rungs"],
                        }
                    )
                    print(
                        f"{target} {v.name} k={k} budget={frac}: {out['winner']} rel@1 "
                        f"{rel(out['winner']):.3f} ({out['steps']}/{full_cost} steps)",
                        flush=True,
                    )
                row.setdefault("trained_steps", 0)
                row["trained_steps"] += pool.steps
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default="benchmarks/transfer/zoo", help="a zoo folder")
    ap.add_argument(
        "--ground-truth",
        help="a truth file in ground_truth.py's format; default: the suite's field truth from "
        "<zoo>/gt_runs.jsonl (refused while incomplete)",
    )
    ap.add_argument("--truth-device", default="cpu", help="the device the suite's truth ran on")
    ap.add_argument("--targets", nargs="*")
    ap.add_argument("--select-by", default=None, help="stage 1's metric (the service default)")
    ap.add_argument("--shortlists", type=int, nargs="*", default=[3, 5])
    ap.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=[0.05, 0.1, 0.2, 0.5, 1.0],
        help="race budgets as fractions of fine-tuning every model once",
    )
    ap.add_argument(
        "--variants",
        nargs="*",
        default=["service", "accuracy+constant", "brier+cosine"],
        help="rules raced on the shortlists (variants.py; 'service': the service's)",
    )
    ap.add_argument(
        "--every-model",
        nargs="*",
        default=["service", "accuracy+constant"],
        help="variants racing the whole zoo at each budget (none: skip that baseline)",
    )
    ap.add_argument(
        "--significance", type=float, default=SIGNIFICANCE, help="the paired rule's level"
    )
    ap.add_argument("--full-epochs", type=float, default=3.0, help="'fine-tune once' length")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--validation-fraction", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="targets in parallel, one thread each")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache-dir", default="benchmarks/transfer/cache")
    ap.add_argument("--name", help="the zoo's name in the results (default: from --zoo)")
    ap.add_argument("--out", help="default: benchmarks/results/race_<zoo>")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the targets already in --out (raced with the same zoo, protocol and metric "
        "code, else refused) and add these: a zoo's targets raced one session at a time",
    )
    args = ap.parse_args(argv)
    if args.select_by is None:
        from zoopick.service.jobs import DEFAULT_SELECT_BY

        args.select_by = DEFAULT_SELECT_BY

    root = Path(args.zoo)
    if not (root / "zoo.json").exists():
        raise SystemExit(f"no zoo at {root}: build it first (benchmarks/transfer/suite.py)")
    name = args.name or truths.zoo_name(root)
    out = Path(args.out or f"benchmarks/results/race_{name}")
    targets = args.targets or sorted(
        p.name.removesuffix("-train.npz") for p in (root / "targets").glob("*-train.npz")
    )
    if args.ground_truth:
        truth = truths.from_file(Path(args.ground_truth), args.targets)
        targets = list(truth)
        truth_source = f"{args.ground_truth} (a truth file)"
    else:
        truth = truths.field_truth(root, targets, args.truth_device)
        truth_source = f"{root}/gt_runs.jsonl (the suite's field truth, suite.FULL)"

    head = {
        "zoo": name,
        "role": truths.role(name),
        "folder": str(root),
        "truth": truth_source,
        "protocol": {
            k: getattr(args, k)
            for k in (
                "select_by",
                "shortlists",
                "budgets",
                "variants",
                "every_model",
                "significance",
                "full_epochs",
                "lr",
                "batch_size",
                "validation_fraction",
                "seed",
            )  # fmt: skip
        },
        "service": SERVICE.name,
        "metric_code": metric_code_digest(),
        "models": len(read_manifest(root)),
    }
    earlier = None
    if args.merge and out.with_suffix(".json").exists():
        earlier = json.loads(out.with_suffix(".json").read_text())
        mergeable(earlier, head)  # before any training: a refused merge costs nothing

    started = time.perf_counter()
    results: dict[str, dict] = {}
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
            futures = {t: pool.submit(run_target, t, truth[t], args) for t in targets}
            results = {t: f.result() for t, f in futures.items()}
    else:
        results = {t: run_target(t, truth[t], args) for t in targets}

    hashes = zoo_hashes(root)
    for t, r in results.items():  # what each target was raced on (builds differ by machine)
        r["files"] = cell_files(hashes, t)
    doc = {
        **head,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summarise(results),
        "targets": results,
    }
    if earlier is not None:
        doc = merged(earlier, doc)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    out.with_suffix(".md").write_text(report(doc))
    print(out.with_suffix(".md").read_text())
    return 0


MERGE_KEYS = ("zoo", "role", "truth", "protocol", "service", "metric_code", "models")
"""What two runs must share for their targets to make one result (``--merge``)."""


def mergeable(old: dict, new: dict) -> None:
    """Refuses (exits) unless two runs share everything but their targets (``MERGE_KEYS``)."""
    differ = [k for k in MERGE_KEYS if old.get(k) != new.get(k)]
    if differ:
        raise SystemExit(f"--merge: the earlier result differs in {', '.join(differ)}")


def merged(old: dict, new: dict) -> dict:
    """``new``'s targets added to ``old``'s (a target in both: ``new``'s), the summary over
    all of them. Each target is raced whole in one run, on the build its truth was measured
    on, and a target's race does not depend on which other targets ran with it (one seeded
    process each), so the merge is the result one run over every target would give on
    those builds. Refused when the runs differ in anything else (``mergeable``)."""
    mergeable(old, new)
    targets = {**old["targets"], **new["targets"]}
    return {
        **new,
        "seconds": round(old["seconds"] + new["seconds"], 1),
        "summary": summarise(targets),
        "targets": targets,
    }


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(vals)) if vals else None


def summarise(results: dict[str, dict]) -> list[dict]:
    """Per (variant, k, budget): mean and worst rel@1 over targets, targets at rel@1 >= 0.99,
    targets where it beats / loses to the metric's top-1, mean compute, the race order's mean
    weighted tau on its shortlist and its ratio to the seed-to-seed ceiling."""
    metric_rel = [r["metric_only"]["rel@1"] for r in results.values()]
    rows: list[dict] = [
        {
            "config": "metric only",
            "targets": len(metric_rel),
            "mean_rel@1": float(np.mean(metric_rel)),
            "min_rel@1": float(np.min(metric_rel)),
            "at_0.99": sum(r >= 0.99 for r in metric_rel),
            "compute": 0.0,
        }
    ]
    keys = sorted(
        {(x["variant"], x["k"], x["budget"]) for r in results.values() for x in r["races"]
         if "error" not in x},
        key=lambda key: (key[0], key[1], key[2]),
    )  # fmt: skip
    for variant, k, frac in keys:
        runs = [
            (t, x)
            for t, r in results.items()
            for x in r["races"]
            if "error" not in x and (x["variant"], x["k"], x["budget"]) == (variant, k, frac)
        ]
        rels = [x["rel@1"] for _, x in runs]
        base = [results[t]["metric_only"]["rel@1"] for t, _ in runs]
        ceil = [results[t]["ceiling_wtau"] for t, _ in runs]
        rows.append(
            {
                "config": f"every model (k={k})" if runs[0][1]["every_model"] else f"race k={k}",
                "variant": variant,
                "k": k,
                "budget": frac,
                "targets": len(runs),
                "mean_rel@1": float(np.mean(rels)),
                "min_rel@1": float(np.min(rels)),
                "at_0.99": sum(r >= 0.99 for r in rels),
                "better_than_metric": sum(r > b + 1e-9 for r, b in zip(rels, base, strict=True)),
                "worse_than_metric": sum(r < b - 1e-9 for r, b in zip(rels, base, strict=True)),
                "shortlist_best": float(np.mean([x["shortlist_best_rel"] for _, x in runs])),
                "compute": float(np.mean([x["compute"] for _, x in runs])),
                "mean_wtau": _mean([x["race_wtau"] for _, x in runs]),
                "wtau_vs_ceiling": _mean(
                    [
                        x["race_wtau"] / c if c else None
                        for (_, x), c in zip(runs, ceil, strict=True)
                    ]
                ),
            }
        )
    return rows


def report(doc: dict) -> str:
    p = doc["protocol"]
    role = doc["role"]
    if role == "development":
        stance = (
            "**Development zoo**: the racing rule was chosen on this zoo's numbers; they are "
            "in-sample and do not judge it (`benchmarks/race/PREREGISTRATION.md`)."
        )
    elif role == "held out":
        stance = (
            "**Held-out zoo**: the rule and this protocol were fixed in "
            "`benchmarks/race/PREREGISTRATION.md` before any race number of this zoo existed."
        )
    else:
        stance = "A zoo the pre-registration does not name: neither development nor held out."
    lines = [
        f"# Two-stage selection on the `{doc['zoo']}` zoo",
        "",
        stance,
        "",
        f"{doc['models']} models, {len(doc['targets'])} targets; stage 1 `{p['select_by']}`; "
        f"truth: {doc['truth']}. Races by the service's plan at budgets {p['budgets']} of "
        f"fine-tuning every model once ({p['full_epochs']:g} epochs); Adam lr {p['lr']:g}, "
        f"batch {p['batch_size']}, validation share {p['validation_fraction']:g} of the "
        f"training split; the paired rule's level {p['significance']:g}. The service's variant "
        f"is `{doc['service']}`. Compute is counted "
        f"optimizer steps. Run took {doc['seconds']:.0f} s. `benchmarks/race/run.py`.",
        "",
        "rel@1 of the metric's top-1 is also that of fine-tuning it longer with any budget.",
        "",
        "| config | variant | budget | mean rel@1 | worst rel@1 | targets >= 0.99 | "
        "better / worse than metric | best in shortlist | compute (x fine-tune all) | "
        "race order wtau | / ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v: Any, fmt: str = ".3f") -> str:
        return "" if v is None else format(v, fmt)

    for r in doc["summary"]:
        n = r["targets"]
        bw = (
            f"{r['better_than_metric']} / {r['worse_than_metric']}"
            if "better_than_metric" in r
            else ""
        )
        lines.append(
            f"| {r['config']} | {r.get('variant', '')} | {f(r.get('budget'), 'g')} | "
            f"{f(r['mean_rel@1'])} | {f(r['min_rel@1'])} | {r['at_0.99']} of {n} | {bw} | "
            f"{f(r.get('shortlist_best'))} | {f(r['compute'])} | {f(r.get('mean_wtau'))} | "
            f"{f(r.get('wtau_vs_ceiling'))} |"
        )
    lines += goals.report_lines(doc, list(TARGETS))
    lines += ["", "## Per target", ""]
    lines.append(
        "| target | classes | train / validation | truth range | ceiling wtau | "
        "metric top-1 rel@1 | races (variant k budget: rel@1) |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for t, r in doc["targets"].items():
        races = "; ".join(
            f"{x['variant']} {x['k']} {x['budget']:g}: {x['rel@1']:.3f}"
            for x in r["races"]
            if "error" not in x
        )
        lo, hi = r["truth_spread"]
        lines.append(
            f"| {t} | {r['classes']} | {r['race_train']} / {r['validation']} | {lo:.2f}-{hi:.2f} "
            f"| {f(r['ceiling_wtau'])} | {r['metric_only']['rel@1']:.3f} | {races} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
