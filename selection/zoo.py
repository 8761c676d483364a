"""The model zoo: a manifest (JSON, or YAML by extension) listing timm models to rank.

Each entry names a timm architecture, where its source weights come from (a local checkpoint,
timm's hub weights, or a seeded random initialisation), the size of its source head and,
optionally, data-config overrides (input size, normalisation, interpolation, crop). Loading a
manifest validates everything that can be checked cheaply *before* any forward pass, so a typo
in entry 37 fails in a second instead of after 36 models were scored.

Only the checkpoint's tensor shapes are read at load time (safetensors headers; ``.pth``/``.bin``
files are loaded on the CPU with ``weights_only=True``) and compared against the architecture
built on the meta device, so a checkpoint whose head does not have ``num_classes`` outputs, or
that belongs to another architecture, is reported by name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and timm are imported lazily: reading a manifest's JSON needs neither
    import torch

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "MAX_INPUT_SIDE",
    "MAX_NUM_CLASSES",
    "OVERRIDE_KEYS",
    "Zoo",
    "ZooEntry",
    "ZooError",
    "entry_to_dict",
    "load_state_dict",
    "load_zoo",
    "resize_side",
    "hub_num_classes",
    "save_checkpoint",
    "timm_name",
    "write_zoo",
]

HUB = "hub"
NONE = "none"
CHECKPOINT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
OVERRIDE_KEYS = ("input_size", "mean", "std", "interpolation", "crop_pct", "crop_mode")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")
CROP_MODES = ("center", "squash", "border")
MAX_INPUT_SIDE = 2048
"""Largest side an image is resized to, and so largest height or width an ``input_size`` may
give (timm's largest defaults are 1,024, SAM's ViTs): every image of every target is resized
for the forward pass, so an entry of 100,000 x 100,000 would cost each scoring job of the zoo
its worker's memory. timm's eval transform resizes to ``input_size / crop_pct`` *before* it
crops (see :func:`resize_side`), so the bound applies to that side too: a crop_pct of 0.0022
at 32 px made every image about 14,500 px."""
DEFAULT_CROP_PCT = 0.875
"""timm's crop_pct when a data config has none (``timm.data.DEFAULT_CROP_PCT``; the one
``zoopick.selection.extract.transform_key`` falls back to)."""
MAX_NUM_CLASSES = 100_000
"""Most outputs a source head may have. The largest real heads are ImageNet-21k's 21,843;
scoring keeps n x num_classes float32 logits in memory and in the feature cache (a 1,000,000
class head made 120 images 3.4 GB of worker memory), so a bound far above any real model
refuses only mistakes and abuse. ``zoopick.selection.extract`` bounds the logits of a whole
dataset as well (``MAX_LOGITS_BYTES``)."""
MIN_STD = 1e-6
MAX_NORM = 1e6
"""Bounds of the normalisation: ``MIN_STD <= std <= MAX_NORM`` and ``|mean| <= MAX_NORM``.
Pixels are scaled to [0, 1], then ``(x - mean) / std`` is computed in float32, so every
normalised value is at most ``(1 + MAX_NORM) / MIN_STD`` (about 1e12) in size, far inside
float32's range (3.4e38): the input is always finite. Without them a std of 1e-300 or a mean
of 1e308 (inf in float32) made every image NaN or inf, and a std of 1e300 (inf) every pixel 0.
Real models use std near 0.25 (1/255 for those fed raw 0..255 values) and mean in [0, 1]."""
_REQUIRED = ("id", "arch", "weights", "num_classes")
_OPTIONAL = ("source", "tags", *OVERRIDE_KEYS)
_KNOWN = frozenset(_REQUIRED + _OPTIONAL)


class ZooError(ValueError):
    """A zoo manifest or one of its entries is invalid (the message names the entry)."""


# --------------------------------------------------------------------------------------------
# entries


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo. ``weights`` is an absolute checkpoint path, ``"hub"`` or ``"none"``;
    ``overrides`` holds the data-config keys the manifest sets (see ``OVERRIDE_KEYS``)."""

    id: str
    arch: str
    weights: str
    num_classes: int
    overrides: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # callers outside load_zoo (the service's database rows) pass lists and Paths
        object.__setattr__(self, "weights", str(self.weights))
        object.__setattr__(self, "overrides", dict(self.overrides or {}))
        object.__setattr__(self, "tags", tuple(self.tags or ()))

    def __hash__(self) -> int:  # overrides is a dict, so the generated hash would fail
        return hash((self.id, self.arch, self.weights, self.num_classes))

    @property
    def is_checkpoint(self) -> bool:
        return self.weights not in (HUB, NONE)

    def create_model(self, *, num_classes: int | None = None) -> torch.nn.Module:
        """The timm model with its source weights (strict load) in eval mode.

        With ``num_classes`` given and different from the source head, the head is replaced by
        a fresh one of that size (``reset_classifier``), drawn from torch's global RNG, so a
        caller that seeds torch first gets a deterministic head. ``"none"`` weights are seeded
        from the id inside a forked RNG: repeated loads are identical and the caller's RNG
        stream is left untouched.
        """
        import timm
        import torch

        try:
            if self.weights == HUB:
                model = timm.create_model(self.arch, pretrained=True, num_classes=self.num_classes)
            elif self.weights == NONE:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_seed_of(self.id))
                    model = timm.create_model(
                        self.arch, pretrained=False, num_classes=self.num_classes
                    )
            else:
                model = timm.create_model(self.arch, pretrained=False, num_classes=self.num_classes)
                state = load_state_dict(self.weights)
                try:
                    model.load_state_dict(state, strict=True)
                except RuntimeError as exc:
                    raise ZooError(
                        f"model {self.id!r}: checkpoint {self.weights} does not fit arch "
                        f"{self.arch!r} with {self.num_classes} classes: {_first_line(exc)}"
                    ) from exc
        except ZooError:
            raise
        except (OSError, RuntimeError, ValueError) as exc:
            raise ZooError(f"model {self.id!r}: cannot create {self.arch!r}: {exc}") from exc
        if num_classes is not None and int(num_classes) != self.num_classes:
            model.reset_classifier(int(num_classes))
        return model.eval()

    def data_config(self, model: torch.nn.Module | None = None) -> dict[str, Any]:
        """timm's eval data config for this model (from ``model`` if given, else from the
        architecture's pretrained config) with the manifest's overrides applied."""
        from timm.data import resolve_data_config

        if model is not None:
            cfg = resolve_data_config({}, model=model)
        else:
            cfg = dict(_arch_data_config(self.arch))
        for key, value in self.overrides.items():
            cfg[key] = tuple(value) if isinstance(value, list | tuple) else value
        return cfg

    def weights_digest(self) -> str:
        """What identifies the weights: the checkpoint's sha256 (cached by path, mtime and
        size), or ``"hub:<arch>"`` / ``"none:<arch>:<id>"``."""
        if self.weights == HUB:
            return f"hub:{self.arch}"
        if self.weights == NONE:
            return f"none:{self.arch}:{self.id}"
        try:
            return file_sha256(self.weights)
        except OSError as exc:
            raise ZooError(f"model {self.id!r}: cannot read checkpoint: {exc}") from exc


def _seed_of(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return "; ".join(lines[:4]) if lines else type(exc).__name__


_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's content, cached by (resolved path, mtime, size)."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_mtime_ns, st.st_size)
    digest = _DIGESTS.get(key)
    if digest is None:
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        digest = _DIGESTS[key] = h.hexdigest()
    return digest


@lru_cache(maxsize=256)
def _arch_data_config(arch: str) -> dict[str, Any]:
    import torch
    from timm.data import resolve_data_config
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(arch)
    if cfg is not None:
        return resolve_data_config({}, pretrained_cfg=cfg.to_dict())
    import timm

    with torch.device("meta"):
        model = timm.create_model(arch, pretrained=False)
    return resolve_data_config({}, model=model)


# --------------------------------------------------------------------------------------------
# checkpoints


def _unwrap(obj: Any, where: str) -> dict[str, Any]:
    """A plain state dict from a ``.pth``-style object: ``{"state_dict": ...}`` and
    ``{"model": ...}`` wrappers are opened and a DataParallel ``module.`` prefix dropped."""
    import torch

    if isinstance(obj, Mapping):
        for key in ("state_dict", "model"):
            inner = obj.get(key)
            if isinstance(inner, Mapping):
                obj = inner
                break
    if not isinstance(obj, Mapping) or not obj:
        raise ZooError(f"{where}: not a state dict (a mapping of tensor names to tensors)")
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ZooError(f"{where}: the checkpoint holds no tensors")
    if all(k.startswith("module.") for k in tensors):
        tensors = {k[len("module.") :]: v for k, v in tensors.items()}
    return tensors


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict stored at ``path`` (.safetensors, or .pth/.pt/.bin read with
    ``weights_only=True``), on the CPU."""
    import torch

    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
            if all(k.startswith("module.") for k in state):
                state = {k[len("module.") :]: v for k, v in state.items()}
            return state
        if suffix in (".pth", ".pt", ".bin"):
            obj = torch.load(path, map_location="cpu", weights_only=True)
            return _unwrap(obj, str(path))
    except ZooError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint becomes a ZooError
        raise ZooError(f"cannot read checkpoint {path}: {_first_line(exc)}") from exc
    raise ZooError(f"checkpoint {path}: unknown format (expected {', '.join(CHECKPOINT_SUFFIXES)})")


_SHAPES: dict[tuple[str, int, int], dict[str, tuple[int, ...]]] = {}


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a checkpoint, without loading a safetensors file's data."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_mtime_ns, st.st_size)
    if key in _SHAPES:
        return _SHAPES[key]
    if p.suffix.lower() == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(p), framework="pt") as fh:
                shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118
        except Exception as exc:  # noqa: BLE001
            raise ZooError(f"cannot read checkpoint {p}: {_first_line(exc)}") from exc
        if shapes and all(k.startswith("module.") for k in shapes):
            shapes = {k[len("module.") :]: v for k, v in shapes.items()}
    else:
        shapes = {k: tuple(v.shape) for k, v in load_state_dict(p).items()}
    _SHAPES[key] = shapes
    return shapes


def save_checkpoint(model: torch.nn.Module, path: str | Path) -> Path:
    """Write ``model``'s state dict as safetensors, atomically (whatever the suffix of
    ``path``). Tensors sharing storage (tied weights) are saved as separate copies, so a plain
    strict ``load_state_dict`` restores them."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {}
    storages: set[int] = set()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        state[name] = t
    _atomic_write(path, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    return path


def _atomic_write(path: Path, write: Any) -> None:
    """Write through a temporary sibling and ``os.replace`` it into place, so readers never
    see a half-written file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------
# validation


def _label(raw: Any, index: int) -> str:
    if isinstance(raw, Mapping) and isinstance(raw.get("id"), str) and raw["id"].strip():
        return f"model {raw['id']!r} (entry {index})"
    return f"model entry {index}"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_overrides(raw: Mapping[str, Any], label: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "input_size" in raw:
        v = raw["input_size"]
        if (
            not isinstance(v, list | tuple)
            or len(v) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)
            or v[0] != 3
        ):
            raise ZooError(
                f"{label}: input_size must be [3, height, width] (positive ints), got {v!r}"
            )
        if max(v[1:]) > MAX_INPUT_SIDE:
            raise ZooError(
                f"{label}: input_size {list(v)!r} is over the largest height and width, "
                f"{MAX_INPUT_SIDE} px"
            )
        out["input_size"] = [int(x) for x in v]
    for key in ("mean", "std"):
        if key in raw:
            v = raw[key]
            if not isinstance(v, list | tuple) or len(v) != 3 or not all(_is_number(x) for x in v):
                raise ZooError(f"{label}: {key} must be a list of 3 numbers, got {v!r}")
            if key == "std" and not all(x > 0 for x in v):
                raise ZooError(f"{label}: std values must be positive, got {v!r}")
            _check_norm(key, v, label)
            out[key] = [float(x) for x in v]
    if "interpolation" in raw:
        v = raw["interpolation"]
        if v not in INTERPOLATIONS:
            raise ZooError(
                f"{label}: interpolation must be one of {', '.join(INTERPOLATIONS)}, got {v!r}"
            )
        out["interpolation"] = v
    if "crop_pct" in raw:
        v = raw["crop_pct"]
        if not _is_number(v) or not 0 < v <= 1:
            raise ZooError(f"{label}: crop_pct must be a number in (0, 1], got {v!r}")
        out["crop_pct"] = float(v)
    if "crop_mode" in raw:
        v = raw["crop_mode"]
        if v not in CROP_MODES:
            raise ZooError(f"{label}: crop_mode must be one of {', '.join(CROP_MODES)}, got {v!r}")
        out["crop_mode"] = v
    return out


def _check_norm(key: str, values: Sequence[float], label: str) -> None:
    """``mean`` and ``std`` within the bounds that keep ``(x - mean) / std`` finite in float32
    for pixels in [0, 1] (see ``MAX_NORM``): outside them every image of every job would be
    NaN or inf (or blank), failing the model after its whole forward pass."""
    if key == "std" and not all(MIN_STD <= x <= MAX_NORM for x in values):
        raise ZooError(
            f"{label}: std values must be between {MIN_STD:g} and {MAX_NORM:g}, got "
            f"{list(values)!r} (beyond them (x - mean) / std is not finite in float32)"
        )
    if key == "mean" and not all(abs(x) <= MAX_NORM for x in values):
        raise ZooError(
            f"{label}: mean values must be between {-MAX_NORM:g} and {MAX_NORM:g}, got "
            f"{list(values)!r} (beyond them (x - mean) / std is not finite in float32)"
        )


def resize_side(input_size: Sequence[int], crop_pct: float | None) -> float:
    """The side timm's eval transform resizes an image to before cropping it to
    ``input_size``: ``floor(side / crop_pct)`` of the larger of height and width (as
    ``timm.data.transforms_imagenet_eval`` computes its ``scale_size``); ``inf`` when that
    quotient overflows a float (a crop_pct of 5e-324)."""
    quotient = max(input_size[1:]) / (crop_pct or DEFAULT_CROP_PCT)
    return math.floor(quotient) if math.isfinite(quotient) else math.inf


def _check_resize(entry: ZooEntry, label: str) -> None:
    """Refuse an entry whose images would be resized beyond ``MAX_INPUT_SIDE`` before the
    crop: a small ``crop_pct`` gets round the ``input_size`` bound (a crop_pct of 1e-300
    failed every job with "Python int too large to convert to C long"). What is not
    overridden comes from the architecture's config (``ZooEntry.data_config``, as scoring
    takes it); an entry overriding neither keeps timm's own (trusted) config."""
    overrides = entry.overrides
    if "input_size" not in overrides and "crop_pct" not in overrides:
        return
    if "input_size" in overrides and "crop_pct" in overrides:
        cfg: dict[str, Any] = dict(overrides)
    else:
        try:
            cfg = entry.data_config()
        except Exception as exc:  # noqa: BLE001 - scoring would fail on the same call
            raise ZooError(
                f"{label}: cannot read the data config of {entry.arch!r}: {exc}"
            ) from exc
    size, crop_pct = list(cfg["input_size"]), cfg.get("crop_pct") or DEFAULT_CROP_PCT
    side = resize_side(size, crop_pct)
    if side > MAX_INPUT_SIDE:
        shown = "inf" if math.isinf(side) else f"{side:,}"
        raise ZooError(
            f"{label}: crop_pct {crop_pct:g} with input_size {size!r} resizes every image to "
            f"{shown} px before the crop (input side / crop_pct), over the largest side, "
            f"{MAX_INPUT_SIDE} px: give a crop_pct of at least "
            f"{max(size[1:]) / MAX_INPUT_SIDE:.4g} or a smaller input_size"
        )


def _parse_entry(raw: Any, index: int, root: Path, *, check_files: bool) -> ZooEntry:
    label = _label(raw, index)
    if not isinstance(raw, Mapping):
        raise ZooError(f"{label}: must be a mapping of fields, got {type(raw).__name__}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ZooError(f"{label}: missing field(s) {', '.join(missing)}")
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise ZooError(
            f"{label}: unknown field(s) {', '.join(map(str, unknown))} "
            f"(known: {', '.join(sorted(_KNOWN))})"
        )
    model_id = raw["id"]
    if not isinstance(model_id, str) or not model_id.strip() or model_id != model_id.strip():
        raise ZooError(f"{label}: id must be a non-empty string without surrounding spaces")
    arch = raw["arch"]
    if not isinstance(arch, str) or not arch:
        raise ZooError(f"{label}: arch must be a timm model name, got {arch!r}")
    arch = timm_name(arch, label)
    num_classes = raw["num_classes"]
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ZooError(f"{label}: num_classes must be a positive integer, got {num_classes!r}")
    if num_classes > MAX_NUM_CLASSES:
        raise ZooError(
            f"{label}: num_classes {num_classes:,} is over the largest source head, "
            f"{MAX_NUM_CLASSES:,} (ImageNet-21k's is 21,843)"
        )
    weights = raw["weights"]
    if not isinstance(weights, str) or not weights:
        raise ZooError(f"{label}: weights must be a checkpoint path, 'hub' or 'none'")
    if weights in (HUB, NONE):
        resolved = weights
    else:
        p = Path(weights).expanduser()
        if p.suffix.lower() not in CHECKPOINT_SUFFIXES:
            raise ZooError(
                f"{label}: checkpoint {weights!r} has an unknown format "
                f"(expected {', '.join(CHECKPOINT_SUFFIXES)}, or 'hub' / 'none')"
            )
        resolved = str((p if p.is_absolute() else root / p).resolve())
        if check_files and not Path(resolved).is_file():
            raise ZooError(f"{label}: checkpoint file not found: {resolved}")
    source = raw.get("source")
    if source is not None and not isinstance(source, str):
        raise ZooError(f"{label}: source must be a string, got {source!r}")
    tags = raw.get("tags", [])
    if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
        raise ZooError(f"{label}: tags must be a list of strings, got {tags!r}")
    entry = ZooEntry(
        id=model_id,
        arch=arch,
        weights=resolved,
        num_classes=num_classes,
        overrides=_check_overrides(raw, label),
        source=source,
        tags=tuple(tags),
    )
    _check_resize(entry, label)
    if check_files:
        _check_weights(entry, label)
    return entry


HF_HUB_PREFIX = "hf-hub:"


def timm_name(arch: str, label: str = "arch") -> str:
    """The registry name timm builds ``arch`` from, checked without downloading anything.

    A pretrained tag (``resnet50.a1_in1k``) must be one of the architecture's own:
    ``timm.is_model`` accepts any tag, and an unknown one only failed when a job built the
    model. A Hugging Face hub name (``hf-hub:timm/resnet50.a1_in1k``) is mapped to the
    registry entry whose weights live in that repository, so its data config (input size,
    normalisation, crop) comes from timm's pretrained config as a registry name's does; a hub
    repository timm's registry does not know would need its config downloaded to be checked,
    and is refused naming the way round (download the weights, register the checkpoint)."""
    import timm

    if arch.startswith(HF_HUB_PREFIX):
        repo = arch.removeprefix(HF_HUB_PREFIX)
        name = _hub_repos().get(repo)
        if name is None:
            raise ZooError(
                f"{label}: {arch!r} is not a hub repository timm's registry knows (its weights "
                "would be fetched with a config nothing here can check first); give timm's "
                "name for it (timm.list_pretrained()), or download its checkpoint and give "
                "its path as weights with the arch it was trained as"
            )
        return name
    if not timm.is_model(arch):
        raise ZooError(f"{label}: unknown arch {arch!r} (not in timm.list_models())")
    from timm.models import get_pretrained_cfg, split_model_name_tag

    base, tag = split_model_name_tag(arch)
    if tag:
        try:
            get_pretrained_cfg(arch)
        except RuntimeError:
            tags = [n.split(".", 1)[1] for n in timm.list_pretrained(f"{base}.*")]
            known = ", ".join(tags[:12]) + (f" (+{len(tags) - 12} more)" if len(tags) > 12 else "")
            raise ZooError(
                f"{label}: {arch!r}: {base!r} has no pretrained tag {tag!r}"
                + (f" (its tags: {known})" if tags else " (it has no pretrained weights)")
            ) from None
    return arch


@lru_cache(maxsize=1)
def _hub_repos() -> dict[str, str]:
    """Hugging Face repository -> timm's registry name of the weights it holds."""
    import timm
    from timm.models import get_pretrained_cfg

    repos: dict[str, str] = {}
    for name in timm.list_pretrained():
        cfg = get_pretrained_cfg(name)
        if cfg is not None and cfg.hf_hub_id:
            repos.setdefault(cfg.hf_hub_id, name)
    return repos


def hub_num_classes(arch: str) -> int | None:
    """The head size of ``arch``'s hub weights (its pretrained config), if timm records one."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(timm_name(arch))
    return int(cfg.num_classes) if cfg is not None and cfg.num_classes else None


@lru_cache(maxsize=256)
def _model_layout(
    arch: str, num_classes: int
) -> tuple[dict[str, tuple[int, ...]], tuple[str, ...]]:
    """(state-dict shapes, classifier keys) of ``arch``, built on the meta device (no memory,
    no initialisation cost)."""
    import timm
    import torch

    with torch.device("meta"):
        model = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    heads = model.get_classifier()
    heads = heads if isinstance(heads, tuple | list) else (heads,)
    names = {id(m): n for n, m in model.named_modules()}
    keys = []
    for head in heads:
        name = names.get(id(head))
        if name is None:
            continue
        keys += [f"{name}.{k}" if name else k for k in head.state_dict()]
    return shapes, tuple(keys)


def _check_weights(entry: ZooEntry, label: str) -> None:
    if entry.weights == NONE:
        return
    if entry.weights == HUB:
        from timm.models import get_pretrained_cfg

        cfg = get_pretrained_cfg(entry.arch)
        if cfg is not None and cfg.num_classes and cfg.num_classes != entry.num_classes:
            raise ZooError(
                f"{label}: hub weights of {entry.arch!r} have a {cfg.num_classes}-class head "
                f"but num_classes is {entry.num_classes}"
            )
        return
    have = checkpoint_shapes(entry.weights)
    try:
        want, head_keys = _model_layout(entry.arch, entry.num_classes)
    except Exception:  # noqa: BLE001 - an arch that cannot be built on meta: check the head only
        want, head_keys = None, ()
    if want is None:
        from timm.models import get_pretrained_cfg

        cfg = get_pretrained_cfg(entry.arch)
        key = f"{cfg.classifier}.weight" if cfg is not None and cfg.classifier else None
        if key in have and have[key][0] != entry.num_classes:
            raise ZooError(
                f"{label}: checkpoint head {key} has {have[key][0]} outputs but num_classes is "
                f"{entry.num_classes}"
            )
        return
    for key in head_keys:
        if key in have and key.endswith("weight") and have[key] != want[key]:
            raise ZooError(
                f"{label}: checkpoint head {key} has {have[key][0]} outputs but num_classes is "
                f"{entry.num_classes} ({entry.weights})"
            )
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    if missing or unexpected or wrong:
        parts = []
        for what, keys in (("missing", missing), ("unexpected", unexpected), ("shape", wrong)):
            if keys:
                more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
                shown = (
                    keys[:3] if what != "shape" else [f"{k} {have[k]}!={want[k]}" for k in keys[:3]]
                )
                parts.append(f"{what}: {', '.join(shown)}{more}")
        raise ZooError(
            f"{label}: checkpoint {entry.weights} does not match arch {entry.arch!r} with "
            f"{entry.num_classes} classes ({'; '.join(parts)})"
        )


# --------------------------------------------------------------------------------------------
# the zoo


@dataclass
class Zoo:
    """The models of one manifest, in manifest order."""

    entries: list[ZooEntry]
    path: Path | None = None

    def __iter__(self) -> Iterator[ZooEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, model_id: str) -> ZooEntry:
        for entry in self.entries:
            if entry.id == model_id:
                return entry
        raise ZooError(f"unknown model {model_id!r}; the zoo has: {', '.join(self.ids)}")

    def __contains__(self, model_id: object) -> bool:
        return any(e.id == model_id for e in self.entries)

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.entries]

    def select(self, ids: str | Iterable[str]) -> Zoo:
        """The sub-zoo of ``ids`` in the order given (duplicates dropped)."""
        wanted = [ids] if isinstance(ids, str) else list(dict.fromkeys(ids))
        if not wanted:
            raise ZooError("no model selected")
        return Zoo([self[i] for i in wanted], self.path)


def _read_manifest(path: Path) -> Any:
    if not path.is_file():
        raise ZooError(f"zoo manifest not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ZooError(f"cannot read zoo manifest {path}: {exc}") from exc
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ZooError(f"zoo manifest {path} is not valid YAML: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ZooError(f"zoo manifest {path} is not valid JSON: {exc}") from exc


def _parse_all(models: Any, root: Path, *, check_files: bool, where: str) -> list[ZooEntry]:
    if not isinstance(models, list) or not models:
        raise ZooError(f"{where}: no models (expected a non-empty list under 'models')")
    entries: list[ZooEntry] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(models):
        entry = _parse_entry(raw, index, root, check_files=check_files)
        if entry.id in seen:
            raise ZooError(
                f"{where}: duplicate model id {entry.id!r} (entries {seen[entry.id]} and {index})"
            )
        seen[entry.id] = index
        entries.append(entry)
    return entries


def load_zoo(path: str | Path) -> Zoo:
    """Read and validate a zoo manifest; relative checkpoint paths resolve against its folder."""
    path = Path(path).expanduser()
    data = _read_manifest(path)
    if not isinstance(data, Mapping) or "models" not in data:
        raise ZooError(f"zoo manifest {path}: expected a mapping with a 'models' list")
    extra = sorted(set(data) - {"models", "name", "description", "version"})
    if extra:
        raise ZooError(f"zoo manifest {path}: unknown top-level field(s) {', '.join(extra)}")
    entries = _parse_all(
        data["models"], path.resolve().parent, check_files=True, where=f"zoo manifest {path}"
    )
    return Zoo(entries, path.resolve())


def entry_to_dict(entry: ZooEntry, root: str | Path | None = None) -> dict[str, Any]:
    """The manifest form of ``entry``; its checkpoint path made relative to ``root`` when the
    checkpoint lies inside it."""
    weights = entry.weights
    if root is not None and entry.is_checkpoint:
        weights = _relative(weights, Path(root))
    out: dict[str, Any] = {
        "id": entry.id,
        "arch": entry.arch,
        "weights": weights,
        "num_classes": entry.num_classes,
    }
    for key in OVERRIDE_KEYS:
        if key in entry.overrides:
            v = entry.overrides[key]
            out[key] = list(v) if isinstance(v, list | tuple) else v
    if entry.source is not None:
        out["source"] = entry.source
    if entry.tags:
        out["tags"] = list(entry.tags)
    return out


def _relative(weights: str, root: Path) -> str:
    p = Path(weights).expanduser()
    if not p.is_absolute():
        return weights
    try:
        return p.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(p)


def write_zoo(entries: Sequence[Mapping[str, Any] | ZooEntry], path: str | Path) -> Path:
    """Write a manifest (JSON, or YAML for .yaml/.yml) atomically; checkpoint paths inside the
    manifest's folder are stored relative to it. Fields are validated (checkpoint files are
    not: a zoo may be written before its checkpoints)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    root = path.resolve().parent
    models: list[dict[str, Any]] = []
    for raw in entries:
        if isinstance(raw, ZooEntry):
            item = entry_to_dict(raw, root)
        elif isinstance(raw, Mapping):
            item = dict(raw)
            if isinstance(item.get("weights"), str | Path) and str(item["weights"]) not in (
                HUB,
                NONE,
            ):
                item["weights"] = _relative(str(item["weights"]), root)
            if "tags" in item and isinstance(item["tags"], tuple):
                item["tags"] = list(item["tags"])
        else:
            raise ZooError(
                f"write_zoo: entries must be dicts or ZooEntry, got {type(raw).__name__}"
            )
        models.append(item)
    _parse_all(models, root, check_files=False, where=f"zoo manifest {path}")
    data = {"models": models}
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(data, sort_keys=False)
    else:
        text = json.dumps(data, indent=2) + "\n"
    _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path
