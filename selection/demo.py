"""A small demo zoo and target dataset, built on the spot, so a new user sees a real ranking
without downloading anything.

The target is a procedural shapes task. The zoo holds tiny timm models that are briefly
pretrained here on different procedural source tasks (a related shapes task, an unrelated
stripes task) or left at random initialisation, so their transferability genuinely differs.
Everything is seeded: the same call builds the same checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SIZE = 32
SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond")


def _shape_mask(kind: str, cx: float, cy: float, r: float, size: int = SIZE) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    dx, dy = xx - cx, yy - cy
    if kind == "circle":
        return dx**2 + dy**2 <= r**2
    if kind == "ring":
        d = np.sqrt(dx**2 + dy**2)
        return (d <= r) & (d >= 0.6 * r)
    if kind == "square":
        return (np.abs(dx) <= r * 0.85) & (np.abs(dy) <= r * 0.85)
    if kind == "diamond":
        return np.abs(dx) + np.abs(dy) <= r
    if kind == "triangle":
        return (dy <= r * 0.8) & (dy >= -r) & (np.abs(dx) <= (dy + r) * 0.55)
    if kind == "cross":
        w = r * 0.3
        return ((np.abs(dx) <= w) & (np.abs(dy) <= r)) | ((np.abs(dy) <= w) & (np.abs(dx) <= r))
    raise ValueError(f"unknown shape {kind!r}")


def shapes(
    classes: tuple[str, ...], per_class: int, seed: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Grey shapes at random position, size and brightness on a noisy background."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for label, kind in enumerate(classes):
        for _ in range(per_class):
            r = rng.uniform(6, 11)
            cx, cy = rng.uniform(r, SIZE - r, size=2)
            img = rng.normal(40, 20, (SIZE, SIZE))
            img[_shape_mask(kind, cx, cy, r)] = rng.uniform(150, 255)
            xs.append(np.clip(img, 0, 255).astype(np.uint8))
            ys.append(label)
    return np.stack(xs), np.array(ys, dtype=np.int64), list(classes)


def stripes(n_orientations: int, per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sinusoidal gratings; the class is the orientation. Texture, not shape: a poor source
    for the shapes target."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    xs, ys = [], []
    for label in range(n_orientations):
        theta = np.pi * label / n_orientations
        for _ in range(per_class):
            freq = rng.uniform(0.15, 0.5)
            phase = rng.uniform(0, 2 * np.pi)
            wave = np.sin(freq * (xx * np.cos(theta) + yy * np.sin(theta)) + phase)
            img = 128 + 100 * wave + rng.normal(0, 20, (SIZE, SIZE))
            xs.append(np.clip(img, 0, 255).astype(np.uint8))
            ys.append(label)
    return np.stack(xs), np.array(ys, dtype=np.int64)


def _pretrain(arch: str, x: np.ndarray, y: np.ndarray, epochs: int, seed: int):
    import timm
    import torch

    torch.manual_seed(seed)
    model = timm.create_model(arch, num_classes=int(y.max()) + 1)
    xt = torch.from_numpy(x).float().div(255).sub(0.5).div(0.5).unsqueeze(1).repeat(1, 3, 1, 1)
    yt = torch.from_numpy(y)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(yt), generator=gen).split(32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            opt.step()
    return model.eval()


# id, arch, source task, epochs
DEMO_MODELS = (
    ("shapes6-resnet", "test_resnet", "shapes6", 3),
    ("shapes6-efficientnet", "test_efficientnet", "shapes6", 1),
    ("stripes8-resnet", "test_resnet", "stripes8", 3),
    ("random-vit", "test_vit", None, 0),
)


def build_demo(folder: str | Path, *, per_class: int = 30) -> tuple[Path, Path]:
    """Write ``zoo.json`` (+ checkpoints) and ``target.npz`` into ``folder``; reuse what is
    already there. Returns (manifest path, dataset path)."""
    from zoopick.selection.zoo import save_checkpoint, write_zoo

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "target.npz"
    if not target.exists():
        # the target: 4 of the shapes, fresh samples (a different seed from the source task)
        x, y, names = shapes(("circle", "square", "triangle", "cross"), per_class, seed=1)
        np.savez_compressed(target, x=x, y=y, class_names=np.array(names))
    sources = {
        "shapes6": lambda: shapes(SHAPES, 60, seed=2)[:2],
        "stripes8": lambda: stripes(8, 45, seed=3),
    }
    entries = []
    for model_id, arch, source, epochs in DEMO_MODELS:
        entry = {
            "id": model_id,
            "arch": arch,
            "input_size": [3, SIZE, SIZE],
            "mean": [0.5] * 3,
            "std": [0.5] * 3,
            "interpolation": "bilinear",
            "crop_pct": 1.0,
        }
        if source is None:
            entry.update(weights="none", num_classes=10, source="random initialisation")
        else:
            x, y = sources[source]()
            ckpt = folder / f"{model_id}.safetensors"
            if not ckpt.exists():
                save_checkpoint(_pretrain(arch, x, y, epochs, seed=7), ckpt)
            entry.update(
                weights=ckpt.name,
                num_classes=int(y.max()) + 1,
                source=f"procedural {source}, {epochs} epoch(s)",
            )
        entries.append(entry)
    manifest = folder / "zoo.json"
    write_zoo(entries, manifest)
    (folder / "README.txt").write_text(
        "zoopick demo zoo, built by `zoopick demo`.\n" + json.dumps(DEMO_MODELS, indent=1) + "\n"
    )
    return manifest, target
