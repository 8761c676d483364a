"""The plain training loop shared by zoo pretraining and ground-truth fine-tuning.

Ground truth follows the LogME/SFDA protocol scaled down: *full* fine-tuning (every layer, a
fresh head) for a fixed number of epochs at each learning rate of a small grid; the model's
score is its best test accuracy over the grid. Images are preprocessed exactly as the ranking
side sees them (already 32x32, so the resize is the identity; scale to [0, 1]; normalise with
the entry's mean/std; grey replicated to RGB). Everything is seeded and runs on one CPU thread
so results do not depend on how many worker processes share the machine.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def stable_seed(*parts: object) -> int:
    """A seed derived from names (CRC32), identical across processes and Python runs."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """``values`` in ``os.environ`` while the block runs (what child processes inherit)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def setup_torch(threads: int = 1, device: str = "cpu") -> None:
    """One thread, deterministic kernels. On CUDA some kernels have no deterministic form, so
    there it only warns (a GPU run is repeatable up to those; its records say the device)."""
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True)


def to_tensor(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 (N,H,W) or (N,H,W,3) -> normalised float (N,3,H,W)."""
    t = torch.from_numpy(np.ascontiguousarray(x)).float().div_(255)
    t = t.unsqueeze(1).expand(-1, 3, -1, -1) if t.ndim == 3 else t.permute(0, 3, 1, 2)
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return ((t - m) / s).contiguous()


def _batches(n: int, batch_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    """A seeded shuffle split into batches; a last batch of one joins the previous one
    (batch norm cannot train on a single sample)."""
    parts = list(torch.randperm(n, generator=gen).split(batch_size))
    if len(parts) > 1 and len(parts[-1]) < 2:
        parts[-2] = torch.cat([parts[-2], parts.pop()])
    return parts


def train(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: float,
    lr: float,
    seed: int,
    batch_size: int = 32,
    weight_decay: float = 0.0,
    device: str = "cpu",
) -> torch.nn.Module:
    """Adam + cross-entropy with a cosine learning-rate decay over all steps. ``epochs`` may
    be fractional (the last epoch is cut short). Batches are drawn on the CPU (the same
    order whatever the device) and moved to ``device``."""
    model.to(device)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout / drop-path draws
    steps_per_epoch = len(_batches(len(y), batch_size, torch.Generator().manual_seed(0)))
    total = max(1, round(epochs * steps_per_epoch))
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    )
    model.train()
    step = 0
    while step < total:
        for idx in _batches(len(y), batch_size, gen):
            if step >= total:
                break
            loss = F.cross_entropy(model(x[idx].to(device)), y[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
    return model.eval()


@torch.no_grad()
def accuracy(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = 256,
    device: str = "cpu",
) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(y), batch_size):
        pred = model(x[i : i + batch_size].to(device)).argmax(1).cpu()
        correct += int((pred == y[i : i + batch_size]).sum())
    return correct / len(y)


# --------------------------------------------------------------------------------------------
# zoo entries: create a model from a manifest entry


def create_from_entry(entry: Mapping[str, Any], root: Path, num_classes: int) -> torch.nn.Module:
    """Build the entry's architecture, load its source weights, and put a fresh
    ``num_classes`` head on it (the caller seeds torch first, so the head is deterministic).

    Uses ``zoopick.selection.zoo`` when it is available, so ground truth sees the same model the
    ranking side extracts from; otherwise timm + safetensors directly (same result).
    """
    try:
        from zoopick.selection.zoo import load_zoo  # noqa: F401  (presence check only)
    except ImportError:
        return _create_plain(entry, root, num_classes)
    return _create_with_zoo(entry, root, num_classes)


def _create_plain(entry: Mapping[str, Any], root: Path, num_classes: int) -> torch.nn.Module:
    import timm
    from safetensors.torch import load_file

    model = timm.create_model(entry["arch"], pretrained=False, num_classes=entry["num_classes"])
    if entry["weights"] != "none":
        model.load_state_dict(load_file(str(root / entry["weights"])))
    model.reset_classifier(num_classes)
    return model


_ZOO_CACHE: dict[Path, Any] = {}


def _zoo_entry(root: Path, model_id: str) -> Any:
    from zoopick.selection.zoo import load_zoo

    manifest = root / "zoo.json"
    if manifest not in _ZOO_CACHE:
        _ZOO_CACHE[manifest] = {e.id: e for e in load_zoo(manifest)}
    return _ZOO_CACHE[manifest][model_id]


def _create_with_zoo(entry: Mapping[str, Any], root: Path, num_classes: int) -> torch.nn.Module:
    return _zoo_entry(root, entry["id"]).create_model(num_classes=num_classes)


def model_inputs(
    entry: Mapping[str, Any], root: Path, model: torch.nn.Module, split: Mapping[str, np.ndarray]
) -> torch.Tensor:
    """A split's images as the model sees them, normalised (N, 3, H, W) float. Images already
    at the model's input size with crop_pct 1 pass through unchanged (the eval transform is
    the identity then: the first zoo's case, bit for bit as before); others go through
    zoopick's own eval transform (``selection.extract.preprocess``), as the ranking side and
    the service's trainer resize them."""
    x = split["x"]
    mean, std = entry.get("mean", [0.5] * 3), entry.get("std", [0.5] * 3)
    size = entry.get("input_size")
    if size is None or (tuple(x.shape[1:3]) == tuple(size[1:]) and entry.get("crop_pct") == 1.0):
        return to_tensor(x, mean, std)
    from zoopick.selection.data import TargetDataset
    from zoopick.selection.extract import normalise, preprocess

    cfg = _zoo_entry(root, entry["id"]).data_config(model)
    data = TargetDataset.from_arrays(x, split["y"], [str(c) for c in split["class_names"]])
    return normalise(preprocess(data, cfg), cfg, "cpu")


def load_target(folder: Path, name: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    with np.load(folder / "targets" / f"{name}-train.npz") as tr:
        train = {k: tr[k] for k in tr.files}
    with np.load(folder / "targets" / f"{name}-test.npz") as te:
        test = {k: te[k] for k in te.files}
    return train, test


def finetune(
    entry: Mapping[str, Any],
    root: Path,
    train_set: Mapping[str, np.ndarray],
    test_set: Mapping[str, np.ndarray],
    *,
    lr: float,
    epochs: float,
    seed: int,
    batch_size: int = 32,
    device: str = "cpu",
) -> float:
    """Fully fine-tune one zoo model on one target at one learning rate; test accuracy."""
    num_classes = len(train_set["class_names"])
    torch.manual_seed(seed)
    model = create_from_entry(entry, root, num_classes)
    xtr, ytr = model_inputs(entry, root, model, train_set), torch.from_numpy(train_set["y"]).long()
    xte, yte = model_inputs(entry, root, model, test_set), torch.from_numpy(test_set["y"]).long()
    train(model, xtr, ytr, epochs=epochs, lr=lr, seed=seed, batch_size=batch_size, device=device)
    return accuracy(model, xte, yte, device=device)


def read_manifest(root: Path) -> list[dict[str, Any]]:
    return json.loads((root / "zoo.json").read_text())["models"]
