"""Small datasets made on the spot for the service tests (numpy + PIL, no downloads)."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image


def npz_bytes(n_per_class: int = 6, classes: int = 3, size: int = 16, seed: int = 0) -> bytes:
    """Grey images whose brightness depends on the class (so scores are not all equal)."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for c in range(classes):
        base = 40 + 180 * c / max(1, classes - 1)
        xs.append(np.clip(rng.normal(base, 20, (n_per_class, size, size)), 0, 255))
        ys += [c] * n_per_class
    buf = io.BytesIO()
    np.savez(buf, x=np.concatenate(xs).astype(np.uint8), y=np.array(ys, dtype=np.int64))
    return buf.getvalue()


def imagefolder_pngs(n_per_class: int = 4, classes=("cat", "dog"), size: int = 12):
    """(path, PNG bytes) of an ImageFolder: ``class/i.png``, each class tinted its own colour."""
    rng = np.random.default_rng(1)
    for c, name in enumerate(classes):
        for i in range(n_per_class):
            img = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            img[..., c % 3] = 255
            png = io.BytesIO()
            Image.fromarray(img).save(png, format="PNG")
            yield f"{name}/{i}.png", png.getvalue()


def imagefolder_zip_bytes(n_per_class: int = 4, classes=("cat", "dog"), size: int = 12) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path, png in imagefolder_pngs(n_per_class, classes, size):
            zf.writestr(path, png)
    return buf.getvalue()


def imagefolder_tar_bytes(compression: str = "xz") -> bytes:
    """The ImageFolder of :func:`imagefolder_zip_bytes` as a tar (``compression``: gz, bz2,
    xz or "" for none)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compression}") as tf:
        for path, png in imagefolder_pngs():
            member = tarfile.TarInfo(path)
            member.size = len(png)
            tf.addfile(member, io.BytesIO(png))
    return buf.getvalue()


def not_a_dataset_zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("README.txt", "this archive holds no images")
    return buf.getvalue()


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
