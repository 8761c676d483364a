"""A dataset's images decoded once and kept beside it, so every later reader skips the decode.

Loading an ImageFolder archive reads every member, hashes it and decodes it (to prove it is an
image); scoring then decodes each image again for the model's transform. A job scores N models,
each in its own task: N times the whole archive. :func:`write` decodes the images once, at
validation, into a folder of two files:

* ``pixels.npy``: every image's RGB pixels (what :meth:`TargetDataset.image` gives), one flat
  uint8 array, read memory-mapped (a task touches only the images it keeps);
* ``index.npz``: where each image starts and its shape, the labels, class names, member names,
  each file's sha256 and the dataset's digest.

:func:`load` gives back the same dataset (same labels, classes, pixels and digest, so the same
feature-cache keys and scores) without reading the archive or decoding an image; a
``max_per_class`` subset has the digest ``load_dataset`` would give it, computed from the stored
file hashes. Datasets whose images are arrays already (``.npz``) are not copied: reading them
decodes nothing.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from zoopick.selection.data import TargetDataset, _parallel, _subsample
from zoopick.selection.limits import DEFAULT_LIMITS, DatasetLimits

__all__ = ["DecodedImages", "load", "write"]

VERSION = 1
"""Bumped when what is stored changes; a copy of another version is not read (the caller falls
back to the file itself)."""
PIXELS = "pixels.npy"
INDEX = "index.npz"


class DecodedImages(Sequence[np.ndarray]):
    """Ragged RGB images in one flat (memory-mapped) uint8 array: item ``i`` is an (H, W, 3)
    view, no copy."""

    def __init__(self, pixels: np.ndarray, offsets: np.ndarray, shapes: np.ndarray) -> None:
        self.pixels, self.offsets, self.shapes = pixels, offsets, shapes

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.pixels[start:stop].reshape(tuple(int(v) for v in self.shapes[i]))


def _decoded_hw(dataset: TargetDataset, i: int) -> tuple[int, int]:
    """(height, width) of image ``i`` after decoding (EXIF orientation applied), from its
    header alone: the copy's size is planned before any pixel is decoded."""
    assert isinstance(dataset.images, list)
    with Image.open(io.BytesIO(dataset.images[i])) as img:
        w, h = img.size
        orientation = img.getexif().get(0x0112, 1) if hasattr(img, "getexif") else 1
    return (w, h) if orientation in (5, 6, 7, 8) else (h, w)


def write(dataset: TargetDataset, folder: str | Path, *, max_bytes: int | None) -> bool:
    """Decode every image of ``dataset`` once into ``folder`` (replaced atomically); returns
    False, writing nothing, for a dataset of arrays (nothing to decode) or one whose decoded
    pixels would be over ``max_bytes`` (None: no bound), planned from the image headers before
    any pixel is decoded."""
    if not isinstance(dataset.images, list) or not dataset.images:
        return False
    n = len(dataset.images)
    shapes = np.array([(*_decoded_hw(dataset, i), 3) for i in range(n)], dtype=np.int64)
    sizes = shapes.prod(axis=1)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(offsets[-1])
    if max_bytes is not None and total > max_bytes:
        return False
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.{uuid.uuid4().hex}.tmp")
    tmp.mkdir(parents=True)
    try:
        pixels = np.lib.format.open_memmap(tmp / PIXELS, mode="w+", dtype=np.uint8, shape=(total,))

        def one(i: int) -> None:
            arr = np.asarray(dataset.image(i), dtype=np.uint8)
            if arr.shape != tuple(shapes[i]):  # a header that lied about its size
                raise ValueError(f"image {i}: decoded {arr.shape}, header {tuple(shapes[i])}")
            pixels[offsets[i] : offsets[i + 1]] = arr.reshape(-1)

        _parallel(one, n)
        pixels.flush()
        if dataset._hashes is None or len(dataset._hashes) != n:
            dataset.compute_digest()  # fills the file hashes
        hashes = np.frombuffer(b"".join(dataset._hashes or []), dtype=np.uint8).reshape(n, 32)
        meta = {
            "version": VERSION,
            "name": dataset.name,
            "digest": dataset.digest,
            "class_names": list(dataset.class_names),
            "sources": list(dataset.sources or []),
        }
        with open(tmp / INDEX, "wb") as fh:
            np.savez(
                fh,
                meta=np.array(json.dumps(meta)),
                labels=np.asarray(dataset.labels, dtype=np.int64),
                offsets=offsets,
                shapes=shapes,
                hashes=hashes,
            )
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def _within(limits: DatasetLimits, n: int, shapes: np.ndarray, classes: int, total: int) -> bool:
    """Whether a stored copy still fits today's limits (they may have been lowered since it
    was made): one that does not is not read, and the loader refuses the file naming the
    limit."""
    pixels = int((shapes[:, 0] * shapes[:, 1]).max()) if n else 0
    checks = (
        (limits.max_members, n),
        (limits.max_pixels, pixels),
        (limits.max_classes, classes),
        (limits.max_total_bytes, total),
    )
    return all(limit is None or value <= limit for limit, value in checks)


def load(
    folder: str | Path,
    *,
    max_per_class: int | None = None,
    seed: int = 0,
    limits: DatasetLimits | None = None,
) -> TargetDataset | None:
    """The dataset :func:`write` kept in ``folder``, as ``load_dataset`` would give it with
    the same ``max_per_class`` and ``seed``; None where there is no usable copy (none, another
    version, damaged, or over ``limits``): the caller then reads the file itself."""
    folder = Path(folder)
    limits = limits or DEFAULT_LIMITS
    try:
        with np.load(folder / INDEX, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            labels, offsets = z["labels"], z["offsets"]
            shapes, hashes = z["shapes"], z["hashes"]
        if meta.get("version") != VERSION:
            return None
        pixels = np.load(folder / PIXELS, mmap_mode="r")
    except (OSError, KeyError, ValueError, EOFError):
        return None
    n = len(labels)
    names = [str(c) for c in meta["class_names"]]
    ok = (
        len(offsets) == n + 1
        and shapes.shape == (n, 3)
        and hashes.shape == (n, 32)
        and pixels.ndim == 1
        and len(pixels) == int(offsets[-1])
    )
    if not ok or not _within(limits, n, shapes, len(names), len(pixels)):
        return None
    ds = TargetDataset(
        str(meta["name"]),
        labels,
        names,
        str(meta["digest"]),
        DecodedImages(pixels, offsets, shapes),  # type: ignore[arg-type]
        [str(s) for s in meta["sources"]] or None,
        _hashes=[bytes(h) for h in hashes],
        limits=limits,
    )
    if max_per_class is None:
        return ds
    keep = _subsample(labels, names, max_per_class, seed)
    return ds if len(keep) == n else ds.subset(keep)
