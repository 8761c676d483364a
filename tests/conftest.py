"""Shared fixtures: a tiny target dataset (npz and ImageFolder) and a tiny zoo.

The expensive parts are built once per session into a read-only master copy; each test gets a
fresh copy under its own ``tmp_path``, so tests may write next to the files (caches, extra
manifests) without affecting each other.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # Triton runs in one mode per process, fixed when it is first imported (some test modules
    # import it indirectly, through torch or timm): without CUDA only its interpreter can run
    # the fused kernels that tests/test_comm_triton.py checks, so choose it before any import
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_CLASSES = ("dark", "mid", "bright")
TINY_PER_CLASS = 8
TINY_SIZE = 28
# arch, num_classes: small random-weight timm test models at 32x32
TINY_ZOO_MODELS = (
    ("tiny-resnet", "test_resnet", 10),
    ("tiny-vit", "test_vit", 5),
    ("tiny-efficientnet", "test_efficientnet", 8),
)


def tiny_arrays(
    per_class: int = TINY_PER_CLASS, size: int = TINY_SIZE, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """x uint8 (N, size, size) grayscale, y int64, class names: class k has mean brightness
    about 50 + 75 k plus noise and a class-specific bright square, so classes are separable."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for k in range(len(TINY_CLASSES)):
        img = rng.normal(50 + 75 * k, 12, size=(per_class, size, size))
        img[:, 4 * k + 2 : 4 * k + 8, 4 * k + 2 : 4 * k + 8] += 60
        xs.append(np.clip(img, 0, 255).astype(np.uint8))
        ys.append(np.full(per_class, k, dtype=np.int64))
    # interleave the classes so that order is not class-major
    x, y = np.concatenate(xs), np.concatenate(ys)
    order = np.argsort(np.arange(len(y)) % per_class, kind="stable")
    return x[order], y[order], list(TINY_CLASSES)


def write_imagefolder(root: Path, x: np.ndarray, y: np.ndarray, names: list[str]) -> Path:
    """One sub-folder per class of PNG files."""
    from PIL import Image

    for i, (img, label) in enumerate(zip(x, y, strict=True)):
        folder = root / names[label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"img{i:03d}.png")
    return root


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)
    return dst


@pytest.fixture(scope="session")
def _tiny_master(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-master")
    x, y, names = tiny_arrays()
    npz = root / "tiny.npz"
    np.savez_compressed(npz, x=x, y=y, class_names=np.array(names))
    folder = write_imagefolder(root / "tiny_images", x, y, names)
    return {"npz": npz, "folder": folder}


@pytest.fixture(scope="session")
def _tiny_zoo_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import timm
    import torch

    from zoopick.selection.zoo import save_checkpoint, write_zoo

    root = tmp_path_factory.mktemp("tiny-zoo-master") / "tiny_zoo"
    entries = []
    for i, (model_id, arch, num_classes) in enumerate(TINY_ZOO_MODELS):
        torch.manual_seed(100 + i)
        model = timm.create_model(arch, pretrained=False, num_classes=num_classes)
        save_checkpoint(model, root / "ckpt" / f"{model_id}.safetensors")
        entries.append(
            {
                "id": model_id,
                "arch": arch,
                "weights": f"ckpt/{model_id}.safetensors",
                "num_classes": num_classes,
                "input_size": [3, 32, 32],
                "mean": [0.5, 0.5, 0.5],
                "std": [0.5, 0.5, 0.5],
                "interpolation": "bilinear",
                "crop_pct": 1.0,
                "source": f"random init (seed {100 + i})",
                "tags": ["test"],
            }
        )
    write_zoo(entries, root / "zoo.json")
    return root


@pytest.fixture
def tiny_npz(_tiny_master: dict[str, Path], tmp_path: Path) -> Path:
    """An .npz (x uint8 (24, 28, 28) grayscale, y, class_names dark/mid/bright; 8 a class,
    classes differ in mean brightness)."""
    return _copy(_tiny_master["npz"], tmp_path)


@pytest.fixture
def tiny_imagefolder(_tiny_master: dict[str, Path], tmp_path: Path) -> Path:
    """The ``tiny_npz`` images as an ImageFolder directory of PNGs (dark/, mid/, bright/)."""
    return _copy(_tiny_master["folder"], tmp_path)


@pytest.fixture
def tiny_zoo(_tiny_zoo_master: Path, tmp_path: Path) -> Path:
    """Path of a zoo manifest (zoo.json) with 3 random-weight models at 32x32: tiny-resnet
    (test_resnet, 10 classes), tiny-vit (test_vit, 5), tiny-efficientnet (test_efficientnet,
    8); safetensors checkpoints under ckpt/ next to it, referenced by relative paths."""
    return _copy(_tiny_zoo_master, tmp_path) / "zoo.json"


# -- parallel runs (pytest-xdist, ``--dist loadgroup``) ----------------------------------------

SHARED_STACKS = {"live_server": "live-stack", "cluster": "ray-cluster", "s3_server": "s3-store"}
"""Session- or package-scoped fixtures that start real processes (a live zoopick stack, a Ray
cluster, an S3 server): every module that uses one runs on the same xdist worker, which starts
it once."""


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test an ``xdist_group``: its module, or the shared stack its module uses.

    A module stays on one worker (its module-scoped stacks and memoised launches are started
    once), and the modules of a shared stack share a worker. Without ``-n`` the marks change
    nothing."""
    by_module: dict[str, str] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        shared = [g for f, g in SHARED_STACKS.items() if f in getattr(item, "fixturenames", ())]
        if shared:
            by_module[module] = shared[0]
        else:
            by_module.setdefault(module, module)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(by_module[item.nodeid.split("::", 1)[0]]))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        groups: dict[str, list[pytest.Item]] = {}
        for item in items:
            groups.setdefault(by_module[item.nodeid.split("::", 1)[0]], []).append(item)
        items[:] = [item for group in sorted(groups, key=lambda g: _rank(g, groups[g]))
                    for item in groups[group]]  # fmt: skip


STACK_ORDER = ("ray-cluster", "s3-store", "live-stack")
"""The shared stacks from the longest (the Ray group: minutes of runs on the cluster)."""


def _rank(group: str, items: list[pytest.Item]) -> tuple[int, int, int]:
    """The order xdist hands the groups out in (``--dist loadgroup`` gives a worker the next
    group when it is nearly done, in the order of the collection): the longest first, so
    that what is left for the end are short modules that the two workers share out evenly,
    not a minutes-long one that keeps one worker busy while the other has ended. The shared
    stacks, then the modules of tests/service (each starts real processes), then the other
    modules, most tests first (xdist's own order, which ``pytest_configure`` turns off)."""
    if group in STACK_ORDER:
        return (0, STACK_ORDER.index(group), 0)
    if group.startswith("tests/service/"):
        return (1, 0, 0)
    return (2, 0, -len(items))


def pytest_configure(config: pytest.Config) -> None:
    # xdist's --loadscope-reorder (on by default) would sort the groups by their number of
    # tests, putting a module of one long test last: keep the order chosen above
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
