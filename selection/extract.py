"""One forward pass per model over the target set: source logits and pre-logit features.

Every transferability metric needs one or both of these, so they come from the same pass:
``forward_features`` -> ``forward_head(pre_logits=True)`` (the features) -> the classifier
(the logits). Preprocessing follows the model's own timm eval data config (resize, centre
crop, normalise; no augmentation).

Two caches keep repeated work away:

* in process, the decoded, resized and cropped images of a dataset are kept as uint8 tensors
  (one byte a pixel) per (dataset digest, transform), so models sharing a data config decode
  the images once; normalisation is done per batch in float;
* on disk (when ``cache_dir`` is given), each model's outputs are stored as ``.npz`` keyed by
  the weights' digest, the dataset's digest and the transform, so scoring again with another
  metric costs no forward pass; behind it, a :class:`SharedCache` (the service's object store)
  gives every machine the outputs any machine computed: looked up on a local miss, handed each
  result computed here, under the same file name.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from zoopick.selection.data import DatasetError, TargetDataset, _parallel
from zoopick.selection.zoo import ZooEntry, ZooError

__all__ = [
    "MAX_LOGITS_BYTES",
    "Extraction",
    "SharedCache",
    "cache_key",
    "check_logits_size",
    "clear_preprocess_cache",
    "default_device",
    "extract",
    "normalise",
    "preprocess",
    "transform_key",
]

_CACHE_VERSION = 2
"""Bumped when decoding changes what a dataset's pixels are (2: EXIF orientation applied,
16-bit and float images scaled by their mode's range), so no cached output of the old pixels is
served."""
PREPROCESS_CACHE_ENTRIES = 4
PREPROCESS_CACHE_BYTES = 4 << 30
"""The in-process cache's default budget of decoded images (``preprocess``'s ``cache_bytes``;
the service's ``ZOOPICK_PREPROCESS_CACHE_BYTES``)."""
MAX_LOGITS_BYTES = 1 << 30
"""Most bytes of float32 source logits (images x the head's outputs x 4) one extraction may
produce by default (``extract``'s ``max_logits_bytes``; the service's
``ZOOPICK_MAX_LOGITS_BYTES``, 1 GiB). They are held in memory several times
over (per batch, concatenated, written to the feature cache, then read by the metrics, some in
float64) and stored in the cache, so a model over it is refused *before* the forward pass,
naming the model and the bound: a job skips it with that error instead of its worker running
out of memory. Registration caps a head at ``zoopick.selection.zoo.MAX_NUM_CLASSES``, but
the cost grows with the dataset too: 1 GiB holds 10,000 images at ImageNet-21k's 21,843
outputs, while a 100,000-output head reaches it at about 2,700 images."""


def _bound(value: int | None, default: int) -> int:
    """``value`` as the caller passed it (the service passes its settings), else the library's
    ``default``. The library reads no ``ZOOPICK_*`` variable: ``Settings`` declares and
    validates them, and the service hands their values down."""
    return default if value is None else value


@dataclass
class Extraction:
    """A model's outputs on a dataset. ``seconds`` is the forward time this call spent
    (0.0 when ``cached``, i.e. read from the disk cache)."""

    logits: np.ndarray  # float32 (n, C_s)
    features: np.ndarray  # float32 (n, D)
    seconds: float
    cached: bool


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------------
# preprocessing


def transform_key(data_config: Mapping[str, Any]) -> tuple[Any, ...]:
    """What determines the uint8 images: size, interpolation and crop (not normalisation)."""
    return (
        tuple(int(v) for v in data_config["input_size"]),
        str(data_config.get("interpolation", "bilinear")),
        float(data_config.get("crop_pct") or 0.875),
        str(data_config.get("crop_mode") or "center"),
    )


_PREPROCESSED: OrderedDict[tuple[str, tuple[Any, ...]], torch.Tensor] = OrderedDict()
_LOCK = threading.Lock()


def clear_preprocess_cache() -> None:
    with _LOCK:
        _PREPROCESSED.clear()


def _eval_transform(data_config: Mapping[str, Any]):
    from timm.data import create_transform

    size, interpolation, crop_pct, crop_mode = transform_key(data_config)
    return create_transform(
        input_size=size,
        interpolation=interpolation,
        crop_pct=crop_pct,
        crop_mode=crop_mode,
        is_training=False,
        normalize=False,  # ends in a uint8 CHW tensor; normalised per batch
    )


def preprocess(
    dataset: TargetDataset, data_config: Mapping[str, Any], *, cache_bytes: int | None = None
) -> torch.Tensor:
    """The dataset through the eval transform, without normalisation: uint8 (N, 3, H, W).

    Cached in process per (dataset digest, transform key); an array too large for the cache
    budget (``cache_bytes``, the service's ``ZOOPICK_PREPROCESS_CACHE_BYTES``; None:
    :data:`PREPROCESS_CACHE_BYTES`, 4 GiB) is returned but not kept.
    Callers must not modify the returned tensor.
    """
    key = (dataset.digest, transform_key(data_config))
    with _LOCK:
        hit = _PREPROCESSED.get(key)
        if hit is not None:
            _PREPROCESSED.move_to_end(key)
            return hit
    c, h, w = key[1][0]
    if c != 3:
        raise DatasetError(f"input_size {key[1][0]}: only 3-channel (RGB) models are supported")
    transform = _eval_transform(data_config)
    out = torch.empty((len(dataset), 3, h, w), dtype=torch.uint8)

    def one(i: int) -> None:
        t = transform(dataset.image(i))
        if t.shape != (3, h, w):  # a transform that does not end at input_size
            raise DatasetError(f"image {i}: transform gave shape {tuple(t.shape)}, not {(3, h, w)}")
        out[i] = t

    _parallel(one, len(dataset))
    budget = _bound(cache_bytes, PREPROCESS_CACHE_BYTES)
    if dataset.digest and out.numel() <= budget:
        with _LOCK:
            _PREPROCESSED[key] = out
            total = sum(t.numel() for t in _PREPROCESSED.values())
            while len(_PREPROCESSED) > 1 and (
                len(_PREPROCESSED) > PREPROCESS_CACHE_ENTRIES or total > budget
            ):
                _, dropped = _PREPROCESSED.popitem(last=False)
                total -= dropped.numel()
    return out


def normalise(
    x: torch.Tensor, data_config: Mapping[str, Any], device: torch.device | str
) -> torch.Tensor:
    """uint8 NCHW -> float, ``(x / 255 - mean) / std``: the same operations as timm's
    ToTensor + Normalize, so results match the PIL pipeline exactly."""
    mean = torch.tensor(data_config["mean"], dtype=torch.float32, device=device).view(1, -1, 1, 1)
    std = torch.tensor(data_config["std"], dtype=torch.float32, device=device).view(1, -1, 1, 1)
    return x.to(device, non_blocking=True).float().div_(255).sub_(mean).div_(std)


# --------------------------------------------------------------------------------------------
# the disk cache


def cache_key(
    entry: ZooEntry,
    dataset: TargetDataset,
    data_config: Mapping[str, Any],
    *,
    precision: str = "fp32",
) -> str:
    """Digest of everything the outputs depend on: weights, arch and head size, the dataset,
    the full transform (including normalisation) and the forward precision."""
    parts: dict[str, Any] = {
        "v": _CACHE_VERSION,
        "weights": entry.weights_digest(),
        "arch": entry.arch,
        "num_classes": entry.num_classes,
        "dataset": dataset.digest,
        "n": len(dataset),
        "transform": list(transform_key(data_config)),
        "mean": [float(v) for v in data_config["mean"]],
        "std": [float(v) for v in data_config["std"]],
        "precision": precision,
    }
    if not entry.is_checkpoint:  # hub and seeded-random weights come from timm's code
        import timm

        parts["timm"] = timm.__version__
    text = json.dumps(parts, sort_keys=True, default=list)
    return hashlib.sha256(text.encode()).hexdigest()


class SharedCache(Protocol):
    """A feature cache beyond this machine, behind ``cache_dir`` (the service's: objects of its
    store). Its own trouble is its own: a failed lookup is a miss, a failed keep is skipped, so
    scoring never fails for it. What it gives back is checked as a local file is."""

    def fetch(self, name: str, dest: Path) -> bool:
        """Copy the entry ``name`` to ``dest`` (written whole, then renamed); whether there was
        one."""

    def keep(self, name: str, path: Path) -> None:
        """Keep the file at ``path`` as the entry ``name``."""


def _read_cache(path: Path, key: str, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) != key:
                return None
            logits = z["logits"].astype(np.float32, copy=False)
            features = z["features"].astype(np.float32, copy=False)
    except (OSError, KeyError, ValueError, EOFError):
        return None  # missing or damaged: recompute (and overwrite)
    if logits.ndim != 2 or features.ndim != 2 or len(logits) != n or len(features) != n:
        return None
    return logits, features


def _write_cache(path: Path, key: str, logits: np.ndarray, features: np.ndarray, meta: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as fh:
            np.savez(fh, key=np.array(key), logits=logits, features=features, meta=json.dumps(meta))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------
# extraction


def _forward(
    model: torch.nn.Module,
    x: torch.Tensor,
    data_config: Mapping[str, Any],
    batch_size: int,
    device: torch.device,
) -> tuple[np.ndarray, np.ndarray]:
    cuda = device.type == "cuda"
    model.eval().to(device)
    if cuda:
        model.to(memory_format=torch.channels_last)
    classifier = model.get_classifier()
    linear_head = isinstance(classifier, torch.nn.Linear)
    logits, features = [], []
    with (
        torch.inference_mode(),
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda),
    ):
        for start in range(0, len(x), batch_size):
            xb = normalise(x[start : start + batch_size], data_config, device)
            if cuda:
                xb = xb.contiguous(memory_format=torch.channels_last)
            feats = model.forward_features(xb)
            pre = model.forward_head(feats, pre_logits=True)
            # a Linear head maps the pre-logits exactly as forward_head does; anything else
            # (distilled pairs, conv heads, Identity) goes through forward_head itself
            out = classifier(pre) if linear_head else model.forward_head(feats)
            features.append(pre.reshape(len(xb), -1).float().cpu())
            logits.append(out.reshape(len(xb), -1).float().cpu())
    return torch.cat(logits).numpy(), torch.cat(features).numpy()


def check_logits_size(entry: ZooEntry, n: int, *, max_logits_bytes: int | None = None) -> None:
    """Raise ``ZooError`` when ``entry``'s logits on ``n`` images would be over
    ``max_logits_bytes`` (the service's ``ZOOPICK_MAX_LOGITS_BYTES``; None:
    :data:`MAX_LOGITS_BYTES`). Checked before the model is built or a cached result read
    (both cost the same memory), from the manifest's ``num_classes`` alone."""
    bound = _bound(max_logits_bytes, MAX_LOGITS_BYTES)
    size = n * entry.num_classes * 4
    if size > bound:
        raise ZooError(
            f"model {entry.id!r}: its {entry.num_classes:,}-output head on {n:,} images would "
            f"give {size:,} bytes of float32 logits, over the bound of {bound:,} "
            "bytes (ZOOPICK_MAX_LOGITS_BYTES); score it on fewer images or raise the bound"
        )


def extract(
    entry: ZooEntry,
    dataset: TargetDataset,
    *,
    batch_size: int = 64,
    device: str | None = None,
    cache_dir: str | Path | None = None,
    model: torch.nn.Module | None = None,
    max_logits_bytes: int | None = None,
    preprocess_cache_bytes: int | None = None,
    shared_cache: SharedCache | None = None,
) -> Extraction:
    """Source logits and pre-logit features of ``entry``'s model on ``dataset``.

    With ``cache_dir``, a stored result for the same weights, dataset and transform is
    returned without building the model or decoding an image; with ``shared_cache`` too, a
    result another machine kept there is (fetched into ``cache_dir`` first), and a result
    computed here is kept there. ``model``, when given, must be
    ``entry``'s model with its source weights (it saves rebuilding; it is moved to ``device``).
    ``max_logits_bytes`` (:func:`check_logits_size`) and ``preprocess_cache_bytes``
    (:func:`preprocess`'s ``cache_bytes``) are the caller's bounds, the service's settings.
    """
    if len(dataset) == 0:
        raise DatasetError(f"dataset {dataset.name!r} is empty")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    check_logits_size(entry, len(dataset), max_logits_bytes=max_logits_bytes)
    dev = torch.device(device or default_device())
    precision = "bf16" if dev.type == "cuda" else "fp32"
    data_config = entry.data_config(model)
    path = key = None
    if cache_dir is not None:
        key = cache_key(entry, dataset, data_config, precision=precision)
        path = Path(cache_dir).expanduser() / f"{key}.npz"
        hit = _read_cache(path, key, len(dataset))
        if hit is None and shared_cache is not None and shared_cache.fetch(path.name, path):
            hit = _read_cache(path, key, len(dataset))
        if hit is not None:
            return Extraction(hit[0], hit[1], 0.0, True)
    x = preprocess(dataset, data_config, cache_bytes=preprocess_cache_bytes)
    if model is None:
        model = entry.create_model()
    start = time.perf_counter()
    logits, features = _forward(model, x, data_config, batch_size, dev)
    seconds = time.perf_counter() - start
    if path is not None and key is not None:
        meta = {
            "model": entry.id,
            "arch": entry.arch,
            "dataset": dataset.name,
            "dataset_digest": dataset.digest,
            "precision": precision,
        }
        _write_cache(path, key, logits, features, meta)
        if shared_cache is not None:
            shared_cache.keep(path.name, path)
    return Extraction(logits, features, seconds, False)
