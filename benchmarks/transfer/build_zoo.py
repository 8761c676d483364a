"""Build the transfer benchmark's model zoo and target datasets, deterministically.

No hub weights exist on the benchmark machine, so the zoo is made here: small timm
architectures pretrained for different lengths on different source tasks (Fashion-MNIST
classes 0-5, procedural shapes, procedural gratings) or left at a seeded random
initialisation. Their transferability to the targets (held-out Fashion-MNIST classes, digits,
unseen shapes, unseen textures) therefore genuinely differs, by source relevance, training
length and architecture.

Writes into ``--out``: ``ckpt/<id>.safetensors``, ``zoo.json`` (the manifest
``zoopick.selection.zoo`` reads), ``targets/<name>-{train,test}.npz`` (x, y, class_names) and
``build.json`` (settings and timings). Work already done with the same settings is skipped.

    python benchmarks/transfer/build_zoo.py --fmnist ../shared/datasets/fashion-mnist.npz
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing import get_context
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from benchmarks.transfer import tasks  # noqa: E402
from benchmarks.transfer.finetune_gt import setup_torch, stable_seed, to_tensor, train  # noqa: E402

MEAN = STD = [0.5, 0.5, 0.5]
PRETRAIN_LR = 3e-3


@dataclass(frozen=True)
class ZooModel:
    id: str
    arch: str
    source: str | None  # a key of tasks.SOURCES, or None for random initialisation
    epochs: int
    tags: tuple[str, ...]


# id, arch, source, epochs, tags. Varied on purpose: source relevance, length, architecture.
ZOO: tuple[ZooModel, ...] = tuple(
    ZooModel(*row)
    for row in (
        ("fmnist6-resnet-e8", "test_resnet", "fmnist6", 8, ("cnn",)),
        ("fmnist6-resnet-e1", "test_resnet", "fmnist6", 1, ("cnn",)),
        ("fmnist6-convnext-e8", "test_convnext", "fmnist6", 8, ("cnn",)),
        ("fmnist6-vit-e8", "test_vit", "fmnist6", 8, ("vit",)),
        ("fmnist6-mobilenetv3-e4", "mobilenetv3_small_050", "fmnist6", 4, ("cnn", "mobile")),
        ("fmnist6-efficientnet-e2", "test_efficientnet", "fmnist6", 2, ("cnn",)),
        ("fmnist6-mambaout-e4", "test_mambaout", "fmnist6", 4, ("cnn",)),
        ("fmnist6-nfnet-e4", "test_nfnet", "fmnist6", 4, ("cnn",)),
        ("shapes4-resnet-e6", "test_resnet", "shapes4", 6, ("cnn",)),
        ("shapes4-byobnet-e6", "test_byobnet", "shapes4", 6, ("cnn",)),
        ("shapes4-vit2-e6", "test_vit2", "shapes4", 6, ("vit",)),
        ("shapes4-efficientnet-e1", "test_efficientnet", "shapes4", 1, ("cnn",)),
        ("stripes8-convnext-e6", "test_convnext", "stripes8", 6, ("cnn",)),
        ("stripes8-lcnet-e6", "lcnet_035", "stripes8", 6, ("cnn", "mobile")),
        ("stripes8-resnet-e2", "test_resnet", "stripes8", 2, ("cnn",)),
        ("random-resnet", "test_resnet", None, 0, ("cnn", "random")),
        ("random-vit", "test_vit", None, 0, ("vit", "random")),
        # many-class source heads (100 and 1,000 outputs), feature sizes 96 to 1,280
        ("stripes100-resnet-e3", "test_resnet", "stripes100", 3, ("cnn", "head100")),
        ("stripes100-mobilenetv3-e3", "mobilenetv3_small_050", "stripes100", 3, ("cnn", "head100")),
        ("fmnist1000-resnet-e3", "test_resnet", "fmnist1000", 3, ("cnn", "head1000")),
        ("fmnist1000-lcnet-e3", "lcnet_035", "fmnist1000", 3, ("cnn", "head1000")),
    )
)
RANDOM_HEAD = 10  # head size saved with randomly initialised models (replaced on transfer)


@lru_cache(maxsize=4)
def _source_data(name: str, fmnist: str, scale: float) -> tuple[np.ndarray, np.ndarray, list[str]]:
    return tasks.SOURCES[name][0](fmnist, scale)


def _save_checkpoint(model, path: Path) -> None:
    """Write via a temporary file so an interrupted build never leaves a half checkpoint."""
    tmp = path.with_suffix(".tmp")
    try:
        from zoopick.selection.zoo import save_checkpoint
    except ImportError:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    else:
        save_checkpoint(model, tmp)
    tmp.replace(path)


def pretrain_one(m: ZooModel, out: str, fmnist: str, scale: float, seed: int) -> dict:
    """Train (or just initialise) one zoo model and save its checkpoint. Runs in a worker."""
    import timm
    import torch

    setup_torch(1)
    start = time.perf_counter()
    model_seed = stable_seed(seed, m.id)
    info: dict = {"id": m.id}
    if m.source is None:
        torch.manual_seed(model_seed)
        model = timm.create_model(m.arch, pretrained=False, num_classes=RANDOM_HEAD)
    else:
        x, y, names = _source_data(m.source, fmnist, scale)
        torch.manual_seed(model_seed)
        model = timm.create_model(m.arch, pretrained=False, num_classes=len(names))
        xt, yt = to_tensor(x, MEAN, STD), torch.from_numpy(y).long()
        train(model, xt, yt, epochs=m.epochs, lr=PRETRAIN_LR, seed=model_seed, batch_size=64)
        with torch.no_grad():
            pred = torch.cat([model(xt[i : i + 512]).argmax(1) for i in range(0, len(yt), 512)])
        info["source_train_acc"] = float((pred == yt).float().mean())
    _save_checkpoint(model, Path(out) / "ckpt" / f"{m.id}.safetensors")
    info["seconds"] = time.perf_counter() - start
    return info


def manifest_entry(m: ZooModel) -> dict:
    if m.source is None:
        num_classes, source = RANDOM_HEAD, "random initialisation (seeded), no pretraining"
    else:
        num_classes = len(_source_names(m.source))
        source = f"{tasks.SOURCES[m.source][1]}, {m.epochs} epoch(s)"
    return {
        "id": m.id,
        "arch": m.arch,
        "weights": f"ckpt/{m.id}.safetensors",
        "num_classes": num_classes,
        "input_size": [3, tasks.SIZE, tasks.SIZE],
        "mean": MEAN,
        "std": STD,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "source": source,
        "tags": list(m.tags),
    }


def _source_names(name: str) -> list[str]:
    # class names do not depend on scale or path for procedural sources; fmnist6 is fixed too
    fixed = {
        "fmnist6": [tasks.FMNIST_CLASSES[c] for c in tasks.FMNIST_SOURCE_CLASSES],
        "shapes4": list(tasks.SOURCE_SHAPES),
        "stripes8": [str(i) for i in range(8)],
        "stripes100": [str(i) for i in range(100)],
        "fmnist1000": [str(i) for i in range(1000)],
    }
    return fixed[name]


def write_manifest(entries: list[dict], path: Path) -> None:
    try:
        from zoopick.selection.zoo import write_zoo
    except ImportError:
        path.write_text(json.dumps({"models": entries}, indent=1) + "\n")
    else:
        write_zoo(entries, path)


def write_targets(out: Path, fmnist: str, scale: float) -> dict[str, dict]:
    folder = out / "targets"
    folder.mkdir(parents=True, exist_ok=True)
    info = {}
    for name, (fn, desc) in tasks.TARGETS.items():
        paths = [folder / f"{name}-{split}.npz" for split in ("train", "test")]
        for p, (x, y, names) in zip(paths, fn(fmnist, scale), strict=True):
            # regenerated every time (seconds) and rewritten only when different, so a changed
            # generator can never leave a stale target behind
            if p.exists():
                with np.load(p) as old:
                    same = (
                        np.array_equal(old["x"], x)
                        and np.array_equal(old["y"], y)
                        and list(old["class_names"]) == list(names)
                    )
                if same:
                    continue
                print(f"  target {p.name} changed: rewriting")
            np.savez_compressed(p, x=x, y=y, class_names=np.array(names))
        sizes = []
        for p in paths:
            with np.load(p) as d:
                sizes.append(len(d["y"]))
                classes = len(d["class_names"])
        info[name] = {"description": desc, "classes": classes, "train": sizes[0], "test": sizes[1]}
    return info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmnist", default="../shared/datasets/fashion-mnist.npz")
    ap.add_argument("--out", default="benchmarks/transfer/zoo")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every image count")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", help="build only these model ids (default all)")
    args = ap.parse_args(argv)

    out = Path(args.out)
    settings = {
        "scale": args.scale,
        "seed": args.seed,
        "pretrain_lr": PRETRAIN_LR,
        "tasks_version": tasks.VERSION,
    }
    stamp = out / "build.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("settings") != settings:
        raise SystemExit(
            f"{out} was built with other settings ({stamp}); remove the folder to rebuild"
        )
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    targets = write_targets(out, args.fmnist, args.scale)
    t_targets = time.perf_counter() - started

    models = [m for m in ZOO if not args.only or m.id in args.only]
    todo = [m for m in models if not (out / "ckpt" / f"{m.id}.safetensors").exists()]
    print(f"{len(models) - len(todo)} of {len(models)} checkpoints exist; training {len(todo)}")
    log = json.loads(stamp.read_text()).get("models", {}) if stamp.exists() else {}
    call = (str(out), args.fmnist, args.scale, args.seed)
    if todo and args.jobs > 1:
        # longest first so the pool does not end on one straggler
        todo.sort(key=lambda m: -m.epochs)
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(pretrain_one, m, *call) for m in todo]
            for f in futures:
                info = f.result()
                log[info["id"]] = info
                print(f"  {info['id']}: {info['seconds']:.1f}s {info.get('source_train_acc', '')}")
    else:
        for m in todo:
            info = pretrain_one(m, *call)
            log[info["id"]] = info
            print(f"  {info['id']}: {info['seconds']:.1f}s {info.get('source_train_acc', '')}")

    built = [m for m in ZOO if (out / "ckpt" / f"{m.id}.safetensors").exists()]
    write_manifest([manifest_entry(m) for m in built], out / "zoo.json")
    stamp.write_text(
        json.dumps(
            {
                "settings": settings,
                "targets": targets,
                "models": log,
                "last_run_seconds": {
                    "targets": t_targets,
                    "total": time.perf_counter() - started,
                },
            },
            indent=1,
        )
        + "\n"
    )
    total = time.perf_counter() - started
    print(f"zoo of {len(built)} models and {len(targets)} targets in {out} ({total:.0f}s)")


if __name__ == "__main__":
    main()
