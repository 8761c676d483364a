"""Does a transferability score rank models by how separable their features are, when the
target has only a few images a class? A simulation where the truth is known (issue 20).

Why: ``fsms``'s plug-in form (issues 11-19) subtracted a noise term computed from the same
estimated covariances that it divides by, which under-corrects with few samples a class; its
noise floor then grows as classes shrink, differently for each model's spectrum. The suite's
few-shot targets may not guide the fix (``benchmarks/transfer/PREREGISTRATION.md``), so it is
checked here, on data that share nothing with the suite, against the corrected form and
``logme`` on the same draws.

Recipe (every draw seeded from ``--seed``):

- A *zoo* is ``--models`` (12) simulated models of one family and one number of classes C. A
  model's features have a width D drawn from ``--widths`` (64 to 2,048), a power-law spectrum
  ``lambda_j = j^-alpha`` (alpha uniform in [0, 1.5]) and a random offset (features are not
  centred, as real ones are not). Its class signal sits in k (2 to 32) latent coordinates
  chosen among the first ``k * u`` directions (u in {1, 2, 4}: high- to mid-variance), the
  class means there ~ N(0, s^2 / k) in units of those directions' noise, s log-uniform in
  [0.5, 5]. Width, spectrum, offset and placement vary freely between models: a good score
  must see through them.
- Families: ``gauss`` (Gaussian noise), ``t3`` (multivariate t, 3 degrees of freedom, scaled
  to unit covariance: heavy tails, one scale shared by all coordinates of a sample),
  ``lowrank`` (Gaussian noise in the first r directions only, r uniform in [D/16, D/2] and at
  least k * u; the rest 1e-6 of the top variance).
- Truth: each model's Bayes accuracy, by Monte Carlo (``--test`` draws). For these families
  (one scatter shared by all classes, elliptical noise, equal priors) the nearest class mean
  in whitened coordinates is the Bayes rule, and a linear classifier attains it, so this is
  also the accuracy of a linear probe trained on unlimited data.
- Per zoo and per samples-a-class n_c in ``--per-class``, every model draws n_c samples of
  each class and every metric scores them; the measure is ``zoopick.selection.rank.evaluate``
  (weighted and plain Kendall tau, rel@1) against the truth. The same zoos serve every n_c
  (paired), and settings with more than ``--max-samples`` images are skipped (compute).
- Null: features with no class information (labels independent of N(0, diag(j^-alpha)),
  alpha 0 or 1, D 64 or 2,048) scored by both forms of ``fsms``; for the plug-in form, the
  mean squared pair distance q against the noise term it subtracts (which dominates).

Metrics: ``fsms`` (the corrected, default form), ``fsms@plugin`` (``splits=0``, the form
before the fix), ``logme``; ``--ablations`` adds ``fsms`` with 1 or 4 splits and with 32 or
16 dimensions.

    python benchmarks/metrics_fewshot/run.py                     # the full run (see --help)
    python benchmarks/metrics_fewshot/run.py --quick             # a minute: not a result
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

# Thousands of small eigen-decompositions and solves: one BLAS thread each is faster, and on a
# shared machine a multi-threaded BLAS spinning for its cores made them 50x slower.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zoopick.selection as selection  # noqa: E402
from zoopick.selection.metrics import sms as sms_module  # noqa: E402
from zoopick.selection.rank import evaluate  # noqa: E402

FAMILIES = ("gauss", "t3", "lowrank")
MEASURES = ("weighted_tau", "kendall_tau", "rel@1")
T_DOF = 3.0


@dataclass(frozen=True)
class Candidate:
    label: str
    metric: str
    options: dict


CANDIDATES = (
    Candidate("fsms", "fsms", {}),
    Candidate("fsms@plugin", "fsms", {"splits": 0}),
    Candidate("logme", "logme", {}),
)
ABLATIONS = (
    Candidate("fsms@splits1", "fsms", {"splits": 1}),
    Candidate("fsms@splits4", "fsms", {"splits": 4}),
    Candidate("fsms@dim32", "fsms", {"dim": 32}),
    Candidate("fsms@dim16", "fsms", {"dim": 16}),
)


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--classes", type=ints, default=[2, 10, 40, 100], help="C of each zoo")
    p.add_argument("--per-class", type=ints, default=[5, 10, 20, 50, 200], help="n_c")
    p.add_argument("--widths", type=ints, default=[64, 256, 1024, 2048], help="feature widths")
    p.add_argument("--models", type=int, default=12, help="models per zoo")
    p.add_argument("--reps", type=int, default=12, help="zoos per (family, C)")
    p.add_argument("--max-samples", type=int, default=4000, help="skip larger C * n_c")
    p.add_argument("--test", type=int, default=20_000, help="Monte Carlo draws for the truth")
    p.add_argument("--null-reps", type=int, default=8)
    p.add_argument("--ablations", action="store_true", help="also fsms at 1/4 splits, 32/16 dims")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="fsms_fewshot", help="results file stem")
    args = p.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; known: {FAMILIES}")
    if args.quick:
        args.classes, args.per_class, args.widths = [2, 10], [5, 20], [64, 256]
        args.models, args.reps, args.test, args.null_reps = 6, 2, 4000, 2
        args.name += "_quick"
    return args


# ---------------------------------------------------------------- simulated models


@dataclass(frozen=True)
class Model:
    """One simulated model: how its features of each class are drawn."""

    family: str
    spectrum: np.ndarray  # (D,) variance of each feature direction
    signal: np.ndarray  # (k,) the directions that carry the class means
    means: np.ndarray  # (C, k) class means there, in units of the noise's sd
    offset: np.ndarray  # (D,)


def draw_model(rng: np.random.Generator, family: str, classes: int, width: int) -> Model:
    spectrum = np.arange(1, width + 1, dtype=np.float64) ** -rng.uniform(0.0, 1.5)
    k = int(rng.integers(2, min(33, width)))
    span = min(width, k * int(rng.choice([1, 2, 4])))
    if family == "lowrank":
        rank = max(span, int(rng.integers(max(2, width // 16), max(3, width // 2) + 1)))
        spectrum[rank:] = 1e-6 * spectrum[0]
    signal = rng.choice(span, size=k, replace=False)
    strength = float(np.exp(rng.uniform(np.log(0.5), np.log(5.0))))
    means = rng.standard_normal((classes, k)) * strength / np.sqrt(k)
    offset = 2.0 * rng.standard_normal(width) * np.sqrt(spectrum)
    return Model(family, spectrum, signal, means, offset)


def noise(rng: np.random.Generator, n: int, d: int, family: str) -> np.ndarray:
    """Unit-covariance noise; ``t3`` shares one chi-square scale across a sample's coordinates
    (a multivariate t), so its marginals are t and the class densities stay elliptical."""
    z = rng.standard_normal((n, d))
    if family == "t3":
        w = rng.chisquare(T_DOF, size=n) / T_DOF
        z *= np.sqrt((T_DOF - 2.0) / T_DOF / w)[:, None]
    return z


def sample(rng: np.random.Generator, model: Model, per_class: int) -> tuple[np.ndarray, ...]:
    labels = np.repeat(np.arange(model.means.shape[0]), per_class)
    z = noise(rng, labels.size, model.spectrum.size, model.family)
    z[:, model.signal] += model.means[labels]
    return labels, z * np.sqrt(model.spectrum) + model.offset


def bayes_accuracy(rng: np.random.Generator, model: Model, draws: int) -> float:
    """Accuracy of the nearest class mean in whitened coordinates: the Bayes rule here. Only
    the signal coordinates matter (the rest are the same for every class)."""
    y = rng.integers(0, model.means.shape[0], draws)
    z = noise(rng, draws, model.means.shape[1], model.family) + model.means[y]
    d2 = -2.0 * z @ model.means.T + (model.means**2).sum(axis=1)
    return float(np.mean(d2.argmin(axis=1) == y))


# ---------------------------------------------------------------- ranking study


def score_all(cands, labels: np.ndarray, features: np.ndarray) -> dict[str, float]:
    out = {}
    for c in cands:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[c.label] = selection.score(c.metric, labels=labels, features=features, **c.options)
    return out


def ranking_study(args, cands, rng: np.random.Generator, log) -> list[dict]:
    """Per (family, C, zoo, n_c): the zoo's truth, every candidate's scores and measures."""
    rows = []
    for family in args.families:
        for classes in args.classes:
            sizes = [n for n in args.per_class if classes * n <= args.max_samples]
            for rep in range(args.reps):
                widths = rng.choice(args.widths, size=args.models)
                zoo = [draw_model(rng, family, classes, int(w)) for w in widths]
                truth = [bayes_accuracy(rng, m, args.test) for m in zoo]
                for per_class in sizes:
                    t0 = time.perf_counter()
                    scores = {c.label: [] for c in cands}
                    for model in zoo:
                        labels, features = sample(rng, model, per_class)
                        for label, value in score_all(cands, labels, features).items():
                            scores[label].append(value)
                    ids = [f"m{i}" for i in range(len(zoo))]
                    t_map = dict(zip(ids, truth, strict=True))
                    measures = {
                        lab: evaluate(dict(zip(ids, v, strict=True)), t_map)
                        for lab, v in scores.items()
                    }
                    rows.append(
                        {
                            "family": family,
                            "classes": classes,
                            "rep": rep,
                            "per_class": per_class,
                            "widths": widths.tolist(),
                            "truth": truth,
                            "scores": scores,
                            "measures": measures,
                        }
                    )
                    log(
                        f"{family} C={classes} rep={rep} n_c={per_class}: "
                        + " ".join(f"{lab}={m['weighted_tau']:.2f}" for lab, m in measures.items())
                        + f" ({time.perf_counter() - t0:.1f}s)"
                    )
    return rows


def _mean_se(values: list[float]) -> tuple[float, float]:
    v = np.nan_to_num(np.asarray(values, dtype=np.float64))  # undefined tau counts as 0
    se = float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else float("nan")
    return float(v.mean()), se


def summarise(rows: list[dict], labels: list[str]) -> list[dict]:
    """Mean (and standard error over zoos) of each measure per setting, and the paired
    difference of ``fsms`` against each other candidate."""
    out = []
    keys = sorted({(r["family"], r["classes"], r["per_class"]) for r in rows})
    for family, classes, per_class in keys:
        sel = [
            r
            for r in rows
            if (r["family"], r["classes"], r["per_class"]) == (family, classes, per_class)
        ]
        entry = {"family": family, "classes": classes, "per_class": per_class, "zoos": len(sel)}
        for lab in labels:
            for meas in MEASURES:
                mean, se = _mean_se([r["measures"][lab][meas] for r in sel])
                entry[f"{lab}|{meas}"] = [mean, se]
        for lab in labels:
            if lab == "fsms":
                continue
            diff = [
                np.nan_to_num(r["measures"]["fsms"]["weighted_tau"])
                - np.nan_to_num(r["measures"][lab]["weighted_tau"])
                for r in sel
            ]
            entry[f"fsms-{lab}|weighted_tau"] = list(_mean_se(diff))
        out.append(entry)
    return out


def pooled_by_per_class(rows: list[dict], labels: list[str]) -> list[dict]:
    """Every family and C together, per n_c (each zoo weighs the same)."""
    out = []
    for per_class in sorted({r["per_class"] for r in rows}):
        sel = [r for r in rows if r["per_class"] == per_class]
        entry = {"per_class": per_class, "zoos": len(sel)}
        for lab in labels:
            entry[lab] = list(_mean_se([r["measures"][lab]["weighted_tau"] for r in sel]))
            if lab != "fsms":
                entry[f"fsms-{lab}"] = list(
                    _mean_se(
                        [
                            np.nan_to_num(r["measures"]["fsms"]["weighted_tau"])
                            - np.nan_to_num(r["measures"][lab]["weighted_tau"])
                            for r in sel
                        ]
                    )
                )
        out.append(entry)
    return out


# ---------------------------------------------------------------- null study


def plugin_terms(labels: np.ndarray, features: np.ndarray) -> tuple[float, float]:
    """The plug-in form's mean squared pair distance q and mean subtracted noise term, over
    pairs (its steps recomputed plainly: principal coordinates, shrinkage, per-pair solves)."""
    x = sms_module._principal_whitened(features - features.mean(axis=0), 64, 0, whiten=False)
    n, m = x.shape
    classes = np.unique(labels)
    counts = np.array([np.sum(labels == c) for c in classes], dtype=np.float64)
    means = np.stack([x[labels == c].mean(axis=0) for c in classes])
    scatters = np.stack(
        [sms_module._scatter(x[labels == c], mu) for c, mu in zip(classes, means, strict=True)]
    )
    pooled = sms_module._oas(np.tensordot(counts, scatters, axes=1) / n, dof=n - classes.size)
    covs = (counts[:, None, None] * scatters + m * pooled) / (counts - 1.0 + m)[:, None, None]
    qs, biases = [], []
    for i in range(classes.size):
        for j in range(i + 1, classes.size):
            inv = np.linalg.inv(0.5 * (covs[i] + covs[j]))
            d = means[i] - means[j]
            qs.append(d @ inv @ d)
            biases.append(np.trace(inv @ (covs[i] / counts[i] + covs[j] / counts[j])))
    return float(np.mean(qs)), float(np.mean(biases))


def null_study(args, rng: np.random.Generator, log) -> list[dict]:
    out = []
    for width in (64, 2048):
        for alpha in (0.0, 1.0):
            spectrum = np.arange(1, width + 1, dtype=np.float64) ** -alpha
            for classes in args.classes:
                for per_class in args.per_class:
                    if classes * per_class > args.max_samples or per_class > 50:
                        continue
                    new, old, q, bias = [], [], [], []
                    for _ in range(args.null_reps):
                        labels = np.repeat(np.arange(classes), per_class)
                        f = rng.standard_normal((labels.size, width)) * np.sqrt(spectrum)
                        new.append(selection.score("fsms", labels=labels, features=f))
                        old.append(selection.score("fsms", labels=labels, features=f, splits=0))
                        if classes <= 40:  # the plain per-pair loop is slow at 100 classes
                            qq, bb = plugin_terms(labels, f)
                            q.append(qq)
                            bias.append(bb)
                    entry = {
                        "width": width,
                        "alpha": alpha,
                        "classes": classes,
                        "per_class": per_class,
                        "fsms": [float(np.mean(new)), float(np.std(new))],
                        "fsms@plugin": [float(np.mean(old)), float(np.std(old))],
                        "plugin_q": float(np.mean(q)) if q else None,
                        "plugin_noise_term": float(np.mean(bias)) if bias else None,
                    }
                    out.append(entry)
                    log(
                        f"null D={width} alpha={alpha} C={classes} n_c={per_class}: "
                        f"fsms {entry['fsms'][0]:.3f} plugin {entry['fsms@plugin'][0]:.3f}"
                    )
    return out


# ---------------------------------------------------------------- report


def _cell(v: list[float] | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    mean, se = v
    return f"{mean:.{digits}f}" + ("" if not np.isfinite(se) else f" ± {se:.{digits}f}")


def write_markdown(path: Path, doc: dict) -> None:
    labels = doc["candidates"]
    others = [lab for lab in labels if lab != "fsms"]
    lines = [
        "# fsms on few-shot targets: a simulation with known truth (issue 20)",
        "",
        f"Generated by `benchmarks/metrics_fewshot/run.py` ({doc['command']}); "
        f"{doc['seconds']:.0f} s on {doc['machine']}. Recipe in the script's docstring: "
        f"zoos of {doc['config']['models']} simulated models (widths "
        f"{doc['config']['widths']}, power-law spectra, class signal of varied strength, rank "
        "and placement), truth = each model's Bayes accuracy (Monte Carlo), families "
        "`gauss`, `t3` (heavy tails), `lowrank`. Nothing here comes from the transfer suite. "
        "`fsms` is the corrected form (cross-fitted over 8 half splits), `fsms@plugin` the form "
        "before it (`splits=0`). Values: mean over zoos ± standard error; an undefined tau "
        "counts as 0.",
        "",
        "## Weighted tau against the truth, all families and class counts together",
        "",
        "| samples a class | zoos | "
        + " | ".join(f"`{lab}`" for lab in labels)
        + " | "
        + " | ".join(f"`fsms` - `{lab}` (paired)" for lab in others)
        + " |",
        "|---:|---:|" + "---:|" * (len(labels) + len(others)),
    ]
    for e in doc["pooled"]:
        lines.append(
            f"| {e['per_class']} | {e['zoos']} | "
            + " | ".join(_cell(e[lab]) for lab in labels)
            + " | "
            + " | ".join(_cell(e[f"fsms-{lab}"]) for lab in others)
            + " |"
        )
    lines += [
        "",
        "## Per setting (weighted tau; rel@1 of `fsms`, `fsms@plugin`, `logme`)",
        "",
        "| family | C | n_c | zoos | "
        + " | ".join(f"`{lab}`" for lab in labels)
        + " | "
        + " | ".join(f"`fsms` - `{lab}`" for lab in others)
        + " | rel@1 |",
        "|---|---:|---:|---:|" + "---:|" * (len(labels) + len(others)) + "---|",
    ]
    for e in doc["summary"]:
        rel = " / ".join(
            f"{e[f'{lab}|rel@1'][0]:.3f}"
            for lab in ("fsms", "fsms@plugin", "logme")
            if f"{lab}|rel@1" in e
        )
        lines.append(
            f"| {e['family']} | {e['classes']} | {e['per_class']} | {e['zoos']} | "
            + " | ".join(_cell(e[f"{lab}|weighted_tau"], 2) for lab in labels)
            + " | "
            + " | ".join(_cell(e[f"fsms-{lab}|weighted_tau"], 2) for lab in others)
            + f" | {rel} |"
        )
    lines += [
        "",
        "## Null: features with no class information",
        "",
        "Labels independent of N(0, diag(j^-alpha)) features; mean (sd) over "
        f"{doc['config']['null_reps']} draws. For the plug-in form, q is the mean squared "
        "pair distance and 'noise term' the mean amount it subtracts (tr(Sbar^-1 (S_i/n_i + "
        "S_j/n_j)) from the estimated, shrunk covariances); under the null both should agree.",
        "",
        "| D | alpha | C | n_c | `fsms` | `fsms@plugin` | plug-in q | noise term | q / term |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in doc["null"]:
        q, b = e["plugin_q"], e["plugin_noise_term"]
        ratio = f"{q / b:.2f}" if q is not None and b else "-"
        lines.append(
            f"| {e['width']} | {e['alpha']:g} | {e['classes']} | {e['per_class']} | "
            f"{e['fsms'][0]:.3f} ({e['fsms'][1]:.3f}) | "
            f"{e['fsms@plugin'][0]:.3f} ({e['fsms@plugin'][1]:.3f}) | "
            + (f"{q:.2f} | {b:.2f} | {ratio} |" if q is not None else "- | - | - |")
        )
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cands = list(CANDIDATES) + (list(ABLATIONS) if args.ablations else [])
    labels = [c.label for c in cands]
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    null = null_study(args, np.random.default_rng((args.seed, 1)), log)
    rows = ranking_study(args, cands, rng, log)
    doc = {
        "command": "python benchmarks/metrics_fewshot/run.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in {"out"}
        },
        "candidates": labels,
        "candidate_options": {c.label: {"metric": c.metric, **c.options} for c in cands},
        "machine": f"{platform.machine()} {platform.system()}, numpy {np.__version__}",
        "seconds": time.perf_counter() - t0,
        "pooled": pooled_by_per_class(rows, labels),
        "summary": summarise(rows, labels),
        "null": null,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    write_markdown(args.out / f"{args.name}.md", doc)
    log(f"wrote {args.out / args.name}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
