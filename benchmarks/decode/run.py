"""What decoding a job's dataset once, instead of once per scoring task, saves (issue 42).

A job scores N zoo models, each in its own task. Each task used to read the dataset's archive
and decode every image (``load_dataset``) before looking the feature cache up; now validation
keeps the images decoded beside the file (``zoopick.selection.decoded``) and each task reads
that copy (``service.datasets.for_scoring``): no archive read, no image decoded.

This script builds an ImageFolder ``.tar`` of ``--images`` small JPEGs (``--side`` px, random
smooth colours, ``--classes`` classes), validates it once as the service does (the loader, then
the decoded copy: timed apart), and scores a zoo of ``--models`` timm ``test_*`` architectures
with seeded random weights (input ``--input`` px, a head of ``--classes`` outputs) with the
scoring task's own function, twice, in one process:

1. **before**: every task loads the archive with ``load_dataset`` (the old ``score_one``);
2. **after**: every task reads the decoded copy (today's ``score_one``).

Each phase starts with an empty in-process preprocess cache and its own feature cache, so both
do the same forward passes and metrics; the difference is the per-task load. Then both run
again on their warm feature caches (a job re-scored with another metric, or a second job on the
same data): before, every task still decoded the archive before the cache was consulted; after,
it decodes nothing. Ratios are before / after.

    python benchmarks/decode/run.py --images 20000 --models 20
    python benchmarks/decode/run.py --images 2000 --models 4 --out /tmp/decode

Writes ``decode.json`` and ``decode.md`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zoopick.selection import decoded  # noqa: E402
from zoopick.selection.data import load_dataset  # noqa: E402
from zoopick.selection.extract import clear_preprocess_cache  # noqa: E402
from zoopick.selection.rank import score_model  # noqa: E402
from zoopick.selection.zoo import ZooEntry  # noqa: E402
from zoopick.service.datasets import for_scoring  # noqa: E402
from zoopick.service.settings import Settings  # noqa: E402

ARCHS = [  # the test_* architectures that take any input size (the ViTs fix theirs)
    "test_resnet",
    "test_convnext",
    "test_efficientnet",
    "test_byobnet",
    "test_nfnet",
    "test_convnext2",
    "test_efficientnet_gn",
    "test_convnext3",
    "test_efficientnet_ln",
    "test_efficientnet_evos",
]


def build_archive(path: Path, images: int, classes: int, side: int, seed: int = 0) -> int:
    """An ImageFolder tar of ``images`` JPEGs (smooth random colour fields, so they compress
    like photographs, not like noise); returns its size in bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    with tarfile.open(path, "w") as tar:
        for i in range(images):
            coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
            img = Image.fromarray(coarse).resize((side, side), Image.BILINEAR)
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=90)
            info = tarfile.TarInfo(f"data/class{i % classes:02d}/{i:06d}.jpg")
            info.size = buf.tell()
            buf.seek(0)
            tar.addfile(info, buf)
    return path.stat().st_size


def zoo(models: int, classes: int, side: int) -> list[ZooEntry]:
    return [
        ZooEntry(
            id=f"m{i:02d}-{ARCHS[i % len(ARCHS)]}",
            arch=ARCHS[i % len(ARCHS)],
            weights="none",
            num_classes=classes,
            overrides={"input_size": [3, side, side], "crop_pct": 1.0},
        )
        for i in range(models)
    ]


def score_all(
    entries: list[ZooEntry], load: Any, metrics: list[str], cache: Path, cfg: Settings
) -> dict[str, Any]:
    """Each model as its scoring task does it: load the dataset, then ``score_model``."""
    loads, totals, cached = [], [], 0
    for entry in entries:
        start = time.perf_counter()
        dataset = load()
        loaded = time.perf_counter()
        result = score_model(
            entry, dataset, metrics, cache_dir=cache, batch_size=cfg.score_batch_size
        )
        totals.append(time.perf_counter() - start)
        loads.append(loaded - start)
        cached += int(result.cached)
    return {
        "seconds": round(sum(totals), 3),
        "load_seconds": round(sum(loads), 3),
        "load_per_task_s": round(sum(loads) / len(loads), 4),
        "cached_models": cached,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--models", type=int, default=20)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--side", type=int, default=32, help="image side, px")
    ap.add_argument("--input", type=int, default=32, help="the models' input side, px")
    ap.add_argument("--metrics", default="logme")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    load_before = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="zoopick-decode-") as tmp:
        root = Path(tmp)
        cfg = Settings(storage_dir=root / "storage")
        limits = cfg.dataset_limits()
        folder = root / "storage" / "datasets" / "bench"
        folder.mkdir(parents=True)
        archive = folder / "data.tar"
        size = build_archive(archive, args.images, args.classes, args.side)

        start = time.perf_counter()
        loaded = load_dataset(archive, limits=limits)
        validate_s = time.perf_counter() - start
        start = time.perf_counter()
        kept = decoded.write(loaded, folder / "decoded", max_bytes=limits.max_total_bytes)
        copy_s = time.perf_counter() - start
        if not kept:
            raise SystemExit("the decoded copy was not made (over max_total_bytes?)")
        copy_bytes = sum(p.stat().st_size for p in (folder / "decoded").iterdir())
        entries = zoo(args.models, args.classes, args.input)

        def old() -> Any:  # the scoring task before issue 42
            return load_dataset(archive, max_per_class=cfg.score_max_per_class, limits=limits)

        def new() -> Any:  # today's scoring task
            return for_scoring(archive, cfg)

        assert new().digest == old().digest == loaded.digest  # same feature-cache keys
        phases: dict[str, Any] = {}
        for name, load in (("before", old), ("after", new)):
            clear_preprocess_cache()
            phases[name] = score_all(entries, load, metrics, root / f"cache-{name}", cfg)
            print(name, phases[name], flush=True)
        for name, load in (("before", old), ("after", new)):
            clear_preprocess_cache()
            phases[f"{name}_warm"] = score_all(entries, load, metrics, root / f"cache-{name}", cfg)
            print(f"{name}_warm", phases[f"{name}_warm"], flush=True)

    def ratio(a: str, b: str, key: str = "seconds") -> float:
        return round(phases[a][key] / max(phases[b][key], 1e-9), 2)

    result = {
        "benchmark": "decode",
        "images": args.images,
        "models": args.models,
        "classes": args.classes,
        "image_side": args.side,
        "input_side": args.input,
        "metrics": metrics,
        "archive_bytes": size,
        "decoded_copy_bytes": copy_bytes,
        "validation_load_s": round(validate_s, 3),
        "validation_copy_s": round(copy_s, 3),
        "phases": phases,
        "ratio_job": ratio("before", "after"),
        "ratio_load": ratio("before", "after", "load_seconds"),
        "ratio_warm_job": ratio("before_warm", "after_warm"),
        "scored_per_class": cfg.score_max_per_class,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_before": load_before,
            "load_average_after": round(os.getloadavg()[0], 2),
        },
        "torch_threads": __import__("torch").get_num_threads(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "decode.md").write_text(report(result))
    print(json.dumps({k: result[k] for k in ("ratio_job", "ratio_load", "ratio_warm_job")}))
    return result


def report(r: dict[str, Any]) -> str:
    p = r["phases"]
    rows = "\n".join(
        f"| {name} | {v['seconds']:.1f} | {v['load_seconds']:.1f} | {v['load_per_task_s']:.3f} "
        f"| {v['cached_models']} |"
        for name, v in p.items()
    )
    cap = r.get("scored_per_class")
    scored = "every image" if cap is None else f"at most {cap} images a class"
    return f"""# Decoding a job's dataset once (issue 42)

`python benchmarks/decode/run.py --images {r["images"]} --models {r["models"]} \
--classes {r["classes"]} --side {r["image_side"]} --input {r["input_side"]} \
--metrics {",".join(r["metrics"])}`

{r["images"]:,} JPEGs of {r["image_side"]} px in an ImageFolder tar ({r["archive_bytes"]:,}
bytes), {r["models"]} timm `test_*` models with seeded random weights at {r["input_side"]} px,
metrics {", ".join(r["metrics"])}; each task scores {scored} (`ZOOPICK_SCORE_MAX_PER_CLASS`'s
default), in both phases; {r["machine"]["cpus"]} CPUs, 1-minute
load average {r["machine"]["load_average_before"]} before and {r["machine"]["load_average_after"]}
after the run, torch threads {r["torch_threads"]}.
Validation: the loader {r["validation_load_s"]:.1f} s, then the decoded
copy {r["validation_copy_s"]:.1f} s ({r["decoded_copy_bytes"]:,} bytes), once per dataset.

| phase | scoring, s | loading, s | loading a task, s | models cached |
|---|---|---|---|---|
{rows}

- **before / after, a job's scoring: {r["ratio_job"]}x** (loading alone: {r["ratio_load"]}x)
- **before / after, re-scored on a warm feature cache: {r["ratio_warm_job"]}x**

before: each scoring task reads and decodes the archive (`load_dataset`, the old `score_one`);
after: each reads the copy validation decoded (`service.datasets.for_scoring`). Both in one
process, each phase with an empty in-process preprocess cache and its own feature cache.
"""


if __name__ == "__main__":
    main()
