"""Two-stage selection judged against the service's own default fine-tune (issue 39).

``run.py`` judges the race against the field's truth (the best of a learning-rate grid, a long
schedule) with candidates trained by the benchmark's plain loop. This script judges what a
job does against what a job gives: per target of a transfer zoo,

* **truth**: the service's default fine-tune (a job's ``"finetune": {}``: the ``auto`` recipe,
  its own length, rate search and best validation checkpoint; on one worker with the dense
  hook, as the race trains) of each model the metric shortlists, its test accuracy on the
  target's test file (``trainer_pool.default_finetune``; seed 0, the service's);
* **race k at budget F**: the service's race (``training.race.plan``'s rungs, halving by
  validation accuracy, ``race.ranked``) of the metric's ``k`` best, every rung trained by the
  service's trainer as ``race_step`` configures it (``trainer_pool.TrainerPool``: the recipe's
  rung, AdamW at its default rate, label smoothing, each rung annealed), within F x the
  compute of the default fine-tune of every shortlisted model; also at the job's default
  budget (``SelectionOptions.budget_epochs``, 3 epochs of the race's training images);
* **metric only**: the top-1 of ``--select-by`` (the service's default), on the same shortlist;
* optionally **plain** (``--variants service plain``): the same races with the old plain loop
  (``pool.Pool``: Adam at 1e-2, each rung annealed), the benchmark's stand-in before.

rel@1 = truth(pick) / the best truth over the shortlist. Compute is counted in optimizer steps
at batch 32 on one worker, as the trainer counts them: a default fine-tune costs its trained
steps plus its rate search's trial steps; a race, the steps of every rung segment it used.
Validation passes (the recipe's checks, a rung's validation) are not counted on either side.

    python benchmarks/race/service_run.py --zoo benchmarks/transfer/zoo --targets digits

Writes ``benchmarks/results/race_base_service.{json,md}`` (``--out``), adding each target as it
finishes (a run of another protocol is refused). The default fine-tunes are cached in
``<zoo>/service_default_runs.jsonl``, keyed by the files and the options.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.race import trainer_pool  # noqa: E402
from benchmarks.race import truth as truths  # noqa: E402
from benchmarks.race.pool import Pool, Recipe, run_race, split_target  # noqa: E402
from benchmarks.race.run import metric_code_digest, metric_scores  # noqa: E402
from benchmarks.race.variants import resolve  # noqa: E402
from benchmarks.transfer.finetune_gt import load_target, read_manifest, setup_torch  # noqa: E402
from benchmarks.transfer.ground_truth import file_hash  # noqa: E402
from zoopick.training import race  # noqa: E402

GOAL_REL = 0.99
GOAL_BUDGET = 0.3
"""Issue 39's goal: the race's pick at rel@1 >= 0.99 against the service's default fine-tune,
at <= 30 % of fine-tuning every shortlisted model (``PREREGISTRATION.md``, section 4)."""
PRIMARY_K = 3
"""The service's default shortlist (``SelectionOptions.shortlist``): the primary verdict."""
ORDER = (
    "fmnist4",
    "digits",
    "glyphs",
    "textures",
    "letters",
    "counts",
    "shirts2",
    "chars62",
    "photo64",
)
"""The registered order of the targets (``PREREGISTRATION.md``, section 4): raced one at a
time in this order while the session's compute lasts, none skipped."""
VARIANTS = {"service": "the service's race (trainer, recipe rungs)", "plain": "plain loop"}


def code_digest() -> str:
    """The trainer's and the recipe's code: a default fine-tune changes when they do."""
    h = hashlib.sha256()
    for name in ("training/recipe.py", "training/finetune.py", "training/race.py"):
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()[:16]


class TruthCache:
    """Default fine-tunes already run, in ``<zoo>/service_default_runs.jsonl``."""

    def __init__(self, root: Path, options_text: str) -> None:
        self.root, self.options_text = root, options_text
        self.path = root / "service_default_runs.jsonl"
        self.done: dict[str, dict] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    self.done[rec["key"]] = rec

    def key(self, entry: dict, target: str) -> str:
        parts = [
            target,
            entry["id"],
            file_hash(str(self.root / entry["weights"])),
            file_hash(str(self.root / "targets" / f"{target}-train.npz")),
            file_hash(str(self.root / "targets" / f"{target}-test.npz")),
            self.options_text,
            code_digest(),
        ]
        return "|".join(parts)

    def get(self, entry: dict, target: str, work: Path) -> dict:
        key = self.key(entry, target)
        if key not in self.done:
            out = work / f"default-{target}-{entry['id']}"
            shutil.rmtree(out, ignore_errors=True)
            rec = trainer_pool.default_finetune(self.root, entry["id"], target, out)
            shutil.rmtree(out, ignore_errors=True)
            rec = {"key": key, "target": target, "model": entry["id"], **rec}
            with self.path.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")
            self.done[key] = rec
            print(
                f"{target} default fine-tune {entry['id']}: test {rec['acc']:.4f}, lr "
                f"{rec['lr']:.3g} ({rec['lr_source']}), {rec['cost_steps']} steps, "
                f"{rec['seconds']:.0f} s",
                flush=True,
            )
        return self.done[key]


def race_budgets(fractions: list[float], default_epochs: float, full: int, epoch: int):
    """(label, fraction of ``full`` or None, budget in steps) of each race."""
    out = [(f"{f:g}", f, int(math.floor(f * full))) for f in fractions]
    if default_epochs:
        out.append((f"{default_epochs:g} epochs", None, race.budget_steps(default_epochs, epoch)))
    return out


def run_target(target: str, args: argparse.Namespace, cache: TruthCache) -> dict[str, Any]:
    root = Path(args.zoo)
    entries = {e["id"]: e for e in read_manifest(root)}
    ids = list(entries)
    started = time.perf_counter()
    scores = metric_scores(root, target, args.select_by, args.cache_dir)
    order = sorted(ids, key=lambda m: (-scores[m], ids.index(m)))
    widest = order[: max(args.shortlists)]
    runs = {m: cache.get(entries[m], target, Path(args.work)) for m in widest}
    truth = {m: runs[m]["acc"] for m in widest}
    train, test = load_target(root, target)
    classes = len(train["class_names"])
    data = split_target(target, train, args.validation_fraction, args.seed)  # plain loop only
    from zoopick.selection.data import training_count

    counts = np.bincount(train["y"], minlength=classes).tolist()
    race_images = training_count(counts, fractions=(args.validation_fraction,))
    epoch_steps = race.steps_per_epoch(race_images, args.batch_size)
    n_test = len(test["y"])
    row: dict[str, Any] = {
        "classes": classes,
        "train": len(train["y"]),
        "race_train": race_images,
        "test": n_test,
        "metric_order": order,
        "default_finetunes": {m: {k: v for k, v in runs[m].items() if k != "key"} for m in widest},
        "shortlists": {},
    }
    for k in args.shortlists:
        shortlist = order[:k]
        best = max(truth[m] for m in shortlist)
        full = sum(runs[m]["cost_steps"] for m in shortlist)

        def rel(m: str, best: float = best) -> float:
            return truth[m] / best

        accs = [truth[m] for m in shortlist]
        entry: dict[str, Any] = {
            "shortlist": shortlist,
            "truth": {m: truth[m] for m in shortlist},
            "full_cost_steps": full,
            "metric_only": {"choice": shortlist[0], "rel@1": rel(shortlist[0]), "steps": 0},
            "degenerate": degenerate(accs, classes, n_test),
            "races": [],
        }
        for label, frac, budget in race_budgets(
            args.budgets, args.default_budget_epochs, full, epoch_steps
        ):
            try:
                rungs = race.plan(k, budget)
            except race.BudgetTooSmall as exc:
                entry["races"].append({"budget": label, "error": str(exc)})
                continue
            for variant in args.variants:
                t0 = time.perf_counter()
                if variant == "service":
                    work = Path(args.work) / f"race-{target}-{k}-{label.replace(' ', '')}"
                    shutil.rmtree(work, ignore_errors=True)
                    pool = trainer_pool.TrainerPool(
                        root, target, rungs, work, validation_fraction=args.validation_fraction
                    )
                    result_of = lambda m, acc, place: race.Result(m, acc, place)  # noqa: E731
                else:
                    plain = resolve("accuracy+cosine")
                    recipe = Recipe(args.plain_lr, args.batch_size, plain.schedule, args.seed)
                    pool = Pool(entries, root, data, rungs, recipe)
                    result_of = (  # noqa: E731
                        lambda m, lp, place, v=plain: v.result(m, lp, place, data.y_val)
                    )
                try:
                    out = run_race(
                        pool, shortlist, result_of, lambda rs: [r.model for r in race.ranked(rs)]
                    )
                finally:
                    if isinstance(pool, trainer_pool.TrainerPool):
                        pool.close()
                assert out["steps"] <= budget, (out["steps"], budget)  # never exceeded
                entry["races"].append(
                    {
                        "variant": variant,
                        "budget": label,
                        "fraction": frac,
                        "budget_steps": budget,
                        "rungs": [r.__dict__ for r in rungs],
                        "steps": out["steps"],
                        "compute": out["steps"] / full,
                        "choice": out["winner"],
                        "metric_place": shortlist.index(out["winner"]),
                        "rel@1": rel(out["winner"]),
                        "validation": out["rungs"],
                        "seconds": round(time.perf_counter() - t0, 1),
                    }
                )
                print(
                    f"{target} {variant} k={k} budget {label}: {out['winner']} rel@1 "
                    f"{rel(out['winner']):.3f} ({out['steps']}/{full} steps = "
                    f"{out['steps'] / full:.3f})",
                    flush=True,
                )
        row["shortlists"][str(k)] = entry
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def degenerate(accs: list[float], classes: int, n_test: int) -> list[str]:
    """What makes a shortlist's judgement uninformative, in words (empty: nothing)."""
    notes = []
    se = math.sqrt(0.25 / max(n_test, 1))  # the widest binomial standard error
    if max(accs) - min(accs) < 1.0 / max(n_test, 1):
        notes.append("every shortlisted model has the same test accuracy: any pick is right")
    elif max(accs) - min(accs) < 0.01:
        notes.append("the shortlist's truths are within 1 point: rel@1 >= 0.99 for any pick")
    if max(accs) < 1.0 / classes + 2 * se:
        notes.append("the best shortlisted model is within 2 standard errors of chance")
    return notes


def summarise(targets: dict[str, dict], shortlists: list[int]) -> list[dict]:
    rows = []
    for k in shortlists:
        per = [
            (t, r["shortlists"][str(k)]) for t, r in targets.items() if str(k) in r["shortlists"]
        ]
        if not per:
            continue
        metric = [e["metric_only"]["rel@1"] for _, e in per]
        rows.append(
            {
                "k": k,
                "variant": "metric only",
                "budget": "-",
                "targets": len(per),
                "mean_rel@1": float(np.mean(metric)),
                "min_rel@1": float(np.min(metric)),
                "at_goal": sum(x >= GOAL_REL for x in metric),
                "compute": 0.0,
            }
        )
        keys = dict.fromkeys(
            (x["variant"], x["budget"]) for _, e in per for x in e["races"] if "error" not in x
        )
        for variant, budget in keys:
            cells = [
                (t, e, x)
                for t, e in per
                for x in e["races"]
                if "error" not in x and (x["variant"], x["budget"]) == (variant, budget)
            ]
            rels = [x["rel@1"] for _, _, x in cells]
            base = [e["metric_only"]["rel@1"] for _, e, _ in cells]
            rows.append(
                {
                    "k": k,
                    "variant": variant,
                    "budget": budget,
                    "fraction": cells[0][2]["fraction"],
                    "targets": len(cells),
                    "mean_rel@1": float(np.mean(rels)),
                    "min_rel@1": float(np.min(rels)),
                    "at_goal": sum(x >= GOAL_REL for x in rels),
                    "better_than_metric": sum(
                        r > b + 1e-9 for r, b in zip(rels, base, strict=True)
                    ),
                    "worse_than_metric": sum(r < b - 1e-9 for r, b in zip(rels, base, strict=True)),
                    "compute": float(np.mean([x["compute"] for _, _, x in cells])),
                    "max_compute": float(np.max([x["compute"] for _, _, x in cells])),
                }
            )
    return rows


def within_goal(row: dict) -> bool:
    """A budget the goal allows: a registered fraction of at most :data:`GOAL_BUDGET`, or the
    job's default budget where every target's race cost at most that."""
    if row.get("fraction") is not None:
        return row["fraction"] <= GOAL_BUDGET + 1e-9
    return row.get("max_compute", math.inf) <= GOAL_BUDGET + 1e-9


def verdicts(doc: dict) -> list[dict]:
    """Per shortlist: is there a budget the goal allows (:func:`within_goal`) at which the
    service's race has rel@1 >= 0.99 on every target raced? (``PREREGISTRATION.md``,
    section 4.) The metric's top-1 on the same shortlist is the baseline."""
    out = []
    for k in doc["protocol"]["shortlists"]:
        rows = [
            r
            for r in doc["summary"]
            if r["k"] == k and r["variant"] == "service" and within_goal(r)
        ]
        metric = next((r for r in doc["summary"] if r["k"] == k and r["variant"] == "metric only"),
                      None)  # fmt: skip
        meeting = [r for r in rows if r["at_goal"] == r["targets"]]
        met = bool(meeting)
        best = max(rows, key=lambda r: (r["at_goal"], r["min_rel@1"]), default=None)
        out.append(
            {
                "k": k,
                "primary": k == PRIMARY_K,
                "met": met,
                "at": [r["budget"] for r in meeting],
                "best": None
                if best is None
                else {x: best[x] for x in ("budget", "at_goal", "targets", "min_rel@1", "compute")},
                "metric_at_goal": None if metric is None else metric["at_goal"],
                "metric_min": None if metric is None else metric["min_rel@1"],
                "targets": metric["targets"] if metric else 0,
            }
        )
    return out


def report(doc: dict) -> str:
    p = doc["protocol"]
    lines = [
        f"# Two-stage selection against the service's default fine-tune: the `{doc['zoo']}` zoo",
        "",
        f"Role: **{doc['role']}**. {doc['stance']}",
        "",
        f"{doc['models']} models, targets {', '.join(doc['targets'])}; stage 1 "
        f"`{p['select_by']}` (metric code `{doc['metric_code']}`); trainer and recipe code "
        f"`{doc['code']}` at commit `{doc['commit']}`.",
        "",
        '**Truth**: the service\'s default fine-tune (`"finetune": {}`: the auto recipe, one '
        "worker, dense hook, seed 0) of each shortlisted model; test accuracy on the target's "
        "test file. **Race**: the service's race of the metric's k best, each rung trained by "
        "the service's trainer as `race_step` configures it: "
        f"{doc['rung_recipe']}. Budgets: {p['budgets']} of the shortlist's default "
        f"fine-tunes (their trained steps plus their rate search's), and the job default "
        f"({p['default_budget_epochs']:g} epochs of the race's training images). Compute: "
        "optimizer steps at batch 32 on one worker, as the trainer counts them; validation "
        f"passes not counted. Validation share {p['validation_fraction']:g}. Run took "
        f"{doc['seconds']:.0f} s. `benchmarks/race/service_run.py`.",
        "",
        "| k | variant | budget | targets | mean rel@1 | worst rel@1 | targets >= 0.99 | "
        "better / worse than metric | compute (x default fine-tunes of the shortlist) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["summary"]:
        bw = (
            f"{r['better_than_metric']} / {r['worse_than_metric']}"
            if "better_than_metric" in r
            else ""
        )
        comp = f"{r['compute']:.3f}" + (f" (max {r['max_compute']:.3f})" if "max_compute" in r
                                        else "")  # fmt: skip
        lines.append(
            f"| {r['k']} | {r['variant']} | {r['budget']} | {r['targets']} | "
            f"{r['mean_rel@1']:.3f} | {r['min_rel@1']:.3f} | {r['at_goal']} of {r['targets']} "
            f"| {bw} | {comp} |"
        )
    lines += ["", "## Verdicts (goal: rel@1 >= 0.99 on every target at <= 0.3)", ""]
    for v in doc["verdicts"]:
        tag = "primary" if v["primary"] else "secondary"
        if v["met"]:
            text = f"**met** at budget(s) {', '.join(v['at'])}"
        elif v["best"] is None:
            text = "**not judged** (no race at a budget <= 0.3)"
        else:
            b = v["best"]
            text = (
                f"**not met**: closest budget {b['budget']}, {b['at_goal']} of {b['targets']} "
                f"targets at 0.99, worst {b['min_rel@1']:.3f}"
            )
        lines.append(
            f"* k={v['k']} ({tag}): {text}; the metric's top-1 on the same shortlist: "
            f"{v['metric_at_goal']} of {v['targets']} at 0.99, worst {v['metric_min']:.3f}."
        )
    if len(doc["targets"]) < doc.get("registered_targets", 0):
        lines.append(
            f"* Judged on {len(doc['targets'])} of {doc['registered_targets']} targets: a "
            "verdict 'met' is provisional (a further target can only lower the worst case)."
        )
    lines += ["", "## Per target", ""]
    lines.append(
        "| target | classes | test | k | shortlist truth (metric order) | metric top-1 | "
        "races (variant budget: pick rel@1, compute) | notes |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for t, r in doc["targets"].items():
        for k, e in r["shortlists"].items():
            tr = ", ".join(f"{e['truth'][m]:.3f}" for m in e["shortlist"])
            races = "; ".join(
                f"{x['variant']} {x['budget']}: #{x['metric_place'] + 1} {x['rel@1']:.3f}, "
                f"{x['compute']:.3f}"
                for x in e["races"]
                if "error" not in x
            )
            errors = [x["error"] for x in e["races"] if "error" in x]
            notes = "; ".join(e["degenerate"] + [f"refused: {x}" for x in errors])
            lines.append(
                f"| {t} | {r['classes']} | {r['test']} | {k} | {tr} | "
                f"{e['metric_only']['rel@1']:.3f} | {races} | {notes} |"
            )
    lines += ["", "Default fine-tunes (the truth): rate and how it was found, steps, search.", ""]
    lines.append("| target | model | test acc | lr | steps (+ search) | best step | seconds |")
    lines.append("|---|---|---|---|---|---|---|")
    for t, r in doc["targets"].items():
        for m, d in r["default_finetunes"].items():
            lines.append(
                f"| {t} | {m} | {d['acc']:.4f} | {d['lr']:.3g} ({d['lr_source']}) | "
                f"{d['steps']} (+{d['search_steps']}) | {d['best_step']} | {d['seconds']:.0f} |"
            )
    return "\n".join(lines) + "\n"


STANCE = {
    "development": (
        "The halving rule (accuracy, annealed rungs) was chosen on this zoo against the field's "
        "truth (`PREREGISTRATION.md`, section 1), so for the halving rule this judgement is "
        "in-sample; the rungs' recipe (`training/recipe.py`) was not chosen on it, and nothing "
        "here was tuned on these numbers."
    ),
    "held out": "The rule and this protocol were fixed before any number of this zoo existed.",
}


MERGE_KEYS = ("zoo", "protocol", "metric_code", "code", "options", "models")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default="benchmarks/transfer/zoo")
    ap.add_argument("--targets", nargs="*")
    ap.add_argument("--select-by", default=None, help="stage 1's metric (the service default)")
    ap.add_argument("--shortlists", type=int, nargs="*", default=[3, 5])
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.1, 0.2, 0.3])
    ap.add_argument("--default-budget-epochs", type=float, default=None,
                    help="also race at this budget_epochs (default: the job default)")  # fmt: skip
    ap.add_argument("--variants", nargs="*", default=["service", "plain"], choices=list(VARIANTS))
    ap.add_argument("--plain-lr", type=float, default=1e-2, help="the plain loop's Adam rate")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--validation-fraction", type=float, default=None,
                    help="default: the service's (SelectionOptions)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default="benchmarks/transfer/cache")
    ap.add_argument("--work", default="/tmp/zoopick-race-service")
    ap.add_argument("--out", help="default: benchmarks/results/race_<zoo>_service")
    args = ap.parse_args(argv)
    from zoopick.service.jobs import DEFAULT_SELECT_BY
    from zoopick.training.race import SelectionOptions

    defaults = SelectionOptions()
    args.select_by = args.select_by or DEFAULT_SELECT_BY
    if args.validation_fraction is None:
        args.validation_fraction = defaults.validation_fraction
    if args.default_budget_epochs is None:
        args.default_budget_epochs = defaults.budget_epochs
    setup_torch(1, "cpu")
    root = Path(args.zoo)
    if not (root / "zoo.json").exists():
        raise SystemExit(f"no zoo at {root}: build it first (benchmarks/transfer/build_zoo.py)")
    name = truths.zoo_name(root)
    out = Path(args.out or f"benchmarks/results/race_{name}_service")
    all_targets = sorted(
        p.name.removesuffix("-train.npz") for p in (root / "targets").glob("*-train.npz")
    )
    targets = args.targets or sorted(
        all_targets, key=lambda t: (ORDER.index(t) if t in ORDER else len(ORDER), t)
    )
    options = trainer_pool.options()
    rung = trainer_pool.rung_config(
        trainer_pool.service_job({}, race.plan(3, 12)), level=1, zoo=root, model="-",
        data=root, test_data=None, out=Path(args.work) / "-", validation_fraction=0.2,
    )  # fmt: skip
    from zoopick.training import recipe

    p = recipe.plan(rung, steps_per_epoch=10, validation=None, rung=True)
    rung_recipe = (
        f"{p.optimizer} (weight decay {p.weight_decay:g}) at lr {p.lr:g} ({p.lr_source}), "
        f"head x{p.head_lr_scale:g}, label smoothing {p.label_smoothing:g}, augmentation "
        f"{'on' if p.augment else 'off'}, each rung a cosine from its start (decay_from)"
    )
    role = truths.role(name)
    head = {
        "zoo": name,
        "role": role,
        "stance": STANCE.get(role, "A zoo the pre-registration does not name."),
        "folder": str(root),
        "protocol": {
            k: getattr(args, k)
            for k in (
                "select_by",
                "shortlists",
                "budgets",
                "default_budget_epochs",
                "variants",
                "plain_lr",
                "batch_size",
                "validation_fraction",
                "seed",
            )  # fmt: skip
        },
        "options": options.model_dump(mode="json"),
        "rung_recipe": rung_recipe,
        "metric_code": metric_code_digest(),
        "code": code_digest(),
        "models": len(read_manifest(root)),
        "registered_targets": len(all_targets),
    }
    head["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    earlier: dict[str, Any] = {}
    if out.with_suffix(".json").exists():
        old = json.loads(out.with_suffix(".json").read_text())
        differ = [k for k in MERGE_KEYS if old.get(k) != head.get(k)]
        if differ:
            raise SystemExit(f"{out}.json was run differently ({', '.join(differ)}): move it")
        earlier = old
    cache = TruthCache(root, json.dumps(head["options"], sort_keys=True))
    results = dict(earlier.get("targets", {}))
    seconds = earlier.get("seconds", 0.0)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    for t in targets:
        t0 = time.perf_counter()
        results[t] = run_target(t, args, cache)
        seconds += time.perf_counter() - t0
        doc = {**head, "seconds": round(seconds, 1), "targets": results}
        doc["summary"] = summarise(results, args.shortlists)
        doc["verdicts"] = verdicts(doc)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
        out.with_suffix(".md").write_text(report(doc))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
