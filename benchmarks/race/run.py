"""Two-stage selection on the transfer benchmark: does racing the metric's shortlist with short
fine-tunes pick the model that fine-tunes best, and at what compute?

For every target of ``benchmarks/transfer`` (its zoo, targets and committed ground truth:
full fine-tuning, Adam, 3 epochs, mean over seeds), this compares, in one run:

* **metric only**: the metric's top-1 (no training; what a job without ``selection`` picks);
* **race k=K at budget F**: the metric's K best race with successive halving, the plan and the
  halving rule being the service's own (``zoopick.training.race``: rungs, equal shares,
  validation accuracy, ties to the metric's order) within F x the compute of fine-tuning every
  model once;
* **every model, same budget**: the baseline a user would otherwise run: the whole zoo gets the
  same budget in equal shares (one rung), the best validation accuracy wins.

Compute is counted in optimizer steps of batch 32 (every model and target uses the same
batch), by the training loop itself; "fine-tune every model once" is ``models x epochs x
steps per epoch of the full training split`` with the ground truth's protocol (3 epochs).
Candidates train as the ground truth does (Adam, lr 1e-2, full fine-tuning, fresh head) but at
a constant learning rate, since a race extends runs rung by rung; they train on the training
split less a stratified 20 % validation share (the race never sees the test split, which the
ground truth's accuracies come from).

Nothing here was tuned on these results: the shortlists (3, 5), the budgets and the validation
share were fixed before the first run, and the service's defaults (shortlist 3, 3 epochs of
budget) were set without this benchmark.

    python benchmarks/race/run.py --zoo benchmarks/transfer/zoo \\
        --ground-truth benchmarks/results/transfer_ground_truth.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.transfer.finetune_gt import (  # noqa: E402
    accuracy,
    create_from_entry,
    load_target,
    read_manifest,
    setup_torch,
    stable_seed,
    to_tensor,
)
from zoopick.selection.data import split_count  # noqa: E402
from zoopick.training import race  # noqa: E402


def stratified_split(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) indices: each class holds out ``split_count`` images (the service's
    rule), picked by a seeded generator per class."""
    val = []
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        n = split_count(len(members), fraction)
        rng = np.random.default_rng([seed, zlib.crc32(str(int(c)).encode())])
        val.append(rng.choice(members, n, replace=False))
    mask = np.zeros(len(y), dtype=bool)
    mask[np.concatenate(val)] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


class Meter:
    """Counts every optimizer step the benchmark takes (the compute it reports)."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0


@dataclass
class Candidate:
    """One model mid-race: its weights and optimizer live on between rungs (what the service
    keeps in the candidate's checkpoint), so a rung continues where the last one stopped."""

    model_id: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    gen: torch.Generator
    steps: int = 0
    order: list[torch.Tensor] = field(default_factory=list)

    def train(self, x: torch.Tensor, y: torch.Tensor, steps: int, batch: int, meter: Meter) -> None:
        t0 = time.perf_counter()
        self.model.train()
        for _ in range(steps):
            if not self.order:  # a new epoch: a fresh seeded shuffle, last partial batch dropped
                perm = torch.randperm(len(y), generator=self.gen)
                self.order = list(perm[: len(y) // batch * batch].split(batch))
            idx = self.order.pop(0)
            loss = F.cross_entropy(self.model(x[idx]), y[idx])
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.steps += 1
            meter.steps += 1
        meter.seconds += time.perf_counter() - t0


def make_candidate(entry, root: Path, classes: int, lr: float, seed: int) -> Candidate:
    torch.manual_seed(stable_seed("race", entry["id"], seed))
    model = create_from_entry(entry, root, classes)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(stable_seed("order", entry["id"], seed))
    return Candidate(entry["id"], model, opt, gen)


def run_race(
    shortlist: Sequence[str],
    budget: int,
    entries: dict,
    root: Path,
    data: dict,
    args: argparse.Namespace,
    meter: Meter,
) -> dict:
    """Successive halving over ``shortlist`` (best first by the metric) with ``budget`` steps,
    by the service's plan and halving rule; returns the winner, the final order and the
    rungs."""
    rungs = race.plan(len(shortlist), budget)
    place = {m: i for i, m in enumerate(shortlist)}
    alive = {
        m: make_candidate(entries[m], root, data["classes"], args.lr, args.seed) for m in shortlist
    }
    out_order: list[str] = []  # eliminated models, worst first
    log = []
    for r in rungs:
        results = []
        for m, cand in alive.items():
            cand.train(data["x_train"], data["y_train"], r.steps_each, args.batch_size, meter)
            acc = accuracy(cand.model, data["x_val"], data["y_val"])
            results.append(race.Result(m, acc, place[m]))
        keep = rungs[r.index + 1].candidates if r.index + 1 < len(rungs) else 1
        best = race.survivors(results, keep)
        dropped = sorted(
            (x for x in results if x.model not in best),
            key=lambda x: (x.val_accuracy, -x.metric_place),
        )
        out_order += [x.model for x in dropped]
        log.append({x.model: round(x.val_accuracy, 4) for x in results})
        alive = {m: alive[m] for m in best}
    winner = next(iter(alive))
    out_order.append(winner)
    return {"winner": winner, "order": out_order[::-1], "rungs": log}


def load(root: Path, target: str, args: argparse.Namespace, entries: dict) -> dict:
    train, test = load_target(root, target)
    tr_idx, val_idx = stratified_split(train["y"], args.validation_fraction, args.seed)
    any_entry = next(iter(entries.values()))
    mean, std = any_entry.get("mean", [0.5] * 3), any_entry.get("std", [0.5] * 3)
    x = to_tensor(train["x"], mean, std)
    y = torch.from_numpy(train["y"]).long()
    return {
        "classes": len(train["class_names"]),
        "n_train": len(y),
        "x_train": x[tr_idx],
        "y_train": y[tr_idx],
        "x_val": x[val_idx],
        "y_val": y[val_idx],
        "n_test": len(test["y"]),
    }


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
    return {m.id: m.scores[metric] for m in ranking.models}


def order_scores(order: Sequence[str]) -> dict[str, float]:
    """A ranking (best first) as scores for ``rank.evaluate``."""
    return {m: float(len(order) - i) for i, m in enumerate(order)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default="benchmarks/transfer/zoo")
    ap.add_argument("--ground-truth", default="benchmarks/results/transfer_ground_truth.json")
    ap.add_argument("--transfer-results", default="benchmarks/results/transfer.json")
    ap.add_argument("--targets", nargs="*")
    ap.add_argument("--metric", default="fsms", help="stage 1's metric (the service default)")
    ap.add_argument("--shortlists", type=int, nargs="*", default=[3, 5])
    ap.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=[0.05, 0.1, 0.2],
        help="race budgets as fractions of fine-tuning every model once",
    )
    ap.add_argument("--full-epochs", type=float, default=3.0, help="'fine-tune once' length")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--validation-fraction", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default="benchmarks/transfer/cache")
    ap.add_argument("--out", default="benchmarks/results/race")
    args = ap.parse_args(argv)

    from zoopick.selection.rank import evaluate

    setup_torch(args.threads)
    root = Path(args.zoo)
    entries = {e["id"]: e for e in read_manifest(root)}
    truth_all = json.loads(Path(args.ground_truth).read_text())
    targets = args.targets or list(truth_all)
    ceilings = {}
    tr_path = Path(args.transfer_results)
    if tr_path.exists():
        tr = json.loads(tr_path.read_text())
        for t, r in tr.get("targets", {}).items():
            if r.get("seed_ceiling"):
                ceilings[t] = r["seed_ceiling"]["weighted_tau"]

    results: dict[str, dict] = {}
    started = time.perf_counter()
    for target in targets:
        truth = {m: truth_all[target][m]["acc"] for m in entries}
        best_acc = max(truth.values())
        data = load(root, target, args, entries)
        scores = metric_scores(root, target, args.metric, args.cache_dir)
        ids = list(entries)
        order = sorted(ids, key=lambda m: (-scores[m], ids.index(m)))
        spe_full = data["n_train"] // args.batch_size
        full_cost = int(len(ids) * args.full_epochs * spe_full)

        def rel(m: str) -> float:
            return truth[m] / best_acc  # noqa: B023 - used inside the loop only

        row: dict = {
            "classes": data["classes"],
            "train": data["n_train"],
            "race_train": len(data["y_train"]),
            "validation": len(data["y_val"]),
            "full_cost_steps": full_cost,
            "truth_spread": [min(truth.values()), best_acc],
            "metric_only": {"choice": order[0], "rel@1": rel(order[0]), "steps": 0},
            "races": [],
        }
        for frac in args.budgets:
            budget = int(math.floor(frac * full_cost))
            for k in [*args.shortlists, len(ids)]:
                meter = Meter()
                try:
                    outcome = run_race(order[:k], budget, entries, root, data, args, meter)
                except race.BudgetTooSmall as exc:
                    row["races"].append({"k": k, "budget": frac, "error": str(exc)})
                    continue
                shortlist = order[:k]
                sub_truth = {m: truth[m] for m in shortlist}
                race_eval = evaluate(order_scores(outcome["order"]), sub_truth)
                metric_eval = evaluate({m: scores[m] for m in shortlist}, sub_truth)
                row["races"].append(
                    {
                        "k": k,
                        "every_model": k == len(ids),
                        "budget": frac,
                        "budget_steps": budget,
                        "steps": meter.steps,
                        "compute": meter.steps / full_cost,
                        "train_seconds": round(meter.seconds, 2),
                        "choice": outcome["winner"],
                        "rel@1": rel(outcome["winner"]),
                        "shortlist_best_rel": max(rel(m) for m in shortlist),
                        "race_wtau": race_eval["weighted_tau"],
                        "metric_wtau_on_shortlist": metric_eval["weighted_tau"],
                        "rungs": outcome["rungs"],
                    }
                )
                assert meter.steps <= budget, (meter.steps, budget)  # counted, never exceeded
                print(
                    f"{target} k={k} budget={frac}: {outcome['winner']} rel@1 "
                    f"{rel(outcome['winner']):.3f} ({meter.steps}/{full_cost} steps)",
                    flush=True,
                )
        results[target] = row

    summary = summarise(results, args, ceilings)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "protocol": {
            k: getattr(args, k)
            for k in (
                "metric",
                "shortlists",
                "budgets",
                "full_epochs",
                "lr",
                "batch_size",
                "validation_fraction",
                "seed",
            )  # fmt: skip
        },
        "models": len(entries),
        "seconds": round(time.perf_counter() - started, 1),
        "ceilings": ceilings,
        "summary": summary,
        "targets": results,
    }
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    out.with_suffix(".md").write_text(report(doc))
    print(out.with_suffix(".md").read_text())
    return 0


def summarise(results: dict, args: argparse.Namespace, ceilings: dict) -> list[dict]:
    """Per (k, budget): mean and worst rel@1 over targets, mean compute, mean weighted tau of
    the race's order on its shortlist and its ratio to the seed-to-seed ceiling."""
    rows = []
    metric_rel = [r["metric_only"]["rel@1"] for r in results.values()]
    rows.append(
        {
            "config": "metric only",
            "targets": len(metric_rel),
            "mean_rel@1": float(np.mean(metric_rel)),
            "min_rel@1": float(np.min(metric_rel)),
            "compute": 0.0,
        }
    )
    keys = sorted({(x["k"], x["budget"]) for r in results.values() for x in r["races"]})
    for k, frac in keys:
        runs = [
            (t, x)
            for t, r in results.items()
            for x in r["races"]
            if x["k"] == k and x["budget"] == frac and "error" not in x
        ]
        if not runs:
            continue
        every = runs[0][1]["every_model"]
        rels = [x["rel@1"] for _, x in runs]
        wt = [x["race_wtau"] for _, x in runs if not math.isnan(x["race_wtau"])]
        ratio = [
            x["race_wtau"] / ceilings[t]
            for t, x in runs
            if t in ceilings and not math.isnan(x["race_wtau"])
        ]
        rows.append(
            {
                "config": f"every model (k={k})" if every else f"race k={k}",
                "budget": frac,
                "targets": len(runs),
                "mean_rel@1": float(np.mean(rels)),
                "min_rel@1": float(np.min(rels)),
                "shortlist_best": float(np.mean([x["shortlist_best_rel"] for _, x in runs])),
                "compute": float(np.mean([x["compute"] for _, x in runs])),
                "mean_wtau": float(np.mean(wt)) if wt else None,
                "wtau_vs_ceiling": float(np.mean(ratio)) if ratio else None,
            }
        )
    return rows


def report(doc: dict) -> str:
    p = doc["protocol"]
    lines = [
        "# Two-stage selection on the transfer benchmark",
        "",
        f"{doc['models']} models, {len(doc['targets'])} targets; stage 1 `{p['metric']}`; "
        f"races by the service's plan (successive halving, equal shares) at budgets "
        f"{p['budgets']} of fine-tuning every model once ({p['full_epochs']:g} epochs), Adam "
        f"lr {p['lr']:g} constant, batch {p['batch_size']}, validation share "
        f"{p['validation_fraction']:g} of the training split. Compute is counted optimizer "
        f"steps. Run took {doc['seconds']:.0f} s. `benchmarks/race/run.py`.",
        "",
        "| config | budget | targets | mean rel@1 | worst rel@1 | best in shortlist | "
        "compute (x fine-tune all) | race order wtau | / ceiling |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt=".3f"):
        return "" if v is None else format(v, fmt)

    for r in doc["summary"]:
        lines.append(
            f"| {r['config']} | {f(r.get('budget'), 'g')} | {r.get('targets', '')} | "
            f"{f(r['mean_rel@1'])} | {f(r['min_rel@1'])} | {f(r.get('shortlist_best'))} | "
            f"{f(r['compute'])} | {f(r.get('mean_wtau'))} | {f(r.get('wtau_vs_ceiling'))} |"
        )
    lines += ["", "## Per target", ""]
    lines.append(
        "| target | classes | train | truth range | metric top-1 rel@1 | races (k, budget: rel@1) |"
    )
    lines.append("|---|---|---|---|---|---|")
    for t, r in doc["targets"].items():
        races = "; ".join(
            f"{x['k']}, {x['budget']:g}: {x['rel@1']:.3f}" for x in r["races"] if "error" not in x
        )
        lo, hi = r["truth_spread"]
        lines.append(
            f"| {t} | {r['classes']} | {r['train']} | {lo:.2f}-{hi:.2f} | "
            f"{r['metric_only']['rel@1']:.3f} | {races} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
