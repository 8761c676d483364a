"""Score the transfer benchmark: rank the zoo on every target with every metric and judge each
ranking against the fine-tuned ground truth.

For each target the zoo is ranked on the target's *train* split (what a user would have) with
``zoopick.selection.rank.rank_zoo``; each metric's scores are compared with the ground-truth
accuracies
(``ground_truth.py``) by ``zoopick.selection.rank.evaluate``: weighted Kendall tau (the LogME/SFDA
headline number), Kendall tau, Pearson, rel@1 and rel@3 (best accuracy among the top-k picks
over the best overall). A "random pick" row gives the chance level of rel@k. Metric cost is
reported as a ratio to the forward pass measured in the same run.

Writes ``benchmarks/results/transfer.json`` and ``benchmarks/results/transfer.md``.

    python benchmarks/transfer/run.py
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

EVAL_KEYS = ("weighted_tau", "kendall_tau", "pearson", "rel@1", "rel@3")
HEAD = {"weighted_tau": "w-tau", "kendall_tau": "tau", "pearson": "pearson"}
RECOMMENDED = "fsms"  # the SMS-family metric this benchmark checks against every other
FOCUS = (RECOMMENDED, "fsms@whiten", "sms+", "sms", "isms")
# Reported forms of a metric with options: name -> (registered metric, options). The faithful
# H-score and SFDA tie when D >= n; their PCA form (a common dimension, fixed at 64 as GBC's)
# is reported beside them.
VARIANTS: dict[str, tuple[str, dict]] = {
    "hscore@pca64": ("hscore", {"pca_dim": 64}),
    "sfda@pca64": ("sfda", {"pca_dim": 64}),
    "transrate@noproj": ("transrate", {"project": False}),
    "fsms@whiten": ("fsms", {"whiten": True}),  # issue 11's first-round form
}


def random_rel_at_k(truth: dict[str, float], k: int) -> float:
    """Expected rel@k of k models picked uniformly at random (without replacement): the
    i-th smallest accuracy is the best pick with probability C(i-1, k-1) / C(n, k)."""
    accs = sorted(truth.values())
    n, best = len(accs), max(accs)
    k = min(k, n)
    return sum(a * math.comb(i, k - 1) for i, a in enumerate(accs)) / math.comb(n, k) / best


def _mean(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return statistics.fmean(vals) if vals else float("nan")


def evaluate_target(ranking, truth: dict[str, float], metrics: list[str]) -> dict:
    from zoopick.selection.rank import evaluate

    forward = sum(m.seconds.get("forward", 0.0) for m in ranking.models)
    out: dict = {
        "forward_seconds": forward,
        "forward_cached": any(getattr(m, "cached", False) for m in ranking.models),
        "metrics": {},
    }
    for name in metrics:
        scores = {m.id: float(m.scores[name]) for m in ranking.models}
        ev = evaluate(scores, truth)
        seconds = sum(m.seconds.get(name, 0.0) for m in ranking.models)
        best = ranking.best(name)
        out["metrics"][name] = {
            **ev,
            "seconds": seconds,
            "top": best,
            "top_acc": min(truth[i] for i in best),
            "scores": scores,
        }
    out["random"] = {"rel@1": random_rel_at_k(truth, 1), "rel@3": random_rel_at_k(truth, 3)}
    return out


def seed_accuracies(rec: dict) -> list[float]:
    """One model's accuracy per fine-tuning seed, at its best learning rate (``best_lr`` where
    the ground truth names it: extra seeds run there only; else the best of the means)."""
    return rec["by_seed"][rec.get("best_lr") or max(rec["by_lr"], key=rec["by_lr"].get)]


def seed_agreement(truth_target: dict[str, dict]) -> dict | None:
    """How well one fine-tuning seed's accuracies rank the models against the others': the
    ceiling any metric can reach against a ground truth that is itself noisy. For every seed s,
    the accuracies of seed s (at each model's best learning rate of the mean) are judged by
    ``evaluate`` against the mean of the *other* seeds; the means over s are reported, plus the
    mean pairwise weighted tau between two single seeds."""
    from zoopick.selection.rank import evaluate

    ids = list(truth_target)
    if any("by_seed" not in truth_target[i] for i in ids):
        return None
    n_seeds = min(len(seed_accuracies(truth_target[i])) for i in ids)
    if n_seeds < 2:
        return None
    acc = np.array([seed_accuracies(truth_target[i])[:n_seeds] for i in ids])  # (models, seeds)
    rows = []
    for sd in range(n_seeds):
        others = np.delete(acc, sd, axis=1).mean(axis=1)
        rows.append(
            evaluate(dict(zip(ids, acc[:, sd], strict=True)), dict(zip(ids, others, strict=True)))
        )
    pair = [
        evaluate(dict(zip(ids, acc[:, a], strict=True)), dict(zip(ids, acc[:, b], strict=True)))[
            "weighted_tau"
        ]
        for a in range(n_seeds)
        for b in range(a + 1, n_seeds)
    ]
    out = {k: _mean([r[k] for r in rows]) for k in EVAL_KEYS}
    out["pairwise_weighted_tau"] = _mean(pair)
    out["seeds"] = n_seeds
    out["seed_std_mean"] = float(acc.std(axis=1).mean())
    return out


def input_checks(zoo, dataset, cache_dir) -> dict[str, dict]:
    """Degenerate-input check per model: feature size, share of (near-)constant feature
    columns, head size, n. Reads the forward cache (no new forward pass when cached)."""
    from zoopick.selection.extract import extract

    out = {}
    for entry in zoo:
        res = extract(entry, dataset, cache_dir=cache_dir)
        f = np.asarray(res.features, dtype=np.float64)
        var = f.var(axis=0)
        top = var.max() if var.size else 0.0
        out[entry.id] = {
            "n": int(f.shape[0]),
            "feature_dim": int(f.shape[1]),
            "head": int(np.asarray(res.logits).shape[1]),
            "constant_fraction": float(np.mean(var <= 1e-8 * top)) if top > 0 else 1.0,
        }
    return out


def score_target(
    zoo,
    dataset,
    truth: dict[str, float],
    base_metrics: list[str],
    variants: dict[str, tuple[str, dict]],
    *,
    cache_dir: str | None,
    batch_size: int = 64,
    metric_options: dict | None = None,
    device: str | None = None,
) -> dict:
    """Rank ``zoo`` on ``dataset`` by every metric of ``base_metrics`` and every variant of
    one of them, and judge each ranking against ``truth`` (see :func:`evaluate_target`); the
    degenerate-input check rides along when forward passes are cached."""
    from zoopick.selection.rank import rank_zoo

    t0 = time.perf_counter()
    ranking = rank_zoo(
        zoo,
        dataset,
        base_metrics,
        cache_dir=cache_dir,
        batch_size=batch_size,
        device=device,
        metric_options=metric_options or {},
    )
    if ranking.errors:  # a benchmark judges the whole zoo or nothing
        raise SystemExit(f"{dataset.name}: models left out: {ranking.errors}")
    metrics = list(base_metrics)
    for vname, (base, opts) in variants.items():
        if base not in base_metrics:
            continue
        extra = rank_zoo(
            zoo, dataset, [base], cache_dir=cache_dir, device=device, metric_options={base: opts}
        )
        if extra.errors:
            raise SystemExit(f"{dataset.name}: {vname} left models out: {extra.errors}")
        for m, e in zip(ranking.models, extra.models, strict=True):
            m.scores[vname] = e.scores[base]
            m.seconds[vname] = e.seconds[base]
        metrics.append(vname)
    ranking.metrics = metrics
    out = evaluate_target(ranking, truth, metrics)
    out["rank_seconds"] = time.perf_counter() - t0
    if cache_dir is not None:
        out["inputs"] = input_checks(zoo, dataset, cache_dir)
    return out


def summarise(per_target: dict[str, dict], metrics: list[str]) -> dict:
    avg: dict = {}
    for name in metrics:
        rows = [per_target[t]["metrics"][name] for t in per_target]
        avg[name] = {k: _mean([r[k] for r in rows]) for k in EVAL_KEYS}
        avg[name]["seconds"] = sum(r["seconds"] for r in rows)
    forward = sum(per_target[t]["forward_seconds"] for t in per_target)
    for name in metrics:
        avg[name]["seconds_vs_forward"] = avg[name]["seconds"] / forward if forward else None
    avg["random"] = {
        k: _mean([per_target[t]["random"][k] for t in per_target]) for k in ("rel@1", "rel@3")
    }
    return avg


def _fmt(v: float | None, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}f}"


def _metric_table(rows: dict[str, dict], extra: list[tuple[str, str]], order: list[str]) -> str:
    head = ["metric"] + [HEAD.get(k, k) for k in EVAL_KEYS] + [h for h, _ in extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in order:
        r = rows[name]
        cells = [f"`{name}`"] + [_fmt(r[k]) for k in EVAL_KEYS]
        for _, key in extra:
            v = r.get(key)
            cells.append(v if isinstance(v, str) else _fmt(v, 2))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def conclusions(avg: dict, per_target: dict[str, dict], metrics: list[str]) -> str:
    """A short paragraph generated from the numbers, so it stays true on a rebuild."""
    by_wtau = sorted(metrics, key=lambda m: -avg[m]["weighted_tau"])
    by_rel1 = sorted(metrics, key=lambda m: -avg[m]["rel@1"])
    parts = [
        f"Across {len(per_target)} targets, the best mean weighted tau is `{by_wtau[0]}` "
        f"({avg[by_wtau[0]]['weighted_tau']:.3f}), then `{by_wtau[1]}` "
        f"({avg[by_wtau[1]]['weighted_tau']:.3f}) and `{by_wtau[2]}` "
        f"({avg[by_wtau[2]]['weighted_tau']:.3f}); the worst is `{by_wtau[-1]}` "
        f"({avg[by_wtau[-1]]['weighted_tau']:.3f}).",
        f"The best mean rel@1 is `{by_rel1[0]}` ({avg[by_rel1[0]]['rel@1']:.3f}) against "
        f"{avg['random']['rel@1']:.3f} for a random pick.",
    ]
    focus = [m for m in FOCUS if m in metrics]
    if RECOMMENDED in focus:
        rec = RECOMMENDED
        for other in [m for m in by_wtau if m != rec]:
            if other not in focus and other != by_wtau[0] and by_wtau.index(other) > 2:
                continue
            wins = sum(
                per_target[t]["metrics"][rec]["weighted_tau"]
                > per_target[t]["metrics"][other]["weighted_tau"]
                for t in per_target
            )
            d_w = avg[rec]["weighted_tau"] - avg[other]["weighted_tau"]
            parts.append(
                f"`{rec}` vs `{other}`: mean weighted tau {avg[rec]['weighted_tau']:.3f} vs "
                f"{avg[other]['weighted_tau']:.3f} ({d_w:+.3f}), higher on {wins} of "
                f"{len(per_target)} targets; mean rel@1 {avg[rec]['rel@1']:.3f} vs "
                f"{avg[other]['rel@1']:.3f}."
            )
        rank = by_wtau.index(rec) + 1
        parts.append(f"`{rec}` ranks {rank} of {len(metrics)} metrics by mean weighted tau.")
    ceiling = avg.get("seed_ceiling")
    if ceiling:
        parts.append(
            f"Seed-to-seed ceiling: one fine-tuning seed ranks the models against the mean of "
            f"the others with weighted tau {ceiling['weighted_tau']:.3f} and rel@1 "
            f"{ceiling['rel@1']:.3f} (mean over seeds and targets)."
        )
    return " ".join(parts)


def _pick(top: list[str]) -> str:
    return top[0] if len(top) == 1 else f"{top[0]} (+{len(top) - 1} tied)"


def robustness(per_target: dict[str, dict], truth_all: dict, metrics: list[str]) -> dict:
    """How firm the order of the metrics is. ``by_seed``: each metric's mean weighted tau over
    the targets when one fine-tuning seed alone is the ground truth (at each model's best
    learning rate of the mean), one value per seed. ``leave_one_out``: for each target, the
    metrics ranked by mean weighted tau over the other targets (the best three kept)."""
    from zoopick.selection.rank import evaluate

    targets = list(per_target)
    seeds = {
        t: {mid: seed_accuracies(rec) for mid, rec in truth_all[t].items() if "by_seed" in rec}
        for t in targets
    }
    n_seeds = min((len(a) for t in targets for a in seeds[t].values()), default=0)
    by_seed: dict[str, list[float]] = {m: [] for m in metrics}
    for sd in range(n_seeds if n_seeds > 1 else 0):
        truth = {t: {mid: a[sd] for mid, a in seeds[t].items()} for t in targets}
        for m in metrics:
            taus = [
                evaluate(per_target[t]["metrics"][m]["scores"], truth[t])["weighted_tau"]
                for t in targets
            ]
            by_seed[m].append(_mean(taus))
    leave_one_out = {}
    if len(targets) > 2:
        for out in targets:
            rest = [t for t in targets if t != out]
            mean_of = {
                m: _mean([per_target[t]["metrics"][m]["weighted_tau"] for t in rest])
                for m in metrics
            }
            leave_one_out[out] = sorted(metrics, key=lambda m: -mean_of[m])[:3]
    return {"by_seed": by_seed if n_seeds > 1 else {}, "leave_one_out": leave_one_out}


def write_markdown(path: Path, result: dict) -> None:
    per_target, avg, metrics = result["targets"], result["average"], result["metrics"]
    gt = result["ground_truth_summary"]
    order = sorted(metrics, key=lambda m: -avg[m]["weighted_tau"])
    md = [
        "# Transfer benchmark: ranking a seeded timm zoo without training",
        "",
        f"{result['zoo_size']} models (small timm architectures pretrained here on "
        "Fashion-MNIST classes 0-5, procedural shapes or gratings, 100-class gratings, 1,000 "
        "Fashion-MNIST pixel clusters, or random init; source heads of 4 to 1,000 outputs, "
        "features of 64 to 1,280 dimensions) ranked on "
        f"{len(per_target)} targets. Ground truth: {result['protocol']}. Rebuild: see "
        "`benchmarks/transfer/README.md`.",
        "",
        "## Ground truth",
        "",
        "| target | classes | train | test | min acc | median | max acc | best model |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t, g in gt.items():
        md.append(
            f"| {t} | {g['classes']} | {g['train']} | {g['test']} | {g['min']:.3f} | "
            f"{g['median']:.3f} | {g['max']:.3f} | {g['best']} |"
        )
    md += [
        "",
        "## Average over targets",
        "",
        "Sorted by mean weighted tau. `seconds` is the metric's total time over all targets, "
        "`cost` that time as a ratio to the forward passes of the same run"
        + (" (forward features were cached)." if result["forward_cached"] else "."),
        "",
        _metric_table(avg, [("seconds", "seconds"), ("cost", "seconds_vs_forward")], order),
        f"| random pick | 0 (exp.) | 0 (exp.) | 0 (exp.) | {avg['random']['rel@1']:.3f} | "
        f"{avg['random']['rel@3']:.3f} | | |",
        "",
        "## Conclusions",
        "",
        result["conclusions"],
        "",
    ]
    ceiling = {t: r.get("seed_ceiling") for t, r in per_target.items() if r.get("seed_ceiling")}
    if ceiling:
        md += [
            "## Seed-to-seed ceiling",
            "",
            "Each fine-tuning seed's accuracies ranked against the mean of the other seeds "
            "(what a perfect predictor of one seed would score): the ceiling for any metric.",
            "",
            "| target | seeds | w-tau | tau | rel@1 | rel@3 | seed-vs-seed w-tau | "
            "mean seed std of acc |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for t, c in ceiling.items():
            md.append(
                f"| {t} | {c['seeds']} | {c['weighted_tau']:.3f} | {c['kendall_tau']:.3f} | "
                f"{c['rel@1']:.3f} | {c['rel@3']:.3f} | {c['pairwise_weighted_tau']:.3f} | "
                f"{c['seed_std_mean']:.4f} |"
            )
        md.append("")
    firm = result.get("robustness") or {}
    if firm.get("by_seed") or firm.get("leave_one_out"):
        md += ["## How firm the order is", ""]
    if firm.get("by_seed"):
        seeds = len(next(iter(firm["by_seed"].values())))
        md += [
            "Mean weighted tau over the targets with one fine-tuning seed alone as the ground "
            "truth (the eight best metrics of the table above).",
            "",
            "| metric | " + " | ".join(f"seed {s}" for s in range(seeds)) + " |",
            "|---|" + "---|" * seeds,
        ]
        for m in order[:8]:
            md.append(f"| `{m}` | " + " | ".join(f"{v:.3f}" for v in firm["by_seed"][m]) + " |")
        md.append("")
    if firm.get("leave_one_out"):
        md += [
            "Leave one target out: the three best metrics by mean weighted tau over the others.",
            "",
            "| target left out | first | second | third |",
            "|---|---|---|---|",
        ]
        for t, top in firm["leave_one_out"].items():
            md.append(f"| {t} | " + " | ".join(f"`{m}`" for m in top) + " |")
        md.append("")
    checks = {t: r.get("inputs") for t, r in per_target.items() if r.get("inputs")}
    if checks:
        first = next(iter(checks.values()))
        md += [
            "## Inputs (degenerate-input check)",
            "",
            "Per model: feature size, source head size, and the largest share of (near-)"
            "constant feature columns over the targets (variance <= 1e-8 of the largest).",
            "",
            "| model | features | head | max constant share |",
            "|---|---|---|---|",
        ]
        for mid, info in first.items():
            share = max(checks[t][mid]["constant_fraction"] for t in checks)
            md.append(f"| {mid} | {info['feature_dim']} | {info['head']} | {share:.2f} |")
        md.append("")
    for t, r in per_target.items():
        rows = {m: {**r["metrics"][m], "pick": _pick(r["metrics"][m]["top"])} for m in metrics}
        md += [
            f"## {t}",
            "",
            f"Best by ground truth: {gt[t]['best']} ({gt[t]['max']:.3f}); random pick rel@1 "
            f"{r['random']['rel@1']:.3f}, rel@3 {r['random']['rel@3']:.3f}.",
            "",
            _metric_table(rows, [("seconds", "seconds"), ("top pick", "pick")], order),
            "",
        ]
    path.write_text("\n".join(md))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default="benchmarks/transfer/zoo")
    ap.add_argument("--ground-truth", help="default: <zoo>/ground_truth.json")
    ap.add_argument("--metrics", nargs="*", help="default: every registered metric")
    ap.add_argument("--targets", nargs="*", help="default: every target in the ground truth")
    ap.add_argument("--cache-dir", default="benchmarks/transfer/cache")
    ap.add_argument("--no-cache", action="store_true", help="always run the forward passes")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--metric-options", default="{}", help='JSON, e.g. {"knn": {"k": 5}}')
    ap.add_argument(
        "--no-variants", action="store_true", help="skip the PCA / unprojected forms (VARIANTS)"
    )
    ap.add_argument("--json", default="benchmarks/results/transfer.json")
    ap.add_argument("--md", default="benchmarks/results/transfer.md")
    args = ap.parse_args(argv)

    import torch

    from zoopick.selection.data import load_dataset
    from zoopick.selection.metrics import available
    from zoopick.selection.zoo import load_zoo

    torch.set_num_threads(args.threads)
    root = Path(args.zoo)
    truth_all = json.loads(Path(args.ground_truth or root / "ground_truth.json").read_text())
    targets = args.targets or list(truth_all)
    base_metrics = args.metrics or available()
    variants = {} if args.no_variants else VARIANTS
    metrics = base_metrics + [v for v, (b, _) in variants.items() if b in base_metrics]
    zoo = load_zoo(root / "zoo.json")
    ids = [e.id for e in zoo]
    meta_path = root / "ground_truth_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    build = json.loads((root / "build.json").read_text()) if (root / "build.json").exists() else {}

    per_target: dict[str, dict] = {}
    gt_summary: dict[str, dict] = {}
    started = time.perf_counter()
    for target in targets:
        truth = {i: truth_all[target][i]["acc"] for i in ids}
        dataset = load_dataset(root / "targets" / f"{target}-train.npz")
        cache = None if args.no_cache else args.cache_dir
        per_target[target] = score_target(
            zoo,
            dataset,
            truth,
            base_metrics,
            variants,
            cache_dir=cache,
            batch_size=args.batch_size,
            metric_options=json.loads(args.metric_options),
        )
        per_target[target]["seed_ceiling"] = seed_agreement(truth_all[target])
        accs = sorted(truth.values())
        info = build.get("targets", {}).get(target, {})
        gt_summary[target] = {
            "classes": info.get("classes", len(dataset.class_names)),
            "train": info.get("train", len(dataset)),
            "test": info.get("test", "?"),
            "min": accs[0],
            "median": statistics.median(accs),
            "max": accs[-1],
            "best": max(truth, key=truth.get),
        }
        line = "  ".join(
            f"{m} {per_target[target]['metrics'][m]['weighted_tau']:+.2f}" for m in metrics
        )
        print(f"{target}: w-tau {line}", flush=True)

    avg = summarise(per_target, metrics)
    ceilings = [per_target[t]["seed_ceiling"] for t in per_target if per_target[t]["seed_ceiling"]]
    if ceilings:
        avg["seed_ceiling"] = {
            k: _mean([c[k] for c in ceilings])
            for k in (*EVAL_KEYS, "pairwise_weighted_tau", "seed_std_mean")
        }
    protocol = (
        f"full fine-tuning, {meta.get('epochs', '?')} epochs, Adam, best test accuracy over "
        f"lr {meta.get('lrs', '?')}, {meta.get('seeds', '?')} seed(s)"
    )
    result = {
        "zoo_size": len(ids),
        "models": ids,
        "metrics": metrics,
        "protocol": protocol,
        "ground_truth_meta": meta,
        "ground_truth_summary": gt_summary,
        "forward_cached": any(per_target[t]["forward_cached"] for t in per_target),
        "seconds": time.perf_counter() - started,
        "average": avg,
        "targets": per_target,
    }
    result["conclusions"] = conclusions(avg, per_target, metrics)
    result["robustness"] = robustness(per_target, {t: truth_all[t] for t in per_target}, metrics)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(Path(args.md), result)
    print(result["conclusions"])


if __name__ == "__main__":
    main()
