"""Does the fused top-k's bracket hold on real gradients? (issue 19; runs on the CPU.)

The bracket (``triton_kernels._bracket``) finds each block's k-th largest magnitude from a
stratified sample; where the sample misleads, or the band between its bounds overflows its
buffer, the block falls back to the radix levels (correct, slower). How often that happens
is a property of the values, not of the device, so it is measured here, through Triton's
interpreter, on the buckets a DDP hook would see.

Recipe: the GPU benchmarks' timm model (random weights, seed 0) runs ``--steps`` backward
passes on random 224 px images and labels, ``--batch`` of them (smaller than the GPU
recipe's 64, for a 2-core CPU), and each bucket of ``--bucket-mb`` goes through error
feedback with an exact top-k at the density (``gpu_select.gradient_buckets``); the last
step's buckets are what the bracket is tried on. Reported per bucket: whether the bracket
held the k-th key, the band's fill of its buffer, the band against ``k``, ties at the k-th
magnitude and exact zeros (degenerate inputs).

    python benchmarks/comm/bracket_fit.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_hooks  # noqa: E402
import gpu_select  # noqa: E402
import torch  # noqa: E402

from zoopick.training.comm import select, triton_kernels  # noqa: E402


def run(args) -> list[dict[str, Any]]:
    triton_kernels.TILE, triton_kernels.TILES = 1 << 16, 1  # the interpreter's speed only
    rows = []
    for name in args.recipes:
        recipe = dict(gpu_hooks.RECIPES[name], batch=args.batch)
        gpu_hooks.RECIPES[f"{name}@cpu"] = recipe
        for density in args.densities:
            opts = SimpleNamespace(
                recipe=f"{name}@cpu", classes=1000, dry_run=False, bucket_mb=args.bucket_mb,
                steps=args.steps, density=density,
            )  # fmt: skip
            for i, acc in enumerate(gpu_select.gradient_buckets(opts, torch.device("cpu"))):
                k = select.k_for(density, acc.numel())
                row = {"recipe": name, "density": density, "bucket": i}
                row |= gpu_select.describe(acc, k) | gpu_select.bracket_fit(acc, k)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def report(rows: list[dict[str, Any]], args) -> str:
    lines = [
        "# The fused top-k's bracket on real gradients (issue 19, CPU)",
        "",
        f"`benchmarks/comm/bracket_fit.py` (its docstring gives the recipe): random-weight timm "
        f"models, {args.batch} random 224 px images, the last of {args.steps} "
        f"error-feedback steps, {args.bucket_mb} MB buckets, sample {triton_kernels.SAMPLE} "
        f"keys per block, margin {triton_kernels.MARGIN} sigma. Not a timing.",
        "",
        "| recipe | density | buckets | bracket held | band fill of buffer | band / k "
        "| most tied at k-th | most exact zeros |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["recipe"], r["density"]), []).append(r)
    for (name, density), rs in groups.items():
        fill = [r["band"] / r["band_capacity"] for r in rs]
        per_k = [r["band"] / r["k"] for r in rs]
        lines.append(
            f"| {name} | {density} | {len(rs)} | {sum(r['bracket_hit'] for r in rs)} | "
            f"{min(fill):.2f}-{max(fill):.2f} | {min(per_k):.2f}-{max(per_k):.2f} | "
            f"{max(r['tied_at_kth'] for r in rs)} | {max(r['zeros'] for r in rs):.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", type=lambda s: s.split(","), default=["resnet50", "vit"])
    ap.add_argument("--densities", type=lambda s: [float(d) for d in s.split(",")],
                    default=[0.01, 0.001])  # fmt: skip
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comm_bracket_fit.json").write_text(json.dumps(rows, indent=1))
    (args.out / "comm_bracket_fit.md").write_text(report(rows, args))
    print(f"wrote {args.out / 'comm_bracket_fit.md'}")


if __name__ == "__main__":
    main()
