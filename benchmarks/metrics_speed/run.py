"""How long does scoring one model take, next to running the model over the dataset?

Times every registered transferability metric on synthetic inputs of realistic size (default:
n=10,000 target images, C_t=100 classes, C_s=1,000 source outputs, D=2,048 features), and sets
each against the forward pass that produces those inputs: a ResNet-50-size timm model at
224x224, timed on a few batches on this machine and extrapolated to n images. Also times the
naive SMS of the reference algorithm (one scipy ``multivariate_normal`` per class per pair) on a
subset of pairs, extrapolated linearly to all pairs, as the baseline for our SMS.

Also times every candidate of the transfer suite (``benchmarks/transfer/suite.py``) that is not
a registered metric at its defaults: the option variants (``run.VARIANTS``, e.g. ``fsms@whiten``)
and the rank ensembles (``suite.ENSEMBLES``), an ensemble costing the sum of its members (they
read the same forward pass; combining ranks is negligible). The suite's own cost column is a
share of its small models' forward passes (32-64 px), which are cheap next to a ResNet-50's at
224 px, so the goal "under 5% of the forward pass" is judged here, at the size a user runs.

Goals (each reported met / not met): every metric and candidate < 5% of the forward pass;
I-SMS >= 20x faster than SMS at C_s=1,000; SMS >= 50x faster than the naive per-pair form.

    python benchmarks/metrics_speed/run.py                      # full size, several minutes
    python benchmarks/metrics_speed/run.py --n 500 --classes 10 --source-classes 50 \
        --dim 64 --forward-images 8                             # quick check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import warnings
from itertools import combinations
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # zoopick and benchmarks.transfer

import zoopick.selection as selection  # noqa: E402
from zoopick.selection.metrics import sms as sms_module  # noqa: E402

FORWARD_GOAL = 0.05
ISMS_GOAL = 20.0
NAIVE_GOAL = 50.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=10_000, help="target samples")
    p.add_argument("--classes", type=int, default=100, help="target classes C_t")
    p.add_argument("--source-classes", type=int, default=1000, help="model outputs C_s")
    p.add_argument("--dim", type=int, default=2048, help="feature dimension D")
    p.add_argument("--forward-model", default="resnet50", help="timm architecture to time")
    p.add_argument("--forward-images", type=int, default=64, help="images to time it on")
    p.add_argument("--forward-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="best of this many for fast metrics")
    p.add_argument("--fast-below", type=float, default=5.0, help="seconds: repeat if faster")
    p.add_argument("--naive-pairs", type=int, default=8, help="class pairs to time naive SMS on")
    p.add_argument("--metrics", default="", help="comma list; default: every registered one")
    p.add_argument(
        "--no-suite-candidates",
        action="store_true",
        help="skip the transfer suite's option variants and rank ensembles",
    )
    p.add_argument("--separation", type=float, default=8.0, help="class-mean spread (noise=1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return p.parse_args(argv)


# ---------------------------------------------------------------- synthetic inputs


def make_inputs(
    n: int, classes: int, source_classes: int, dim: int, seed: int, separation: float = 8.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels, penultimate features and logits with class structure, like a real model's.

    Features: per-class mean + unit isotropic noise, passed through a ReLU (real penultimate
    features are non-negative); class means ~``separation * sqrt(2)`` noise units apart, so
    classes are separated but overlap, as on real data (far apart, some metrics saturate and
    iterative ones converge unrealistically fast). Logits: a random linear head on the
    features, scaled to a typical logit spread.
    """
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % classes)
    centres = rng.standard_normal((classes, dim)) * (separation / math.sqrt(dim))
    features = np.maximum(centres[labels] + rng.standard_normal((n, dim)), 0.0)
    head = rng.standard_normal((dim, source_classes)) / math.sqrt(dim)
    logits = features @ head
    logits = 3.0 * (logits - logits.mean()) / logits.std() + rng.standard_normal(source_classes)
    return labels, features, logits


def suite_candidates() -> tuple[dict[str, tuple[str, dict]], dict[str, tuple[str, ...]]]:
    """The transfer suite's candidates beyond the registered metrics: option variants
    (name -> (metric, options)) and rank ensembles (name -> members)."""
    from benchmarks.transfer.run import VARIANTS
    from benchmarks.transfer.suite import ENSEMBLES

    return dict(VARIANTS), dict(ENSEMBLES)


# ---------------------------------------------------------------- timing


def time_call(fn, repeats: int, fast_below: float) -> tuple[float, int, object]:
    """Best wall time of ``fn()``: one run, and up to ``repeats`` if it is fast."""
    best, runs, value = math.inf, 0, None
    while runs < max(1, repeats):
        t0 = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
        if best >= fast_below:
            break
    return best, runs, value


def time_forward(model_name: str, images: int, batch: int) -> dict:
    """Images/s of ``model_name`` (random weights) at 224x224 on this machine's CPU."""
    import timm
    import torch

    model = timm.create_model(model_name, pretrained=False).eval()
    batch = max(1, min(batch, images))
    x = torch.randn(batch, 3, 224, 224)
    n_batches = max(1, math.ceil(images / batch))
    with torch.inference_mode():
        model(x)  # warm-up: allocations, kernel selection
        t0 = time.perf_counter()
        for _ in range(n_batches):
            model(x)
        seconds = time.perf_counter() - t0
    return {
        "model": model_name,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "batch": batch,
        "images_timed": n_batches * batch,
        "seconds_timed": seconds,
        "images_per_s": n_batches * batch / seconds,
    }


def naive_sms_pairs(
    labels: np.ndarray, logits: np.ndarray, pairs: list[tuple[int, int]], temperature: float = 2.0
) -> tuple[float, float, dict[tuple[int, int], float]]:
    """The reference algorithm's per-pair SMS: a fresh scipy Gaussian (an eigendecomposition
    of a C_s x C_s covariance) for each class of each pair. Log densities rather than
    densities, else at C_s=1000 they overflow and every pair reads nan; the cost is the same.

    Returns (seconds for the class statistics, seconds for the given pairs, and per pair the
    two log-odds ``log a - log b`` whose sigmoids make S_ij; compared rather than S_ij, which
    is exactly 1.0 for every pair once SMS saturates).
    """
    from scipy.stats import multivariate_normal

    t0 = time.perf_counter()
    e = np.exp(logits / temperature - (logits / temperature).max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    stats = {}
    for c in np.unique(labels):
        xc = p[labels == c]
        mu = xc.mean(axis=0)
        stats[c] = (mu, (xc - mu).T @ (xc - mu) / len(xc) + 1e-6 * np.eye(p.shape[1]))
    t_stats = time.perf_counter() - t0

    out = {}
    t0 = time.perf_counter()
    for i, j in pairs:
        gi, gj = multivariate_normal(*stats[i]), multivariate_normal(*stats[j])
        mi, mj = stats[i][0], stats[j][0]
        odds_i = gi.logpdf(mi) - gj.logpdf(mi)  # log a_i - log b_i
        odds_j = gj.logpdf(mj) - gi.logpdf(mj)
        out[(i, j)] = (odds_i, odds_j)
    return t_stats, time.perf_counter() - t0, out


def fast_sms_pairs(labels: np.ndarray, logits: np.ndarray, temperature: float = 2.0):
    """Per-pair log-odds from our implementation's table, to check the naive baseline against."""
    p = sms_module._soft_labels(logits, temperature)
    classes, groups = sms_module._class_groups(labels, min_size=2, metric="sms")
    table = sms_module._log_density_table(p, classes, groups, sms_module.SMS_RIDGE)
    odds = np.diag(table)[:, None] - table  # odds[i, j] = log a_i - log b_i within pair (i, j)
    index = {c: k for k, c in enumerate(classes.tolist())}
    return lambda i, j: (odds[index[i], index[j]], odds[index[j], index[i]])


# ---------------------------------------------------------------- report


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if x is None else format(scale * x, spec)


def write_markdown(path: Path, res: dict) -> None:
    cfg, fwd, g = res["config"], res["forward"], res["goals"]
    lines = [
        "# Metric speed vs. forward pass",
        "",
        f"Synthetic inputs: n={cfg['n']:,}, C_t={cfg['classes']}, C_s={cfg['source_classes']:,}, "
        f"D={cfg['dim']:,} (seed {cfg['seed']}). Machine: {res['machine']['cpu_count']} CPU "
        f"cores, {res['machine']['platform']}. Each metric: best of up to {cfg['repeats']} runs "
        f"when faster than {cfg['fast_below']} s, else one run.",
        "",
        f"Forward pass: `{fwd['model']}` ({fwd['params_m']} M params, random weights), 224x224, "
        f"CPU, {fwd['torch_threads']} torch threads, batch {fwd['batch']}, timed on "
        f"{fwd['images_timed']} images: **{fwd['images_per_s']:.2f} images/s**, extrapolated to "
        f"n={cfg['n']:,} images: **{fwd['extrapolated_s']:.1f} s**.",
        "",
        "Every registered metric at its defaults, then the transfer suite's other candidates: "
        "option variants, and rank ensembles (the sum of their members' times: they read the "
        "same forward pass).",
        "",
        "| metric | needs | seconds | runs | % of forward pass | < 5% |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name, m in res["metrics"].items():
        if "error" in m:
            lines.append(f"| {name} | {m['needs']} | failed: {m['error']} | | | NOT met |")
            continue
        label = name
        if "variant_of" in m:
            opts = ", ".join(f"{k}={v}" for k, v in m["variant_of"]["options"].items())
            label = f"{name} (`{m['variant_of']['metric']}`, {opts})"
        elif "members" in m:
            label = f"{name} (sum of its members)"
        lines.append(
            f"| {label} | {m['needs']} | {m['seconds']:.3f} | {m['runs']} | "
            f"{100 * m['ratio_to_forward']:.3f}% | {verdict(m['under_goal'])} |"
        )
    nv = res["naive_sms"]
    lines += [
        "",
        f"Naive SMS (reference algorithm, one scipy `multivariate_normal` per class per pair): "
        f"{nv['pairs_timed']} of {nv['pairs_total']:,} pairs timed"
        + (
            f" and extrapolated linearly in the number of pairs: {nv['seconds_per_pair']:.3f} s"
            " per pair"
            if nv["extrapolated"]
            else " (all of them)"
        )
        + f", plus {nv['seconds_class_stats']:.2f} s of class statistics: "
        f"**{nv['seconds_total']:.1f} s**. On the timed pairs its log-odds (log a - log b, "
        f"before the sigmoid) agree with ours to a relative "
        f"{nv['max_rel_diff_log_odds_vs_fast']:.1e}.",
        "",
        "| goal | value | target | status |",
        "|---|---:|---:|---|",
        f"| every metric and suite candidate < 5% of the forward pass | "
        f"worst {g['worst_ratio_metric']}: "
        f"{fmt(g['worst_ratio'], '.2f', 100)}% | < 5% | {verdict(g['all_under_forward_goal'])} |",
        f"| I-SMS speed-up over SMS (C_s={cfg['source_classes']:,}) | "
        f"{fmt(g['isms_speedup_over_sms'], '.1f')}x | >= {ISMS_GOAL:.0f}x | "
        f"{verdict(g['isms_goal_met'])} |",
        f"| SMS speed-up over naive SMS | {fmt(g['sms_speedup_over_naive'], '.1f')}x | "
        f">= {NAIVE_GOAL:.0f}x | {verdict(g['naive_goal_met'])} |",
        "",
        "Absolute seconds depend on the machine and its load (the cores may be shared); the "
        "ratios are measured in the same run. Load average (1, 5, 15 min) before: "
        + ", ".join(f"{v:.1f}" for v in res["machine"].get("load_average_before", ()))
        + "; after: "
        + ", ".join(f"{v:.1f}" for v in res["machine"].get("load_average_after", ()))
        + ".",
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    names = [s for s in args.metrics.split(",") if s] or selection.available()
    print(f"generating inputs n={args.n} C_t={args.classes} C_s={args.source_classes} D={args.dim}")
    labels, features, logits = make_inputs(
        args.n, args.classes, args.source_classes, args.dim, args.seed, args.separation
    )
    inputs = {"logits": logits, "features": features}
    variants, ensembles = ({}, {}) if args.no_suite_candidates else suite_candidates()

    metrics: dict[str, dict] = {}
    timed = [(name, name, {}) for name in names]
    timed += [(v, base, opts) for v, (base, opts) in variants.items() if base in names]
    for name, base, opts in timed:
        needs = sorted(selection.needs(base))
        kw = {k: inputs[k] for k in needs}
        entry: dict = {"needs": "+".join(needs)}
        if opts:
            entry["variant_of"] = {"metric": base, "options": opts}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                secs, runs, value = time_call(
                    lambda kw=kw, base=base, opts=opts: selection.score(
                        base, labels=labels, **kw, **opts
                    ),
                    args.repeats,
                    args.fast_below,
                )
        except Exception as e:  # a broken metric is reported, not fatal to the benchmark
            entry["error"] = f"{type(e).__name__}: {e}"[:200]
            print(f"  {name:16s} FAILED {entry['error']}")
        else:
            entry |= {"seconds": secs, "runs": runs, "score": value}
            print(f"  {name:16s} {secs:9.3f} s  score={value:.4g}")
        metrics[name] = entry
    for ens, members in ensembles.items():
        parts = [metrics.get(m, {}) for m in members]
        if all("seconds" in m for m in parts):
            metrics[ens] = {
                "needs": "+".join(sorted({n for m in parts for n in m["needs"].split("+")})),
                "members": list(members),
                "seconds": sum(m["seconds"] for m in parts),
                "runs": min(m["runs"] for m in parts),
            }

    # naive SMS baseline on a random subset of pairs, extrapolated linearly
    classes = np.unique(labels).tolist()
    all_pairs = list(combinations(classes, 2))
    rng = np.random.default_rng(args.seed)
    k = min(max(1, args.naive_pairs), len(all_pairs))
    pairs = [all_pairs[i] for i in sorted(rng.choice(len(all_pairs), size=k, replace=False))]
    print(f"timing naive SMS on {k} of {len(all_pairs)} pairs")
    t_stats, t_pairs, naive_vals = naive_sms_pairs(labels, logits, pairs)
    fast = fast_sms_pairs(labels, logits)
    per_pair = t_pairs / k
    naive = {
        "pairs_total": len(all_pairs),
        "pairs_timed": k,
        "extrapolated": k < len(all_pairs),
        "seconds_class_stats": t_stats,
        "seconds_pairs_timed": t_pairs,
        "seconds_per_pair": per_pair,
        "seconds_total": t_stats + per_pair * len(all_pairs),
        "max_rel_diff_log_odds_vs_fast": max(
            float(np.max(np.abs(np.subtract(v, fast(i, j))) / np.maximum(np.abs(v), 1.0)))
            for (i, j), v in naive_vals.items()
        ),
    }
    print(f"  naive SMS: {per_pair:.3f} s/pair -> {naive['seconds_total']:.1f} s total")

    # The forward pass runs last: torch's OpenMP workers keep spinning after a call and would
    # slow every BLAS call timed after it on a small machine.
    print(f"timing forward pass of {args.forward_model} on {args.forward_images} images")
    fwd = time_forward(args.forward_model, args.forward_images, args.forward_batch)
    fwd["extrapolated_s"] = args.n / fwd["images_per_s"]
    print(f"  {fwd['images_per_s']:.2f} images/s -> {fwd['extrapolated_s']:.1f} s for n={args.n}")
    for name, m in metrics.items():
        if "seconds" in m:
            m["ratio_to_forward"] = m["seconds"] / fwd["extrapolated_s"]
            m["under_goal"] = m["ratio_to_forward"] < FORWARD_GOAL
            print(f"  {name:16s} {100 * m['ratio_to_forward']:8.3f}% of the forward pass")

    def secs(name: str) -> float | None:
        return metrics.get(name, {}).get("seconds")

    ok = [(m["ratio_to_forward"], n) for n, m in metrics.items() if "seconds" in m]
    worst = max(ok) if ok else (math.nan, "none")
    t_sms, t_isms = secs("sms"), secs("isms")
    isms_x = t_sms / t_isms if t_sms and t_isms else math.nan
    naive_x = naive["seconds_total"] / t_sms if t_sms else math.nan
    goals = {
        "worst_ratio": None if math.isnan(worst[0]) else worst[0],
        "worst_ratio_metric": worst[1],
        "all_under_forward_goal": bool(ok)
        and len(ok) == len(metrics)
        and all(r < FORWARD_GOAL for r, _ in ok),
        "isms_speedup_over_sms": None if math.isnan(isms_x) else isms_x,
        "isms_goal_met": None if math.isnan(isms_x) else isms_x >= ISMS_GOAL,
        "sms_speedup_over_naive": None if math.isnan(naive_x) else naive_x,
        "naive_goal_met": None if math.isnan(naive_x) else naive_x >= NAIVE_GOAL,
    }
    res = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "forward": fwd,
        "metrics": metrics,
        "naive_sms": naive,
        "goals": goals,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics_speed.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(args.out / "metrics_speed.md", res)
    print(f"wrote {args.out / 'metrics_speed.json'} and {args.out / 'metrics_speed.md'}")
    for key in ("all_under_forward_goal", "isms_goal_met", "naive_goal_met"):
        print(f"  {key}: {verdict(goals[key])}")
    return res


if __name__ == "__main__":
    main()
