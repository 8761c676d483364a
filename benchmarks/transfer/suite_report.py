"""The transfer suite's summary and report: recomputed from the finished cells every time the
results are written, so a partial run reports what it has, marked as partial.

The goals are issue 20's, judged as ``PREREGISTRATION.md`` says (field ground truth; the
service-default truth is reported beside it, never used to pick).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path

import numpy as np

from benchmarks.transfer.suite_stats import (
    TIE,
    WITHIN,
    bootstrap_over_targets,
    leave_one_zoo_out,
    pick,
    zoo_means,
)

TRUTHS = ("field", "service")
REL1_GOAL, CEILING_SHARE, COST_GOAL = 0.97, 0.70, 0.05


def _done(res: dict) -> list[dict]:
    return [c for c in res["cells"].values() if c.get("status") == "done"]


def _table(cells: list[dict], cands: list[str], truth: str, key: str) -> dict:
    return {
        c: {
            (cell["zoo"], cell["target"]): cell["candidates"][c][truth][key]
            for cell in cells
            if c in cell["candidates"]
        }
        for c in cands
    }


def summarise(res: dict) -> dict:
    cells = _done(res)
    cands = [c for c in res.get("candidates", []) if all(c in x["candidates"] for x in cells)]
    order = list(res.get("zoos", {}))
    zoos = [z for z in order if any(c["zoo"] == z for c in cells)]
    out: dict = {"zoos": zoos, "candidates": cands, "cells": len(cells)}
    if not cells:
        return out
    for truth in TRUTHS:
        wtau = _table(cells, cands, truth, "weighted_tau")
        rel1 = _table(cells, cands, truth, "rel@1")
        rows = {}
        for c in cands:
            rows[c] = {
                "suite": bootstrap_over_targets(wtau[c]),
                "per_zoo": zoo_means(wtau, c, zoos),
                "rel@1": float(np.mean(list(rel1[c].values()))),
                "rel@1_per_zoo": zoo_means(rel1, c, zoos),
            }
        out[truth] = {
            "rows": rows,
            "pick": pick(wtau, zoos, cands),
            "leave_one_zoo_out": leave_one_zoo_out(wtau, zoos, cands) if len(zoos) > 1 else {},
        }
    ceil = {
        (c["zoo"], c["target"]): c["ceiling"]["weighted_tau"] for c in cells if c.get("ceiling")
    }
    if ceil:
        out["ceiling"] = {
            "suite": bootstrap_over_targets(ceil),
            "per_zoo": {
                z: float(np.mean([v for (zz, _), v in ceil.items() if zz == z]))
                for z in {z for z, _ in ceil}
            },
        }
    fresh = [c for c in cells if not c.get("forward_cached")]
    forward = sum(c["forward_seconds"] for c in fresh)
    out["cost"] = {
        c: (sum(x["candidates"][c]["seconds"] for x in fresh) / forward if forward else None)
        for c in cands
    }
    out["goals"] = goals(res, out)
    return out


def goals(res: dict, summary: dict) -> dict:
    """Issue 20's goals for the rule's pick on every zoo (the default it would set)."""
    field = summary["field"]
    default = field["pick"]["pick"]
    row = field["rows"][default]
    lozo = field["leave_one_zoo_out"]
    out = {
        "default": default,
        "lozo_within": bool(lozo) and all(f["within"] for f in lozo.values()),
        "rel1_every_zoo": all(v >= REL1_GOAL for v in row["rel@1_per_zoo"].values()),
        "complete": res.get("status") == "complete",
    }
    ceiling = summary.get("ceiling")
    if ceiling:
        share = (
            row["suite"]["mean"] / ceiling["suite"]["mean"] if ceiling["suite"]["mean"] else None
        )
        out["ceiling_share"] = share
        out["ceiling_met"] = share is not None and share >= CEILING_SHARE
    costs = {c: v for c, v in summary["cost"].items() if v is not None and c in res["candidates"]}
    # G4 as pre-registered: the registered metrics at their defaults, on the suite's own cells
    registered = {c: v for c, v in costs.items() if _registered(c)}
    others = {c: v for c, v in costs.items() if not _registered(c)}
    out["cost_max"] = max(registered.items(), key=lambda kv: kv[1]) if registered else None
    out["cost_met"] = bool(registered) and all(v < COST_GOAL for v in registered.values())
    out["cost_max_other"] = max(others.items(), key=lambda kv: kv[1]) if others else None
    out["cost_default"] = costs.get(default)
    speed = res.get("metrics_speed")
    if speed:  # the same goal at the size benchmarks/metrics_speed measures (a user's size)
        ratios = {c: speed["ratios"].get(c) for c in res["candidates"]}
        known = {c: v for c, v in ratios.items() if v is not None}
        out["cost_at_scale"] = {
            "worst": max(known.items(), key=lambda kv: kv[1]) if known else None,
            "missing": sorted(c for c, v in ratios.items() if v is None),
            "met": bool(known)
            and len(known) == len(ratios)
            and all(v < COST_GOAL for v in known.values()),
            "default": ratios.get(default),
            "size": speed["size"],
        }
    return out


def _registered(candidate: str) -> bool:
    """A registered metric at its defaults (not an option variant ``m@opt``, not an ensemble)."""
    return "@" not in candidate and not candidate.startswith("ens:")


def metrics_speed_summary(path: Path) -> dict | None:
    """What ``benchmarks/metrics_speed`` measured (its JSON at ``path``): each metric's and
    suite candidate's seconds as a share of a realistic forward pass, and that size."""
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    cfg, fwd = doc["config"], doc["forward"]
    return {
        "ratios": {
            name: m["ratio_to_forward"]
            for name, m in doc["metrics"].items()
            if "ratio_to_forward" in m
        },
        "size": f"n={cfg['n']:,}, {cfg['classes']} classes, {cfg['source_classes']:,} outputs, "
        f"{cfg['dim']:,} features; forward pass of {fwd['model']} at 224 px "
        f"({fwd['images_per_s']:.1f} images/s on {fwd['torch_threads']} CPU threads)",
    }


# --------------------------------------------------------------------------------------------
# markdown


def _f(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}f}"


def _ci(b: dict) -> str:
    return f"{_f(b['mean'])} [{_f(b['lo'], 2)}, {_f(b['hi'], 2)}]"


def _yes(flag) -> str:
    return "met" if flag else "**not met**"


def write_markdown(path: Path, res: dict) -> None:
    s = res.get("summary") or summarise(res)
    mode = res["mode"]
    quick = mode["name"] == "quick"
    md = [f"# Transfer suite{' (QUICK)' if quick else ''}: selection across zoos (issue 20)", ""]
    if quick:
        md += [
            "> **QUICK run: a smoke test of the pipeline end to end, NOT a result.** Each zoo is",
            "> cut to 4 models, images to a quarter, 3 targets, one learning rate, 2 epochs, one",
            "> seed; the service-default truth runs 1 epoch instead of 3. Nothing here may be",
            "> used to choose a metric (see `benchmarks/transfer/PREREGISTRATION.md`).",
            "",
        ]
    md += [
        f"Status: **{res.get('status', 'partial')}** ({res.get('cells_done', 0)} of "
        f"{res.get('cells_expected', '?')} cells), written {dt.date.today().isoformat()}. "
        "Built and run by `benchmarks/transfer/suite.py`"
        + (" --quick" if quick else "")
        + "; the rule and goals are pre-registered in `benchmarks/transfer/PREREGISTRATION.md`.",
        "",
        f"Field ground truth: full fine-tuning (Adam, cosine, batch 32), {mode['epochs']:g} "
        f"epochs, best test accuracy over lr {', '.join(f'{v:g}' for v in mode['lrs'])} "
        f"({mode['seeds']} seed a rate, {mode['extra_seeds']} more at each model's best rate). "
        "Service ground truth: zoopick's own trainer at `FinetuneOptions` defaults"
        + (f" with {mode['service_changes']}" if mode["service_changes"] else "")
        + ", one seed. Image counts x"
        + f"{mode['scale']:g}.",
        "",
    ]
    md += _zoo_table(res) + _target_table(res)
    if not s.get("cells"):
        path.write_text("\n".join(md + ["No cell is finished yet.", ""]))
        return
    md += _pick_section(res, s) + _suite_table(s) + _per_target(res, s) + _trained_only(res, s)
    md += _truth_table(res) + _compute(res)
    path.write_text("\n".join(md))


def _zoo_table(res: dict) -> list[str]:
    md = [
        "## Zoos",
        "",
        "| zoo | models | architectures | input px | heads | features | near targets | builds "
        "| sources |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, z in res["zoos"].items():
        models = z["models"]
        archs = sorted({m["arch"] for m in models})
        heads = [m["head"] for m in models]
        sizes = sorted({m["size"] for m in models})
        feats = [
            v["feature_dim"]
            for c in _done(res)
            if c["zoo"] == name and c.get("inputs")
            for v in c["inputs"].values()
        ]
        feat = f"{min(feats)}-{max(feats)}" if feats else "?"
        near = ", ".join(res.get("near", {}).get(name, [])) or "none"
        md.append(
            f"| {name} | {len(models)} | {len(archs)} ({', '.join(archs)}) | "
            f"{', '.join(map(str, sizes))} | {min(heads)}-{max(heads)} | {feat} | {near} | "
            f"{_builds(res, name)} | {z['description']} |"
        )
    md += [
        "",
        "*builds*: the distinct sets of checkpoints (sha256) the zoo's finished cells were "
        "measured on. A seeded build is byte-identical on one machine, not across machines, "
        "and each session of this suite runs on a fresh one; every cell is measured whole on "
        "one build (`suite.cell_plan`).",
        "",
    ]
    return md + _source_accuracy(res)


def barely_trained(acc: float, classes: int) -> bool:
    """A pretrained checkpoint whose accuracy on its own source data closes under a tenth of
    the gap from chance to perfect: in effect a random or failed model, whatever its spec
    says (a zoo made mostly of such models would be a degenerate benchmark)."""
    chance = 1.0 / max(1, classes)
    return acc < chance + 0.1 * (1.0 - chance)


def _source_accuracy(res: dict) -> list[str]:
    """What pretraining achieved: each model's accuracy on its own source's training images
    (after training, eval mode), beside chance; the degenerate-input check of the zoo."""
    rows = []
    for name, z in res["zoos"].items():
        keep = trained_subset(z)
        if keep is None:
            continue
        trained = [m for m in z["models"] if m.get("source_acc") is not None]
        weak = [m for m in trained if m["id"] not in keep]
        cells = ", ".join(
            f"`{m['id']}` {m['source_acc']:.2f}" + (" (barely trained)" if m in weak else "")
            for m in sorted(trained, key=lambda m: -m["source_acc"])
        )
        random = sum(1 for m in z["models"] if str(m.get("source")).startswith("random"))
        rows.append(
            f"- **{name}**: {len(weak)} of {len(trained)} pretrained models barely trained, "
            f"{random} random by design; {cells}"
        )
    if not rows:
        return []
    return [
        "Pretraining as built (accuracy on the model's own source training images after "
        "training, in eval mode, so BatchNorm's running statistics count; *barely trained*: "
        "under a tenth of the way from chance to 1, in effect a random or failed model as a "
        "source classifier, though its features may still transfer):",
        "",
        *rows,
        "",
    ]


def _builds(res: dict, zoo: str) -> int:
    """How many different checkpoint sets the zoo's finished cells read."""
    sets = {
        tuple(sorted((k, v) for k, v in c.get("files", {}).items() if k.startswith("ckpt/")))
        for c in _done(res)
        if c["zoo"] == zoo
    }
    return len(sets)


def _target_table(res: dict) -> list[str]:
    md = [
        "## Targets",
        "",
        "| target | classes | train (a class) | test | px | colour | near "
        "zoos (others: far) | what |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, t in res["targets"].items():
        per = t["train"] / max(t["classes"], 1)
        md.append(
            f"| {name} | {t['classes']} | {t['train']} ({per:.0f}) | {t['test']} | "
            f"{t.get('size', '?')} | {'yes' if t.get('colour') else 'no'} | "
            f"{', '.join(t.get('near', [])) or 'none'} | {t['description']} |"
        )
    return md + [""]


def _pick_section(res: dict, s: dict) -> list[str]:
    f = s["field"]
    p = f["pick"]
    partial = res.get("status") != "complete"
    quick = res["mode"]["name"] == "quick"
    md = [
        "## The rule's pick (field ground truth)",
        "",
        ("**QUICK: this only shows that the rule runs; its pick means nothing.** " if quick else "")
        + ("**Partial results: the pick and goals below are provisional.** " if partial else "")
        + f"On the {len(s['zoos'])} zoo(s) with finished cells the rule picks **`{p['pick']}`** "
        f"(tie band {TIE}; tied: "
        + ", ".join(f"`{c}`" for c, r in p["rows"].items() if r["tied"])
        + ").",
        "",
    ]
    if f["leave_one_zoo_out"]:
        md += [
            "Leave one zoo out: the rule applied to the other zoos, judged on the held-out one.",
            "",
            "| held out | picked on the others | its w-tau there | rank | best there | best w-tau "
            f"| gap | within {WITHIN} |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for z, r in f["leave_one_zoo_out"].items():
            md.append(
                f"| {z} | `{r['pick']}` | {_f(r['pick_wtau'])} | {r['rank']} | `{r['best']}` | "
                f"{_f(r['best_wtau'])} | {_f(r['gap'])} | {'yes' if r['within'] else 'no'} |"
            )
        md.append("")
    g = s["goals"]
    md += [
        "Goals (issue 20) for the pick on every zoo"
        + (" — provisional, the suite is partial:" if partial else ":"),
        "",
        f"- first or within {WITHIN} of first in every leave-one-zoo-out fold: "
        + (_yes(g["lozo_within"]) if s["field"]["leave_one_zoo_out"] else "n/a (one zoo)"),
        f"- mean rel@1 >= {REL1_GOAL} on every zoo: {_yes(g['rel1_every_zoo'])} ("
        + ", ".join(f"{z} {_f(v)}" for z, v in f["rows"][g["default"]]["rel@1_per_zoo"].items())
        + ")",
        f"- mean weighted tau >= {CEILING_SHARE} of the seed-to-seed ceiling: "
        + (
            f"{_yes(g['ceiling_met'])} ({_f(g['ceiling_share'])} of it)"
            if "ceiling_share" in g
            else "n/a (no extra seeds: no ceiling)"
        ),
        f"- every registered metric's cost < {COST_GOAL:.0%} of the forward passes it reads "
        "(G4 as pre-registered: this suite's cells): "
        + (
            f"{_yes(g['cost_met'])} (highest: `{g['cost_max'][0]}` {g['cost_max'][1]:.1%}"
            + (
                f"; of the variants and ensembles: `{g['cost_max_other'][0]}` "
                f"{g['cost_max_other'][1]:.1%}"
                if g.get("cost_max_other")
                else ""
            )
            + (
                f"; the pick `{g['default']}` {g['cost_default']:.1%}"
                if g.get("cost_default") is not None
                else ""
            )
            + ")"
            if g["cost_max"]
            else "n/a (forward passes were cached)"
        ),
    ]
    at_scale = g.get("cost_at_scale")
    if at_scale:
        worst = at_scale["worst"]
        md += [
            f"  - the same at a user's size (`benchmarks/results/metrics_speed.md`: "
            f"{at_scale['size']}), every candidate: {_yes(at_scale['met'])}"
            + (f" (highest: `{worst[0]}` {worst[1]:.2%}" if worst else " (")
            + (
                f"; the pick {at_scale['default']:.2%}"
                if at_scale.get("default") is not None
                else ""
            )
            + (
                f"; not timed there: {', '.join(at_scale['missing'])}"
                if at_scale["missing"]
                else ""
            )
            + "). The suite's models are small (32-64 px, 64-1,280 features), so their forward "
            "passes are cheap and a metric's fixed cost (splits, eigendecompositions) is a large "
            "share of them.",
        ]
    return md + [""]


def _suite_table(s: dict) -> list[str]:
    f, sv = s["field"]["rows"], s["service"]["rows"]
    zoos = s["zoos"]
    order = sorted(f, key=lambda c: -f[c]["suite"]["mean"])
    md = [
        "## Every candidate over the suite",
        "",
        "Mean weighted tau over all cells with a 95 % bootstrap interval over targets "
        "(resampled with replacement, each bringing its cell in every zoo); the per-zoo means; "
        "mean rel@1 (and its lowest zoo); the same mean against the service-default truth; "
        "cost as a share of the forward passes (uncached cells).",
        "",
        "| candidate | w-tau [95 % CI] | " + " | ".join(zoos) + " | rel@1 (min zoo) | "
        "w-tau vs service truth [95 % CI] | cost |",
        "|---|---|" + "---|" * len(zoos) + "---|---|---|",
    ]
    for c in order:
        r = f[c]
        worst = min(r["rel@1_per_zoo"].values())
        cost = s["cost"].get(c)
        md.append(
            f"| `{c}` | {_ci(r['suite'])} | "
            + " | ".join(_f(r["per_zoo"].get(z)) for z in zoos)
            + f" | {_f(r['rel@1'])} ({_f(worst)}) | {_ci(sv[c]['suite'])} | "
            + (f"{cost:.1%}" if cost is not None else "n/a")
            + " |"
        )
    if s.get("ceiling"):
        c = s["ceiling"]
        md.append(
            f"| seed-to-seed ceiling | {_ci(c['suite'])} | "
            + " | ".join(_f(c["per_zoo"].get(z)) for z in zoos)
            + " | | | |"
        )
    return md + [""]


def _per_target(res: dict, s: dict) -> list[str]:
    md = ["## Per zoo and target (weighted tau against the field truth)", ""]
    cells = _done(res)
    order = sorted(s["field"]["rows"], key=lambda c: -s["field"]["rows"][c]["suite"]["mean"])
    for z in s["zoos"]:
        mine = {c["target"]: c for c in cells if c["zoo"] == z}
        targets = list(mine)
        md += [
            f"### {z}",
            "",
            "| candidate | " + " | ".join(targets) + " |",
            "|---|" + "---|" * len(targets),
        ]
        for cand in order:
            vals = [mine[t]["candidates"][cand]["field"]["weighted_tau"] for t in targets]
            md.append(f"| `{cand}` | " + " | ".join(_f(v) for v in vals) + " |")
        ceil = [mine[t].get("ceiling") for t in targets]
        if any(ceil):
            md.append(
                "| *ceiling* | "
                + " | ".join(_f(c["weighted_tau"]) if c else "n/a" for c in ceil)
                + " |"
            )
        md.append("")
    return md


def trained_subset(zoo: dict) -> set[str] | None:
    """The zoo's models that learned their source (neither random nor barely trained), or
    None when the build did not record source accuracies."""
    models = zoo.get("models", [])
    if not any(m.get("source_acc") is not None for m in models):
        return None
    return {
        m["id"]
        for m in models
        if m.get("source_acc") is not None
        and not barely_trained(m["source_acc"], m["source_classes"])
    }


def trained_only_wtau(res: dict, candidates: list[str]) -> dict[str, dict[str, float]]:
    """Per zoo, each candidate's mean weighted tau (field truth) over its cells with the
    zoo's random and barely trained models left out: the scores as given over the whole zoo,
    judged on the rest. Whether a metric only tells trained models from untrained ones.
    Averaged as the suite's own per-zoo means are (``zoo_means``: undefined counts as 0)."""
    from zoopick.selection.rank import evaluate

    table: dict[str, dict[tuple[str, str], float]] = {c: {} for c in candidates}
    judged = []
    for name, zoo in res.get("zoos", {}).items():
        keep = trained_subset(zoo)
        cells = [c for c in _done(res) if c["zoo"] == name]
        if keep is None or len(keep) < 4 or not cells:
            continue
        judged.append(name)
        for cell in cells:
            truth = {m: t["acc"] for m, t in cell["truth"]["field"].items() if m in keep}
            for cand in candidates:
                scores = {m: v for m, v in cell["candidates"][cand]["scores"].items() if m in keep}
                table[cand][(name, cell["target"])] = evaluate(scores, truth)["weighted_tau"]
    means = {c: zoo_means(table, c, judged) for c in candidates}
    return {z: {c: means[c][z] for c in candidates} for z in judged}


def _trained_only(res: dict, s: dict) -> list[str]:
    rows = s["field"]["rows"]
    order = sorted(rows, key=lambda c: -rows[c]["suite"]["mean"])
    sub = trained_only_wtau(res, order)
    if not sub:
        return []
    zoos = list(sub)
    md = [
        "## Among the trained models only (reported, not judged)",
        "",
        "Mean weighted tau per zoo against the field truth, with the zoo's random and barely "
        "trained models left out (the scores as given over the whole zoo, judged on the rest): "
        "does a candidate only tell trained models from untrained ones? Zoos whose build "
        "recorded no source accuracies are not shown.",
        "",
        "| candidate | " + " | ".join(f"{z} (all) | {z} (trained)" for z in zoos) + " |",
        "|---|" + "---|---|" * len(zoos),
    ]
    for cand in order:
        md.append(
            f"| `{cand}` | "
            + " | ".join(f"{_f(rows[cand]['per_zoo'].get(z))} | {_f(sub[z][cand])}" for z in zoos)
            + " |"
        )
    return md + [""]


def _truth_table(res: dict) -> list[str]:
    from scipy.stats import weightedtau

    md = [
        "## Ground truth per cell",
        "",
        "Field: best over the lr grid; service: the default fine-tune. `agree` is the weighted "
        "tau between the two truths' model orders.",
        "",
        "| cell | field min / median / max | field best | service min / max | service best | "
        "agree |",
        "|---|---|---|---|---|---|",
    ]
    for key, c in res["cells"].items():
        if c.get("status") != "done":
            continue
        fa = {m: r["acc"] for m, r in c["truth"]["field"].items()}
        sa = {m: r["acc"] for m, r in c["truth"]["service"].items()}
        ids = list(fa)
        vals = sorted(fa.values())
        agree = weightedtau([fa[i] for i in ids], [sa[i] for i in ids]).statistic
        fb, sb = max(fa, key=fa.get), max(sa, key=sa.get)
        md.append(
            f"| {key} | {_f(vals[0])} / {_f(float(np.median(vals)))} / {_f(vals[-1])} | {fb} | "
            f"{_f(min(sa.values()))} / {_f(max(sa.values()))} | {sb} | {_f(float(agree))} |"
        )
    return md + [""]


def _compute(res: dict) -> list[str]:
    md = [
        "## Compute",
        "",
        "Single-thread seconds summed over runs (a service run counts its wall time once; it "
        "used 2 processes of one thread) and wall seconds of the calls that did the work.",
        "",
        "| zoo | pretraining (sum) | field fine-tunes: runs, sum s | service runs: runs, sum s | "
        "scoring wall s |",
        "|---|---|---|---|---|",
    ]
    for name, z in res["zoos"].items():
        cells = [c for c in _done(res) if c["zoo"] == name]
        comp = [c["compute"] for c in cells]
        md.append(
            f"| {name} | {z['build_seconds_sum']:.0f} | "
            f"{sum(c['field_runs'] for c in comp)}, {sum(c['field_run_seconds'] for c in comp):.0f}"
            f" | {sum(c['service_runs'] for c in comp)}, "
            f"{sum(c['service_run_seconds'] for c in comp):.0f} | "
            f"{sum(c['score_wall'] for c in comp):.0f} |"
        )
    m = res.get("machine", {})
    md += [
        "",
        f"Last call: {m.get('cpus')} CPUs ({m.get('platform')}), --jobs {m.get('jobs')}, "
        f"field fine-tunes on {m.get('field_device')}"
        + (
            f", {res['wall_seconds_last_call']:.0f} s wall."
            if "wall_seconds_last_call" in res
            else "."
        ),
        "",
    ]
    return md
