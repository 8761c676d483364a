"""Accuracy and bytes of spardl's 4-byte pairs (``pairs16``) against its 8-byte pairs.

Reads the ``convergence.json`` of runs of ``run.py`` made with ``--hooks
dense,spardl,spardl-p16,spardl-p16bf`` and one ``--seed`` each (a run is deterministic:
within one seed every hook sees the same weights and batches, so the 16-bit forms differ
from ``spardl`` by their rounding alone), and writes ``spardl_pairs16.{json,md}``: per seed
and hook the final and last-3-epoch test accuracy, its difference to ``spardl`` in points,
and the bytes each worker sent (the hook's own count) relative to ``spardl``.

    python benchmarks/convergence/pairs16.py RUN_DIR [RUN_DIR ...] --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

HOOKS = ("dense", "spardl", "spardl-p16", "spardl-p16bf")


def _tail(run: dict[str, Any], last: int = 3) -> float:
    accs = [e["test_acc"] for e in run["epochs"][-last:]]
    return 100 * sum(accs) / len(accs)


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for res in results:
        runs = res["runs"]
        base = runs["spardl"]
        for hook in HOOKS:
            run = runs[hook]
            last, base_last = run["epochs"][-1], base["epochs"][-1]
            final = 100 * last["test_acc"]
            sent = sum(e["bytes_sent"] for e in run["epochs"])
            rows.append(
                {
                    "seed": res["settings"]["seed"],
                    "hook": hook,
                    "train_loss": last["loss"],
                    "train_loss_vs_spardl": last["loss"] - base_last["loss"],
                    "train_acc": 100 * last["train_acc"],
                    "train_acc_vs_spardl": 100 * (last["train_acc"] - base_last["train_acc"]),
                    "final_acc": final,
                    "tail3_acc": _tail(run),
                    "final_vs_spardl": final - 100 * base["epochs"][-1]["test_acc"],
                    "tail3_vs_spardl": _tail(run) - _tail(base),
                    "bytes_sent_per_worker": sent,
                    "bytes_vs_spardl": sent / sum(e["bytes_sent"] for e in base["epochs"]),
                }
            )
    means = {
        hook: {
            key: statistics.fmean(r[key] for r in rows if r["hook"] == hook)
            for key in (
                "train_loss_vs_spardl",
                "train_acc_vs_spardl",
                "final_vs_spardl",
                "tail3_vs_spardl",
                "bytes_vs_spardl",
            )
        }
        for hook in HOOKS
    }
    return {
        "settings": results[0]["settings"],
        "data": results[0]["data"],
        "rows": rows,
        "means": means,
        "commands": [r["command"] for r in results],
    }


def markdown(summary: dict[str, Any]) -> str:
    a = summary["settings"]
    lines = [
        "# spardl with 4-byte pairs (`pairs16`): accuracy and bytes",
        "",
        (
            f"The pretrained zoo model `{a['pretrained']}` fine-tuned on Fashion-MNIST classes "
            f"{a['classes']}, "
            if a.get("pretrained")
            else f"**A small run**: `{a['arch']}` (random init) on Fashion-MNIST, "
        )
        + f"{summary['data']['train_used']} training and {summary['data']['test_used']} test "
        f"images, P = {a['workers']} gloo workers, {a['epochs']} epochs, {a['optimizer']} lr "
        f"{a['lr']:g}, density {a['density']:g}"
        + (f", {a['warmup']} iterations of {a['warmup_mode']} warm-up" if a.get("warmup") else "")
        + ", seeds "
        + ", ".join(str(s) for s in sorted({r["seed"] for r in summary["rows"]}))
        + ". Within a seed every hook sees the same weights and batches, so `spardl-p16` "
        "(16-bit block-relative indices + float16 values) and `spardl-p16bf` (+ bfloat16) "
        "differ from `spardl` (int32 + float32) by the rounding of what they send alone; "
        "that rounding stays in the residual (error feedback). Bytes are the hook's own "
        "count per worker over the run. `dense` is there for scale; the test subset differs "
        "between seeds. Train loss and accuracy are the last epoch's means over its batches "
        "(the runner's records); test accuracy is on the seed's test subset.",
        "",
        "| seed | hook | train loss | vs spardl | train acc | vs spardl (points) | "
        "final test acc | vs spardl | last-3 test mean | vs spardl | bytes / worker (MB) "
        "| vs spardl |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['seed']} | {r['hook']} | {r['train_loss']:.3f} | "
            f"{r['train_loss_vs_spardl']:+.3f} | {r['train_acc']:.2f}% | "
            f"{r['train_acc_vs_spardl']:+.2f} | {r['final_acc']:.2f}% | "
            f"{r['final_vs_spardl']:+.2f} | {r['tail3_acc']:.2f}% | "
            f"{r['tail3_vs_spardl']:+.2f} | {r['bytes_sent_per_worker'] / 1e6:.2f} | "
            f"{r['bytes_vs_spardl']:.3f} |"
        )
    lines += [
        "",
        "Mean over seeds (differences to `spardl`; in brackets the range over seeds):",
        "",
        "| hook | train loss | train acc (points) | final test acc | last-3 test mean | bytes |",
        "|---|---|---|---|---|---|",
    ]
    for hook, m in summary["means"].items():
        cells = []
        for key, fmt in (
            ("train_loss_vs_spardl", "+.3f"),
            ("train_acc_vs_spardl", "+.2f"),
            ("final_vs_spardl", "+.2f"),
            ("tail3_vs_spardl", "+.2f"),
        ):
            vals = [r[key] for r in summary["rows"] if r["hook"] == hook]
            cells.append(f"{m[key]:{fmt}} [{min(vals):{fmt}}, {max(vals):{fmt}}]")
        lines.append(f"| {hook} | " + " | ".join(cells) + f" | {m['bytes_vs_spardl']:.3f}x |")
    lines += [
        "",
        "Reading: at this size the test accuracy of a random-init model at a constant "
        "learning rate swings by several points from epoch to epoch and between runs that "
        "differ only in rounding (see the ranges), so it cannot resolve an effect of a "
        "point; the training loss and accuracy (means over a whole epoch) are much steadier "
        "and are the figures to read: there the distance of the 16-bit forms to `spardl` is "
        "to be set against the distance of `dense` to `spardl` in the same runs.",
    ]
    lines += ["", "Commands:", ""] + [f"- `{c}`" for c in summary["commands"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="--out folders of run.py")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    results = [json.loads((d / "convergence.json").read_text()) for d in args.runs]
    summary = summarise(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spardl_pairs16.json").write_text(json.dumps(summary, indent=1))
    (args.out / "spardl_pairs16.md").write_text(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
