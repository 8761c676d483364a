"""Build one of the transfer suite's model zoos and its target datasets, deterministically.

No hub weights exist on the benchmark machine, so each zoo is made here from its spec in
``zoos.py``: small timm architectures pretrained for different lengths on different source
tasks (``tasks.SOURCES``: Fashion-MNIST classes, procedural shapes and gratings, glyphs from
bundled fonts, fractals, dead leaves, 1/f noise, a photo's rotations) or left at a seeded random
initialisation. Their transferability to the targets (``tasks.TARGETS``) therefore genuinely
differs, by source relevance, training length and architecture.

Writes into ``--out``: ``ckpt/<id>.safetensors``, ``zoo.json`` (the manifest
``zoopick.selection.zoo`` reads), ``targets/<name>-{train,test}.npz`` (x, y, class_names; every
zoo gets every target) and ``build.json`` (settings and timings). Work already done with the
same settings is skipped.

    python benchmarks/transfer/build_zoo.py --fmnist ../shared/datasets/fashion-mnist.npz
    python benchmarks/transfer/build_zoo.py --zoo fonts --jobs 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from multiprocessing import get_context
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from benchmarks.transfer import tasks, zoos  # noqa: E402
from benchmarks.transfer.finetune_gt import (  # noqa: E402
    environment,
    setup_torch,
    stable_seed,
    to_tensor,
    train,
)
from benchmarks.transfer.zoos import ZooModel, ZooSpec  # noqa: E402

MEAN = STD = [0.5, 0.5, 0.5]
PRETRAIN_LR = 3e-3

PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "1"}
"""The environment of every build process, so that any x86-64 machine with AVX2 builds the
same bytes. Why: a build is seeded and single-threaded, but torch picks its CPU kernels by
the machine's vector width (ATen's AVX2 or AVX-512 loops sum in different orders) and MKL
its code path by CPU (the random ViT's initialisation alone differed between two machines);
checkpoints made on one session's machine were not the next one's, so ground truth keyed by
their sha256 could not carry over. ``ATEN_CPU_CAPABILITY`` pins ATen's loops, ``MKL_CBWR``
MKL's (its documented conditional numerical reproducibility), and oneDNN, whose convolution
blocking also follows the cache sizes, is not used (``torch.backends.mkldnn``): about 2x
the build time, paid once a session. Checked on one machine: pinned builds are identical
whatever ``MKL_ENABLE_INSTRUCTIONS`` allows, unpinned ones change with the vector width."""
PORTABLE = "aten-avx2+mkl-cbwr-avx2+no-onednn"


ZOO: tuple[ZooModel, ...] = zoos.BASE.models  # the first zoo (older callers import ZOO)
RANDOM_HEAD = 10  # head size saved with randomly initialised models (replaced on transfer)


@lru_cache(maxsize=4)
def _source_data(
    name: str, fmnist: str, scale: float, size: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    x, y, names = tasks.SOURCES[name][0](fmnist, scale, size)
    if x.shape[1:3] != (size, size):
        raise ValueError(f"source {name!r} draws {x.shape[1:3]} images, the model wants {size}")
    return x, y, names


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
    torch.backends.mkldnn.enabled = False  # see PORTABLE_ENV
    start = time.perf_counter()
    model_seed = stable_seed(seed, m.id)
    info: dict = {"id": m.id, "spec": checkpoint_spec(m)}
    if m.source is None:
        torch.manual_seed(model_seed)
        model = timm.create_model(m.arch, pretrained=False, num_classes=RANDOM_HEAD)
    else:
        x, y, names = _source_data(m.source, fmnist, scale, m.size)
        torch.manual_seed(model_seed)
        model = timm.create_model(m.arch, pretrained=False, num_classes=len(names))
        xt, yt = to_tensor(x, MEAN, STD), torch.from_numpy(y).long()
        train(model, xt, yt, epochs=m.epochs, lr=PRETRAIN_LR, seed=model_seed, batch_size=64)
        with torch.no_grad():
            pred = torch.cat([model(xt[i : i + 512]).argmax(1) for i in range(0, len(yt), 512)])
        info["source_train_acc"] = float((pred == yt).float().mean())
        info["num_classes"] = len(names)
    _save_checkpoint(model, Path(out) / "ckpt" / f"{m.id}.safetensors")
    info["seconds"] = time.perf_counter() - start
    return info


def checkpoint_spec(m: ZooModel) -> dict:
    """What a checkpoint was built from (JSON-able), kept in build.json to catch a changed
    spec behind an unchanged id."""
    return {"arch": m.arch, "source": m.source, "epochs": m.epochs, "size": m.size}


def manifest_entry(m: ZooModel, built: dict | None = None) -> dict:
    """The model's manifest entry; ``built`` is its build.json record (the head size the
    checkpoint really has, which a small ``--scale`` can change)."""
    if m.source is None:
        num_classes, source = RANDOM_HEAD, "random initialisation (seeded), no pretraining"
    else:
        num_classes = (built or {}).get("num_classes", tasks.SOURCE_CLASSES[m.source])
        source = f"{tasks.SOURCES[m.source][1]}, {m.epochs:g} epoch(s)"
    return {
        "id": m.id,
        "arch": m.arch,
        "weights": f"ckpt/{m.id}.safetensors",
        "num_classes": num_classes,
        "input_size": [3, m.size, m.size],
        "mean": MEAN,
        "std": STD,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "source": source,
        "tags": list(m.tags),
    }


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
                shape = d["x"].shape
        info[name] = {
            "description": desc,
            "classes": classes,
            "train": sizes[0],
            "test": sizes[1],
            "size": int(shape[1]),
            "colour": len(shape) == 4,
        }
    return info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default="base", choices=sorted(zoos.ZOOS), help="which zoo spec")
    ap.add_argument("--fmnist", default="../shared/datasets/fashion-mnist.npz")
    ap.add_argument("--out", help="default: benchmarks/transfer/zoo (base), else zoos/<name>")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every image count")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", help="build only these model ids (default all)")
    args = ap.parse_args(argv)
    build(
        zoos.ZOOS[args.zoo],
        Path(args.out or default_out(args.zoo)),
        fmnist=args.fmnist,
        scale=args.scale,
        jobs=args.jobs,
        seed=args.seed,
        only=args.only,
    )


def default_out(zoo: str) -> Path:
    """Where a zoo is built unless told: the first zoo keeps its old folder."""
    root = Path("benchmarks/transfer")
    return root / "zoo" if zoo == "base" else root / "zoos" / zoo


def build_settings(spec: ZooSpec, *, scale: float = 1.0, seed: int = 0) -> dict:
    """What every file of a build of ``spec`` depends on besides the models' own specs
    (``checkpoint_spec``): kept in build.json, where a folder built otherwise is refused."""
    settings = {
        "scale": scale,
        "seed": seed,
        "pretrain_lr": PRETRAIN_LR,
        "tasks_version": tasks.VERSION,
        "portable": PORTABLE,
    }
    if spec.name != "base":  # the first zoo's stamps predate zoo names
        settings["zoo"] = spec.name
    return settings


def build(
    spec: ZooSpec,
    out: Path,
    *,
    fmnist: str,
    scale: float = 1.0,
    jobs: int = 2,
    seed: int = 0,
    only: list[str] | None = None,
) -> dict:
    """Build (or finish building) ``spec`` into ``out``: targets, checkpoints, manifest,
    build.json. Returns build.json's content."""
    settings = build_settings(spec, scale=scale, seed=seed)
    stamp = out / "build.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("settings") != settings:
        raise SystemExit(
            f"{out} was built with other settings ({stamp}); remove the folder to rebuild"
        )
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    targets = write_targets(out, fmnist, scale)
    t_targets = time.perf_counter() - started

    unknown = sorted(set(only or ()) - {m.id for m in spec.models})
    if unknown:
        raise SystemExit(f"zoo {spec.name!r} has no models {unknown}")
    models = [m for m in spec.models if not only or m.id in only]
    log = json.loads(stamp.read_text()).get("models", {}) if stamp.exists() else {}
    todo = []
    for m in models:
        path = out / "ckpt" / f"{m.id}.safetensors"
        recorded = log.get(m.id, {}).get("spec")
        if path.exists() and recorded not in (None, checkpoint_spec(m)):  # None: built before specs
            print(f"  {m.id}: its spec changed since it was built ({recorded}): retraining")
            path.unlink()
        if not path.exists():
            todo.append(m)
    print(f"{len(models) - len(todo)} of {len(models)} checkpoints exist; training {len(todo)}")
    call = (str(out), fmnist, scale, seed)
    if todo:
        # fresh processes, even for one job: PORTABLE_ENV must be set before torch loads;
        # longest first so the pool does not end on one straggler
        todo.sort(key=lambda m: -m.epochs * m.size**2)
        with (
            environment(**PORTABLE_ENV),
            ProcessPoolExecutor(max(1, jobs), mp_context=get_context("spawn")) as pool,
        ):
            futures = [pool.submit(pretrain_one, m, *call) for m in todo]
            for f in futures:
                info = f.result()
                log[info["id"]] = info
                print(f"  {info['id']}: {info['seconds']:.1f}s {info.get('source_train_acc', '')}")

    built = [m for m in spec.models if (out / "ckpt" / f"{m.id}.safetensors").exists()]
    write_manifest([manifest_entry(m, log.get(m.id)) for m in built], out / "zoo.json")
    record = {
        "settings": settings,
        "targets": targets,
        "models": log,
        "last_run_seconds": {"targets": t_targets, "total": time.perf_counter() - started},
    }
    stamp.write_text(json.dumps(record, indent=1) + "\n")
    total = time.perf_counter() - started
    print(f"zoo of {len(built)} models and {len(targets)} targets in {out} ({total:.0f}s)")
    return record


if __name__ == "__main__":
    main()
