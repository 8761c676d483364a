"""Scoring on a GPU against the CPU: the same zoo, targets and metrics, extracted once in fp32
on the CPU and once on CUDA as the service's GPU workers do it (bf16 autocast, channels_last,
the service's batch size), then every metric's ranking compared.

Per (target, metric): whether the two orderings are identical, Kendall tau between the two
score vectors, whether the top-1 pick is the same, the largest relative score difference, and
each ranking's weighted tau against the ground truth (when ``<zoo>/ground_truth.json`` is
there). Per model: images/s of the forward pass on each device (the CUDA pass is timed after
an untimed warm-up pass of the same model, so cuDNN's set-up is not counted) and the peak GPU
memory of its extraction.

    python benchmarks/transfer/gpu_check.py --zoo benchmarks/transfer/zoo --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _scores(results, metric: str) -> dict[str, float]:
    return {m.id: float(m.scores[metric]) for m in results}


def compare(cpu: dict[str, float], gpu: dict[str, float]) -> dict[str, Any]:
    from scipy.stats import kendalltau

    ids = sorted(cpu)
    a = np.array([cpu[i] for i in ids])
    b = np.array([gpu[i] for i in ids])
    order_a = [ids[j] for j in np.argsort(-a, kind="stable")]
    order_b = [ids[j] for j in np.argsort(-b, kind="stable")]
    scale = np.maximum(np.abs(a), 1e-12)
    tau = kendalltau(a, b).statistic
    swapped = [
        (order_a[j], order_a[j + 1])
        for j in range(len(order_a) - 1)
        if order_b.index(order_a[j]) > order_b.index(order_a[j + 1])
    ]
    return {
        "identical_order": order_a == order_b,
        "kendall_tau": float(tau) if tau == tau else None,
        "same_top1": order_a[0] == order_b[0],
        "top1_cpu": order_a[0],
        "top1_gpu": order_b[0],
        "max_rel_diff": float(np.max(np.abs(a - b) / scale)),
        "swapped_neighbours": swapped,
        "gap_at_swaps": [abs(cpu[x] - cpu[y]) / max(abs(cpu[x]), 1e-12) for x, y in swapped],
    }


def score_all(zoo, dataset, metrics, device: str, batch_size: int, warm: bool):
    """``rank_zoo`` by hand, to time and measure each model's extraction on ``device``."""
    import torch

    from zoopick.selection.rank import combine_zoo, score_model

    results, per_model = [], {}
    for entry in zoo:
        if warm:  # cuDNN autotuning and lazy module loading out of the timed pass
            score_model(entry, dataset, metrics[:1], batch_size=batch_size, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        r = score_model(entry, dataset, metrics, batch_size=batch_size, device=device)
        info = {"images_per_s": len(dataset) / r.seconds["forward"]}
        if device == "cuda":
            info["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
        per_model[entry.id] = info
        results.append(r)
    combine_zoo(results, metrics)
    return results, per_model


REAL_SIZE = ("resnet50", "convnext_tiny", "vit_small_patch16_224", "efficientnet_b0")


def real_size(archs: list[str], images: int, batches: list[int]) -> list[dict[str, Any]]:
    """Forward throughput of ImageNet-size timm models (random weights, 224 px, 1,000-way
    heads) on the CPU in fp32 and on CUDA in bf16 + channels_last, through the same
    ``extract`` the service calls: the benchmark zoo's 32-px models are too small to keep a
    GPU busy, these are the sizes a real zoo holds."""
    import torch

    from zoopick.selection.data import TargetDataset
    from zoopick.selection.extract import extract
    from zoopick.selection.zoo import ZooEntry

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(images, 224, 224, 3), dtype=np.uint8)
    y = np.arange(images) % 10
    ds = TargetDataset.from_arrays(x, y, [str(c) for c in range(10)], name="real-size")
    rows = []
    for arch in archs:
        entry = ZooEntry(id=arch, arch=arch, weights="none", num_classes=1000)
        model = entry.create_model()
        for bs in batches:
            row: dict[str, Any] = {"arch": arch, "batch": bs, "images": images}
            extract(entry, ds, batch_size=bs, device="cuda", model=model)  # warm-up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            gpu = extract(entry, ds, batch_size=bs, device="cuda", model=model)
            row["gpu_images_per_s"] = images / gpu.seconds
            row["gpu_peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
            cpu = extract(entry, ds, batch_size=bs, device="cpu")  # a fresh, contiguous model
            row["cpu_images_per_s"] = images / cpu.seconds
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default="benchmarks/transfer/zoo")
    ap.add_argument(
        "--targets", nargs="*", help="default: every target of the zoo; none: only --real-size"
    )
    ap.add_argument("--metrics", nargs="*", help="default: every registered metric")
    ap.add_argument("--batch-size", type=int, default=64, help="the service's default")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for the fp32 run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--real-size", nargs="*", default=None, help=f"archs (default {REAL_SIZE})")
    ap.add_argument("--real-size-images", type=int, default=512)
    args = ap.parse_args(argv)

    import torch

    from zoopick.selection.data import load_dataset
    from zoopick.selection.metrics import available
    from zoopick.selection.rank import evaluate
    from zoopick.selection.zoo import load_zoo

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.zoo)
    zoo = load_zoo(root / "zoo.json")
    metrics = args.metrics or available()
    truth_path = root / "ground_truth.json"
    truth_all = json.loads(truth_path.read_text()) if truth_path.exists() else {}
    targets = (
        args.targets
        if args.targets is not None
        else sorted(
            p.name.removesuffix("-train.npz") for p in (root / "targets").glob("*-train.npz")
        )
    )
    started = time.perf_counter()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "metrics": metrics,
        "targets": {},
    }
    if args.real_size is not None:
        out["real_size"] = real_size(
            args.real_size or list(REAL_SIZE), args.real_size_images, [64, 256]
        )
    for target in targets:
        dataset = load_dataset(root / "targets" / f"{target}-train.npz")
        cpu, cpu_models = score_all(zoo, dataset, metrics, "cpu", args.batch_size, warm=False)
        gpu, gpu_models = score_all(zoo, dataset, metrics, "cuda", args.batch_size, warm=True)
        rec: dict[str, Any] = {"images": len(dataset), "models": {}, "metrics": {}}
        for e in zoo:
            rec["models"][e.id] = {
                "cpu_images_per_s": cpu_models[e.id]["images_per_s"],
                "gpu_images_per_s": gpu_models[e.id]["images_per_s"],
                "gpu_peak_mem_mb": gpu_models[e.id]["peak_mem_mb"],
            }
        truth = {i: v["acc"] for i, v in truth_all.get(target, {}).items()}
        for m in metrics:
            c = compare(_scores(cpu, m), _scores(gpu, m))
            if truth and set(truth) == {e.id for e in zoo}:
                c["wtau_cpu"] = evaluate(_scores(cpu, m), truth)["weighted_tau"]
                c["wtau_gpu"] = evaluate(_scores(gpu, m), truth)["weighted_tau"]
            rec["metrics"][m] = c
        out["targets"][target] = rec
        same = sum(rec["metrics"][m]["identical_order"] for m in metrics)
        print(f"{target}: {same}/{len(metrics)} metrics rank identically", flush=True)
        save(out, args.out, started)  # after every target: a cut-off run keeps what it did
    save(out, args.out, started)


def save(out: dict[str, Any], folder: Path, started: float) -> None:
    out["seconds"] = time.perf_counter() - started
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "transfer_gpu.json").write_text(json.dumps(out, indent=1) + "\n")
    (folder / "transfer_gpu.md").write_text(markdown(out))


def markdown(out: dict[str, Any]) -> str:
    targets = out["targets"]
    metrics = out["metrics"]
    lines = [
        "# Scoring on a GPU against the CPU",
        "",
        f"{out['device']}, torch {out['torch']}; CPU fp32 with {out['cpu_threads']} threads "
        f"against CUDA bf16 autocast + channels_last, batch {out['batch_size']} "
        "(`benchmarks/transfer/gpu_check.py`; the zoo and targets of `benchmarks/transfer`, "
        "each target's train split).",
        "",
        "## Rankings",
        "",
        "Per metric over the targets: identical orderings, mean Kendall tau between the CPU "
        "and GPU scores, same top-1, largest relative score difference, and the mean "
        "weighted tau against the ground truth on each side.",
        "",
        "| metric | identical order | tau(cpu, gpu) | same top-1 | max rel. diff | w-tau cpu "
        "| w-tau gpu |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in metrics:
        rows = [targets[t]["metrics"][m] for t in targets]
        taus = [r["kendall_tau"] for r in rows if r["kendall_tau"] is not None]
        wc = [r["wtau_cpu"] for r in rows if "wtau_cpu" in r]
        wg = [r["wtau_gpu"] for r in rows if "wtau_gpu" in r]
        lines.append(
            f"| {m} | {sum(r['identical_order'] for r in rows)}/{len(rows)} | "
            f"{statistics.fmean(taus) if taus else float('nan'):.3f} | "
            f"{sum(r['same_top1'] for r in rows)}/{len(rows)} | "
            f"{max(r['max_rel_diff'] for r in rows):.2e} | "
            + (f"{statistics.fmean(wc):.3f} | {statistics.fmean(wg):.3f} |" if wc else "— | — |")
        )
    lines += ["", "Where an ordering differs (adjacent pairs swapped; relative CPU score gap):", ""]
    any_diff = False
    for t, rec in targets.items():
        for m in metrics:
            r = rec["metrics"][m]
            if not r["identical_order"]:
                any_diff = True
                pairs = ", ".join(
                    f"{a} / {b} ({g:.1e})"
                    for (a, b), g in zip(r["swapped_neighbours"], r["gap_at_swaps"], strict=True)
                )
                top = "" if r["same_top1"] else f"; top-1 {r['top1_cpu']} -> {r['top1_gpu']}"
                lines.append(f"- {t}, {m}: {pairs or 'non-adjacent moves'}{top}")
    if not any_diff:
        lines.append("- none")
    lines += [
        "",
        "## Throughput and memory per model",
        "",
        "Images/s of the forward pass (mean over targets) and peak GPU memory of the "
        "extraction (max over targets).",
        "",
        "| model | CPU images/s | GPU images/s | GPU / CPU | GPU peak MB |",
        "|---|---|---|---|---|",
    ]
    if not targets:
        return "\n".join(lines[:4] + real_size_markdown(out.get("real_size", []))) + "\n"
    ids = list(next(iter(targets.values()))["models"])
    for i in ids:
        c = statistics.fmean(targets[t]["models"][i]["cpu_images_per_s"] for t in targets)
        g = statistics.fmean(targets[t]["models"][i]["gpu_images_per_s"] for t in targets)
        mem = max(targets[t]["models"][i]["gpu_peak_mem_mb"] for t in targets)
        lines.append(f"| {i} | {c:.0f} | {g:.0f} | {g / c:.1f} | {mem:.0f} |")
    lines += real_size_markdown(out.get("real_size", []))
    return "\n".join(lines) + "\n"


def real_size_markdown(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "## ImageNet-size models",
        "",
        f"timm models at 224 px with random weights and 1,000-way heads, {rows[0]['images']} "
        "random images, through `extract` (what a scoring worker runs): CPU fp32 against "
        "CUDA bf16 + channels_last (`--real-size`).",
        "",
        "| model | batch | CPU images/s | GPU images/s | GPU / CPU | GPU peak MB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arch']} | {r['batch']} | {r['cpu_images_per_s']:.0f} | "
            f"{r['gpu_images_per_s']:.0f} | {r['gpu_images_per_s'] / r['cpu_images_per_s']:.1f}"
            f" | {r['gpu_peak_mem_mb']:.0f} |"
        )
    return lines


if __name__ == "__main__":
    main()
