"""Target datasets: an ImageFolder (directory or archive) or an ``.npz`` array file.

A dataset is held compactly: an npz keeps its uint8 array, an ImageFolder keeps each image's
encoded bytes (archives are read member by member in memory, never extracted) and decodes on
demand. Every image is decoded once at load so a corrupt file is reported by name up front,
not halfway through scoring a zoo.

``digest`` is a content digest: the image data, labels and class names, in order. The same
images give the same digest wherever they live (a folder, its zip, a copy elsewhere), and any
subsampling shows because the subset's content is what is hashed. It keys the feature cache.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import posixpath
import stat
import tarfile
import threading
import unicodedata
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from zoopick.selection.archives import ZIP_ERRORS, MeteredStream, open_zip
from zoopick.selection.errors import DatasetError, LimitExceeded
from zoopick.selection.formats import ARCHIVE_SUFFIXES, file_suffix
from zoopick.selection.limits import DEFAULT_LIMITS, Budget, DatasetLimits

__all__ = [
    "IMAGE_EXTENSIONS",
    "DatasetError",
    "DatasetLimits",
    "LimitExceeded",
    "TargetDataset",
    "load_dataset",
    "split_dataset",
]

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
_READ_CHUNK = 1 << 20
_DIGEST_VERSION = b"zoopick-dataset-v1"


# --------------------------------------------------------------------------------------------
# the dataset


@dataclass(eq=False)  # identity equality: comparing arrays field by field is ambiguous
class TargetDataset:
    """Labelled target images. ``labels`` index ``class_names``.

    ``images`` is either a uint8 array (N,H,W) / (N,H,W,C) or a list of encoded image files
    (bytes); ``sources`` names each image (its path inside the folder/archive) for messages.
    ``limits`` are those it was loaded under: :meth:`image` decodes under the same
    ``max_pixels``, so an image a load accepted (``max_pixels=None``) also decodes later.
    """

    name: str
    labels: np.ndarray
    class_names: list[str]
    digest: str
    images: np.ndarray | list[bytes] | None = field(default=None, repr=False)
    sources: list[str] | None = field(default=None, repr=False)
    _hashes: list[bytes] | None = field(default=None, repr=False, compare=False)
    limits: DatasetLimits = field(default=DEFAULT_LIMITS, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, i: int) -> Image.Image:
        """Image ``i`` as an RGB PIL image (grayscale and palette images converted)."""
        if self.images is None:
            raise DatasetError(f"dataset {self.name!r} holds labels only, no images")
        if isinstance(self.images, np.ndarray):
            arr = self.images[i]
            if arr.ndim == 3 and arr.shape[-1] == 1:
                arr = arr[..., 0]
            return Image.fromarray(arr).convert("RGB")
        item = self.images[i]
        if isinstance(item, np.ndarray):  # decoded once already (``selection.decoded``)
            return Image.fromarray(item)
        where = self.sources[i] if self.sources else f"image {i}"
        return _decode(item, where, limits=self.limits)

    def subset(self, indices: Sequence[int] | np.ndarray) -> TargetDataset:
        """The images at ``indices`` (in that order), with their own digest."""
        idx = np.asarray(indices)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise DatasetError(f"subset indices out of range for {len(self)} images")
        labels = self.labels[idx]
        if isinstance(self.images, np.ndarray):
            images: Any = np.ascontiguousarray(self.images[idx])
            hashes = None
        elif self.images is not None:
            images = [self.images[i] for i in idx]
            hashes = [self._hashes[i] for i in idx] if self._hashes is not None else None
        else:
            images, hashes = None, None
        sources = [self.sources[i] for i in idx] if self.sources is not None else None
        out = TargetDataset(
            self.name,
            labels,
            list(self.class_names),
            "",
            images,
            sources,
            _hashes=hashes,
            limits=self.limits,
        )
        out.digest = out.compute_digest()
        return out

    def class_counts(self) -> dict[str, int]:
        counts = np.bincount(self.labels, minlength=len(self.class_names))
        return {name: int(c) for name, c in zip(self.class_names, counts, strict=True)}

    def compute_digest(self) -> str:
        """sha256 over the images (array bytes, or each file's sha256), labels, class names."""
        h = hashlib.sha256(_DIGEST_VERSION)
        if isinstance(self.images, np.ndarray):
            arr = np.ascontiguousarray(self.images)
            h.update(b"array" + json.dumps([list(arr.shape), arr.dtype.str]).encode())
            h.update(memoryview(arr).cast("B"))
        elif self.images is not None:
            if self._hashes is None or len(self._hashes) != len(self.images):
                self._hashes = _file_hashes(self.images)
            h.update(b"files%d" % len(self._hashes))
            for d in self._hashes:
                h.update(d)
        h.update(b"labels" + np.ascontiguousarray(self.labels, dtype="<i8").tobytes())
        h.update(b"classes" + json.dumps(list(self.class_names)).encode())
        return h.hexdigest()

    @classmethod
    def from_arrays(
        cls,
        x: np.ndarray,
        y: np.ndarray,
        class_names: Sequence[str] | None = None,
        *,
        name: str = "arrays",
    ) -> TargetDataset:
        """A dataset from in-memory arrays, validated like an ``.npz`` file, except that a
        class of ``class_names`` may have no images (arrays in memory are often a test split,
        which may lack one: :data:`_SPLIT_LIMITS`)."""
        images, labels, names = _check_arrays(x, y, class_names, name, _SPLIT_LIMITS)
        ds = cls(name, labels, names, "", images)
        ds.digest = ds.compute_digest()
        return ds


def _file_hashes(blobs: Sequence[bytes]) -> list[bytes]:
    return [hashlib.sha256(b).digest() for b in blobs]


def _to_8bit(img: Image.Image, where: str) -> Image.Image:
    """16-bit, 32-bit integer and float images scaled to 8 bits (``convert`` would clip them),
    by the mode's range, never by the image's own values: one bright pixel must not rescale
    every other (and images of one dataset share a scale). Integer modes are 16-bit data
    (Pillow opens 16-bit PNG and TIFF as ``I;16``, 16-bit PGM as ``I``): 0..65535 to 0..255.
    Float images hold 0..1, as the npz path's floats do. Values outside the range, and NaN or
    infinities, are refused rather than clipped into a silently different image. Works in
    32 bits: a decode's memory stays within what :class:`_PixelGate` weighs it at."""
    if img.mode == "F":
        arr = np.asarray(img, dtype=np.float32)
        if not np.isfinite(arr).all():
            raise DatasetError(f"image {where}: float pixels that are NaN or infinite")
        low, high = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
        if low < 0 or high > 1:
            raise DatasetError(
                f"image {where}: float pixels must lie in [0, 1], found {low:g} to {high:g}"
            )
        return Image.fromarray(np.rint(arr * 255).astype(np.uint8))
    arr = np.asarray(img)
    low, high = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    if low < 0 or high > 65535:
        raise DatasetError(
            f"image {where}: integer pixels must lie in 0..65535 (16-bit), found {low} to {high}"
        )
    wide = arr.astype(np.uint32)
    return Image.fromarray(((wide + 128) // 257).astype(np.uint8))  # round(v * 255 / 65535)


def _upright(img: Image.Image) -> Image.Image:
    """The image as a viewer shows it: EXIF orientation applied (a phone's portrait photo is
    stored sideways with a tag saying so). An unreadable EXIF block leaves it as stored."""
    try:
        return ImageOps.exif_transpose(img)
    except Exception:  # noqa: BLE001 - a broken tag is not a broken image
        return img


def _decode(
    data: bytes, where: str, *, draft: bool = False, limits: DatasetLimits = DEFAULT_LIMITS
) -> Image.Image:
    """Decode one encoded image to RGB; ``draft`` lets JPEG decode at reduced scale (enough to
    prove the whole file decodes, several times faster). The header's size is checked against
    ``limits.max_pixels`` before any pixel is decoded (in Pillow's own check, which
    :func:`_pillow_limits` makes ours for the decode)."""
    try:
        with _pillow_limits(limits, where), Image.open(io.BytesIO(data)) as img:
            # checked in Image.open already (the scoped hook), and here for a Pillow without it
            limits.check("max_pixels", img.width * img.height, f"image {where} pixels")
            if draft:
                img.draft("RGB", (max(1, img.width // 8), max(1, img.height // 8)))
            img.load()
            img = _upright(img)
            if _is_wide(img.mode):
                img = _to_8bit(img, where)
            return img.convert("RGB")
    except DatasetError:  # ours (a limit, pixels out of range), already naming the image
        raise
    except UnidentifiedImageError as exc:
        # PIL's own message names its in-memory buffer object (``<_io.BytesIO object at
        # 0x7f...>``): say what is wrong in plain words instead
        raise DatasetError(f"unreadable image {where}: not a recognised image format") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise DatasetError(f"unreadable or corrupt image {where}: {_plain(exc)}") from exc
    except Image.DecompressionBombError as exc:
        # only where the hook could not be scoped (a Pillow without it): its words are not ours
        raise LimitExceeded(
            f"image {where} is over Pillow's decompression-bomb limit "
            f"(PIL.Image.MAX_IMAGE_PIXELS={Image.MAX_IMAGE_PIXELS}), beside max_pixels="
            f"{limits.max_pixels}"
        ) from exc


# ---- Pillow's pixel limit, made ours within a decode

_PILLOW_SCOPE: ContextVar[tuple[DatasetLimits, str] | None] = ContextVar(
    "zoopick_pillow_scope", default=None
)


@contextmanager
def _pillow_limits(limits: DatasetLimits, where: str) -> Iterator[None]:
    """Within the block, in this thread (or task) only, Pillow's decompression-bomb check
    (``PIL.Image.MAX_IMAGE_PIXELS``, applied in ``Image.open`` and again by some formats'
    ``load``) answers to ``limits.max_pixels`` instead: ``None`` switches both off, as the
    limit's documentation promises; a number is checked in our words, naming the limit
    (Pillow's message speaks of a "DOS attack" and of none of our settings).

    Pillow has no per-call setting, and setting its global for a decode would switch the
    check off for every other thread decoding meanwhile (the service decodes in worker
    threads beside thumbnails and the caller's own code). So the check itself is wrapped, once
    (:func:`_scoped_bomb_check`): outside this block it is Pillow's own, reading Pillow's
    global as before; inside, a :class:`~contextvars.ContextVar` says whose limit applies."""
    token = _PILLOW_SCOPE.set((limits, where))
    try:
        yield
    finally:
        _PILLOW_SCOPE.reset(token)


def _scoped_bomb_check(size: tuple[int, int], *args: Any, **kwargs: Any) -> None:
    """Pillow's ``_decompression_bomb_check``, answering to the limits of the decode running
    in this context (:func:`_pillow_limits`), Pillow's own check everywhere else. A limit that
    is set keeps Pillow's refusal too, in our words: a process that lowered
    ``MAX_IMAGE_PIXELS`` below ``max_pixels`` chose the stricter bound; only ``None`` lifts
    it. Pillow's warning below that refusal is not repeated: the limit here is ours."""
    scope = _PILLOW_SCOPE.get()
    if scope is None:
        return _PILLOW_BOMB_CHECK(size, *args, **kwargs)
    limits, where = scope
    if limits.max_pixels is None:
        return None
    pixels = max(1, size[0]) * max(1, size[1])
    limits.check("max_pixels", pixels, f"image {where} pixels")
    ceiling = Image.MAX_IMAGE_PIXELS
    if ceiling is not None and pixels > 2 * ceiling:
        raise LimitExceeded(
            f"image {where} pixels ({pixels:,}) are over {2 * ceiling:,}, the bound this process "
            f"sets on every image (twice PIL.Image.MAX_IMAGE_PIXELS), below max_pixels="
            f"{limits.max_pixels:,}; raise MAX_IMAGE_PIXELS, or set max_pixels=None for none"
        )
    return None


def _install_scoped_bomb_check() -> Callable[..., None]:
    """Put :func:`_scoped_bomb_check` in Pillow's place once (a reload of this module finds
    it there and keeps Pillow's original); returns Pillow's own check. ``Image.open`` and
    the format plugins look it up on the module at every call, so the wrapper sees them all."""
    current = getattr(Image, "_decompression_bomb_check", None)
    if current is None:  # a Pillow without the hook: _decode names its error in our words
        return lambda *args, **kwargs: None
    original = current.pillow if hasattr(current, "pillow") else current
    _scoped_bomb_check.pillow = original  # type: ignore[attr-defined]
    Image._decompression_bomb_check = _scoped_bomb_check  # type: ignore[assignment]
    return original


_PILLOW_BOMB_CHECK = _install_scoped_bomb_check()


def _plain(exc: BaseException) -> str:
    """An exception's message without object reprs (``<... at 0x7f...>``) that tell a user
    nothing and leak the process' memory layout."""
    import re

    text = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the data", str(exc)).strip()
    return text or type(exc).__name__


def _is_wide(mode: str) -> bool:
    """A Pillow mode of more than 8 bits a channel (``I``, ``F``, ``I;16*``): scaled by
    :func:`_to_8bit`, weighed :data:`WIDE_WEIGHT` times at the gate."""
    return mode in ("I", "F") or mode.startswith("I;16")


WIDE_WEIGHT = 4
"""What a wide-mode pixel weighs at the gate, in 8-bit pixels: its decode holds the image
(2 or 4 bytes), a 32-bit working copy and the 8-bit results, about four times an 8-bit one."""


class _PixelGate:
    """Bounds the pixels decoded at once by :func:`_parallel`'s threads. A decode holds about
    4 bytes a pixel (the image and its RGB copy): eight threads on images of 4096 x 4096
    (the service's ``max_pixels``) would hold over 500 MB. A decode waits until its pixels
    fit under ``cap`` beside those in flight (one always runs, whatever its size); a pixel of
    16 bits or more counts :data:`WIDE_WEIGHT` times."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.busy = 0
        self.cond = threading.Condition()

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        if self.cap is None:
            yield
            return
        with self.cond:
            self.cond.wait_for(lambda: self.busy == 0 or self.busy + pixels <= self.cap)
            self.busy += pixels
        try:
            yield
        finally:
            with self.cond:
                self.busy -= pixels
                self.cond.notify_all()


def _decode_pixels(data: bytes, limits: DatasetLimits, where: str) -> int:
    """Pixels decoding ``data`` will produce, from its header (JPEG at the 1/8 draft scale);
    0 where the header does not open or is over a limit (the decode itself then names the
    problem)."""
    try:
        with _pillow_limits(limits, where), Image.open(io.BytesIO(data)) as img:
            pixels = img.width * img.height
            if img.format == "JPEG":
                return pixels // 64
            return pixels * WIDE_WEIGHT if _is_wide(img.mode) else pixels
    except Exception:  # noqa: BLE001 - any failure is reported by the decode that follows
        return 0


def _parallel(fn: Callable[[int], Any], n: int) -> list[Any]:
    """``[fn(i) for i in range(n)]``, threaded for large n (PIL releases the GIL while
    decoding and resizing)."""
    workers = min(8, os.cpu_count() or 1)
    if n < 64 or workers < 2:
        return [fn(i) for i in range(n)]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, range(n), chunksize=32))


# --------------------------------------------------------------------------------------------
# loading


def load_dataset(
    path: str | Path,
    *,
    max_per_class: int | None = None,
    seed: int = 0,
    split: str = "train",
    limits: DatasetLimits | None = None,
) -> TargetDataset:
    """Load an ImageFolder (directory, .zip, .tar, .tar.gz/.tgz, .tar.bz2, .tar.xz) or an
    ``.npz`` dataset.

    ``limits`` (default :data:`~zoopick.selection.limits.DEFAULT_LIMITS`) bound what the file
    may cost before it is read: :class:`LimitExceeded` names the limit it broke.

    ImageFolder: one sub-folder per class (possibly under a single top-level folder); class
    names are the sorted folder names. npz: ``x``/``y`` (or Keras ``x_train``/``y_train``,
    ``x_test``/``y_test`` with ``split="test"``) and optional ``class_names``.
    ``max_per_class`` keeps a seeded random subset of each larger class, independently per
    class (adding a class does not change the others' picks).
    """
    path = Path(path).expanduser()
    if max_per_class is not None:
        max_per_class = _whole(max_per_class, "max_per_class", least=1)
    seed = _whole(seed, "seed", least=0)
    if split not in ("train", "test"):
        raise DatasetError(f"split must be 'train' or 'test', got {split!r}")
    if not path.exists():
        raise DatasetError(f"dataset not found: {path}")
    suffix = file_suffix(path.name)  # the formats' one list: zoopick.selection.formats
    if path.is_dir():
        kind, name = "dir", path.name
    elif suffix:
        kind = {".npz": "npz", ".zip": "zip"}.get(suffix, "tar")
        name = path.name[: -len(suffix)]
    else:
        raise DatasetError(
            f"unknown dataset format: {path.name} (expected an ImageFolder directory, "
            f"{', '.join(ARCHIVE_SUFFIXES)} archive, or .npz)"
        )
    limits = limits or DEFAULT_LIMITS
    budget = Budget(limits)
    if kind == "npz":
        from zoopick.selection.npzfile import load_npz

        return load_npz(path, name, max_per_class, seed, split, limits, budget)
    if split != "train":
        raise DatasetError("split='test' applies to .npz files with x_test/y_test only")
    if kind == "dir":
        reader: _Reader = _DirReader(path, limits)
    elif kind == "zip":
        reader = _ZipReader(path, limits, budget)
    else:
        reader = _TarReader(path, limits, budget)
    reader.budget = budget
    with reader:
        return _load_folder(reader, name, max_per_class, seed, limits)


def _whole(value: Any, what: str, *, least: int) -> int:
    """``value`` as a Python int of at least ``least`` (0 or 1): an int or a numpy integer (a count
    read from an array or a config is often ``np.int64``), never a bool (``True`` is not a
    count) nor a float. A negative seed would reach numpy's generator, whose refusal names
    none of our arguments."""
    exact = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not exact or value < least:
        kind = "a positive" if least > 0 else "a non-negative"
        raise DatasetError(f"{what} must be {kind} integer, got {value!r}")
    return int(value)


def _subsample(labels: np.ndarray, names: Sequence[str], max_per_class: int | None, seed: int):
    """Sorted indices keeping at most ``max_per_class`` of each class; each class's pick is
    seeded by (seed, class name) only."""
    if max_per_class is None:
        return np.arange(len(labels))
    keep = []
    for c, cname in enumerate(names):
        members = np.flatnonzero(labels == c)
        if len(members) > max_per_class:
            rng = np.random.default_rng([seed, zlib.crc32(str(cname).encode())])
            members = np.sort(rng.choice(members, max_per_class, replace=False))
        keep.append(members)
    return np.sort(np.concatenate(keep)) if keep else np.arange(0)


_BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)
"""Unicode's Bidi_Control characters: invisible, they reorder what follows them, so a name
can display as another (``gnp.tac`` after U+202E shows as ``cat.png``)."""


def _check_names(names: Sequence[str], where: str, limits: DatasetLimits, *, folders: bool) -> None:
    """Class names are shown and stored: bounded in length, free of control characters (a
    NUL that PostgreSQL's text refuses, escape sequences that reach a terminal), and each
    one a name a person can tell from the others (:func:`_check_name_looks`,
    :func:`_check_lookalikes`). One place for folder names (``folders``) and an npz's (or
    in-memory arrays') ``class_names``, which differ only in what a file system merges."""
    longest = max(names, key=len, default="")
    limits.check(
        "max_class_name_chars", len(longest), f"{where}: length of class name {longest[:40]!r}"
    )
    for name in names:
        if any(unicodedata.category(ch) == "Cc" for ch in name):
            raise DatasetError(
                f"{where}: class name {name[:60]!r} contains a control character "
                "(NUL, tab, newline, escape...)"
            )
        if any(unicodedata.category(ch) == "Cs" for ch in name):
            # a folder name that is not UTF-8 (an archive from another system's encoding):
            # decoded with surrogate escapes, it cannot be stored, shown or hashed as text
            raise DatasetError(
                f"{where}: class name {name[:60]!r} is not valid UTF-8 text; rename the "
                "folder (or re-create the archive) with UTF-8 names"
            )
        _check_name_looks(name, where)
    _check_lookalikes(names, where, folders=folders)


def _check_name_looks(name: str, where: str) -> None:
    """A name must read as what it is: no bidi controls (they make it display as another),
    not blank, no space at either end (``"cat "`` shows as ``"cat"``; Windows drops a
    folder's trailing space on extracting, and a blank one has nothing to show). ``str.strip``
    counts Unicode's spaces (NBSP, ideographic space) as spaces."""
    bidi = sorted({f"U+{ord(ch):04X}" for ch in name if ch in _BIDI_CONTROLS})
    if bidi:
        raise DatasetError(
            f"{where}: class name {name[:60]!r} contains bidirectional control characters "
            f"({', '.join(bidi)}), which make it display as another text; rename it"
        )
    if not name.strip():
        raise DatasetError(f"{where}: class name {name[:60]!r} is blank (empty or only spaces)")
    if name != name.strip():
        raise DatasetError(
            f"{where}: class name {name[:60]!r} begins or ends with a space, and looks like "
            f"{name.strip()[:60]!r}; remove the space"
        )


def _lookalike_key(name: str, *, folders: bool) -> str:
    """What a person sees of a name: compatibility forms folded (full-width ``ｃａｔ``,
    ligatures) and invisible format characters (zero-width space, joiner, BOM, soft hyphen:
    Unicode category Cf) dropped. For a folder name (``folders``), also what a file system
    keeps of it: letter case folded (macOS, Windows) and trailing dots dropped (Windows strips
    them). An npz's names never become folders, and ``A``/``a`` or ``v1.``/``v1`` are
    names a person tells apart (EMNIST's letters are classes ``A`` and ``a``)."""
    folded = unicodedata.normalize("NFKC", name)
    if folders:
        folded = unicodedata.normalize("NFKC", folded.casefold())
    visible = "".join(ch for ch in folded if unicodedata.category(ch) != "Cf")
    return visible.rstrip(".") if folders else visible


def _check_lookalikes(names: Sequence[str], where: str, *, folders: bool) -> None:
    """Two names that look alike are two classes a person cannot tell apart, and two folder
    names (``folders``) may be one folder: ``cat``/``Cat`` on a case-insensitive file system
    (macOS, Windows), where one class's images land in the other's folder on extracting;
    ``cat.``/``cat`` on Windows. An npz's (or arrays') ``class_names`` are never written as
    files or folders (exports, thumbnails, counts and caches keep them as JSON text or by
    label number), so there case and trailing dots are a difference, the other look-alikes
    are not. Compared by :func:`_lookalike_key`; ordinary Unicode names (``猫``, ``café``)
    pass."""
    seen: dict[str, str] = {}
    for name in names:
        other = seen.setdefault(_lookalike_key(name, folders=folders), name)
        if other == name:
            continue
        nfc = [unicodedata.normalize("NFC", n) for n in (other, name)]
        if nfc[0] == nfc[1]:
            how = "are the same name in two Unicode forms (composed and decomposed)"
        elif folders and nfc[0].casefold() == nfc[1].casefold():
            how = (
                "differ only in letter case, and are one folder on a case-insensitive file "
                "system (macOS, Windows)"
            )
        elif folders:
            how = (
                "look alike (they differ only in character width or compatibility form, "
                "letter case, invisible characters or trailing dots)"
            )
        else:
            how = (
                "look alike (they differ only in character width or compatibility form, "
                "or invisible characters)"
            )
        raise DatasetError(
            f"{where}: class names {other[:60]!r} and {name[:60]!r} {how}; merge or rename one"
        )


def _check_classes(
    labels: np.ndarray,
    names: Sequence[str],
    where: str,
    limits: DatasetLimits = DEFAULT_LIMITS,
    *,
    folders: bool,
) -> None:
    """At least 2 classes with images, within ``limits``, each name valid (``folders``: they
    are an ImageFolder's folder names, :func:`_check_names`) and each class full enough."""
    counts = np.bincount(labels, minlength=len(names))
    present = np.flatnonzero(counts)
    if len(present) < 2:
        shown = [names[i] for i in present]
        raise DatasetError(f"{where}: need at least 2 classes with images, found {shown}")
    limits.check("max_classes", len(names), f"{where}: number of classes")
    _check_names(names, where, limits, folders=folders)
    _check_counts(counts, names, where, limits.min_per_class)


def _check_counts(counts: np.ndarray, names: Sequence[str], where: str, least: int) -> None:
    """Every class holds ``least`` (``min_per_class``) images, a class that an npz's
    ``class_names`` declares and no label uses included: it has 0, short of any minimum, and
    a target cannot be ranked or fine-tuned for a class it has no image of. ``least`` 0 lets
    a declared class be empty, as a test split may lack one (:data:`_SPLIT_LIMITS`)."""
    if least < 1:
        return
    empty = [str(names[c]) for c in np.flatnonzero(counts == 0)]
    if empty:
        raise LimitExceeded(
            f"{where}: class_names declares {len(empty)} class(es) with no images "
            f"({_listed(empty)}); every class needs at least {least}, the limit "
            f"min_per_class={least}"
        )
    few = [str(names[c]) for c in np.flatnonzero(counts < least)]
    if few:
        shown = ", ".join(few[:5]) + (f" and {len(few) - 5} more" if len(few) > 5 else "")
        raise LimitExceeded(
            f"{where}: {len(few)} class(es) with fewer than {least} images "
            f"({shown}); the limit min_per_class={least}"
        )


def _listed(names: Sequence[str], shown: int = 5) -> str:
    """The first ``shown`` names, quoted (a blank or spaced name stays visible), and how many
    more there are."""
    head = ", ".join(repr(n[:60]) for n in names[:shown])
    return head + (f" and {len(names) - shown:,} more" if len(names) > shown else "")


# ---- npz


def _check_x_shape(shape: tuple[int, ...], where: str) -> None:
    """An images array's shape must be (N,H,W), (N,H,W,1) or (N,H,W,3): checked from a header's
    shape as from an array's."""
    if len(shape) == 4 and shape[-1] not in (1, 3):
        hint = " (looks channels-first: use x.transpose(0, 2, 3, 1))" if shape[1] in (1, 3) else ""
        raise DatasetError(
            f"{where}: x must be (N,H,W), (N,H,W,1) or (N,H,W,3) channels-last, got shape "
            f"{shape}{hint}"
        )
    if len(shape) not in (3, 4) or 0 in shape:
        raise DatasetError(f"{where}: x must be (N,H,W), (N,H,W,1) or (N,H,W,3), got shape {shape}")


def _check_x_dtype(dtype: np.dtype, where: str) -> None:
    if dtype == np.bool_ or not (
        np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)
    ):
        raise DatasetError(f"{where}: x must be uint8 or float in [0, 1], got dtype {dtype}")


def _to_uint8(x: np.ndarray, where: str) -> np.ndarray:
    """Pixel values as uint8: uint8 as is, floats in [0, 1] scaled, integers in 0..255 cast
    (works on a whole array or on any chunk of one)."""
    _check_x_dtype(x.dtype, where)
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if not x.size:
        return np.zeros(x.shape, np.uint8)
    if np.issubdtype(x.dtype, np.floating):
        if not np.isfinite(x).all() or x.min() < 0 or x.max() > 1:
            raise DatasetError(f"{where}: float x must lie in [0, 1] (got {x.min()}..{x.max()})")
        return np.rint(x * 255).astype(np.uint8)
    if x.min() < 0 or x.max() > 255:
        raise DatasetError(f"{where}: integer x must lie in 0..255 (got {x.min()}..{x.max()})")
    return x.astype(np.uint8)


def _check_labels(
    y: Any, class_names: Any, n_images: int, where: str, limits: DatasetLimits = DEFAULT_LIMITS
) -> tuple[np.ndarray, list[str]]:
    """(labels indexing the class names, class names) from ``y`` and optional names."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DatasetError(f"{where}: y must be a 1-D label vector, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        raise DatasetError(f"{where}: y must hold integer labels, got dtype {y.dtype}")
    if len(y) != n_images:
        raise DatasetError(f"{where}: x has {n_images} images but y has {len(y)} labels")
    if len(y) and y.min() < 0:
        raise DatasetError(f"{where}: labels must be non-negative, got {y.min()}")
    if class_names is None:
        present, labels = np.unique(y, return_inverse=True)
        names = [str(v) for v in present]
    else:
        arr = np.asarray(class_names)
        if arr.ndim != 1 or arr.dtype.kind not in "US":
            raise DatasetError(f"{where}: class_names must be a 1-D string array")
        names = [v.decode() if isinstance(v, bytes) else str(v) for v in arr.tolist()]
        if len(set(names)) != len(names):
            raise DatasetError(f"{where}: class_names has duplicates")
        if len(y) and y.max() >= len(names):
            raise DatasetError(
                f"{where}: label {y.max()} has no class name ({len(names)} class_names)"
            )
        labels = y
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    _check_classes(labels, names, where, limits, folders=False)
    return labels, names


def _check_arrays(
    x: Any, y: Any, class_names: Any, where: str, limits: DatasetLimits = DEFAULT_LIMITS
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    x = np.asarray(x)
    _check_x_shape(x.shape, where)
    images = _to_uint8(x, where)
    if images.ndim == 4 and images.shape[-1] == 1:
        images = np.ascontiguousarray(images[..., 0])
    labels, names = _check_labels(y, class_names, len(images), where, limits)
    return images, labels, names


# ---- ImageFolder


class _Reader:
    """Lists the regular files of a folder or archive (posix relative names) and reads them,
    counting bytes against ``limits`` as they arrive."""

    where: str
    limits: DatasetLimits = DEFAULT_LIMITS
    budget: Budget | None = None
    produced: int = 0  # uncompressed bytes read so far
    archive_bytes: int | None = None  # the compressed archive's size, for its overall ratio

    def _count(self, n: int, name: str) -> None:
        self.produced += n
        self.limits.check("max_total_bytes", self.produced, f"{self.where}: uncompressed bytes")
        if self.archive_bytes is not None:  # members overlapping one compressed kernel
            self.limits.check_ratio(self.produced, self.archive_bytes, self.where)
        if self.budget is not None:
            self.budget.check(self.where)

    def _read_stream(self, fh: Any, name: str, compressed: int | None) -> bytes:
        """All of ``fh``, chunk by chunk: the member limit, the running total and (for a
        compressed member) the ratio are checked as bytes come out, since headers can lie."""
        parts: list[bytes] = []
        got = 0
        what = f"{self.where}: member {name}"
        while True:
            chunk = fh.read(_READ_CHUNK)
            if not chunk:
                break
            got += len(chunk)
            self.limits.check("max_member_bytes", got, f"{what} uncompressed bytes")
            if compressed is not None:
                self.limits.check_ratio(got, compressed, what)
            self._count(len(chunk), name)
            parts.append(chunk)
        return b"".join(parts)

    def names(self) -> list[str]:
        raise NotImplementedError

    def size(self, name: str) -> int:
        raise NotImplementedError

    def read(self, names: Sequence[str]) -> list[bytes]:
        raise NotImplementedError

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _safe_member(name: str, where: str) -> str | None:
    """The member's normalised relative name, or None for directories. Absolute names and
    ``..`` components are refused: nothing may point outside the archive."""
    name = name.replace("\\", "/")
    drive = len(name) > 1 and name[1] == ":" and name[0].isascii() and name[0].isalpha()
    if name.startswith("/") or drive:  # "C:/x" or "C:x"; a class "4:3" is a name
        raise DatasetError(f"{where}: unsafe archive member {name!r} (absolute path)")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise DatasetError(f"{where}: unsafe archive member {name!r} (path traversal)")
    return "/".join(parts) or None


class _DirReader(_Reader):
    def __init__(self, root: Path, limits: DatasetLimits = DEFAULT_LIMITS) -> None:
        self.root = root
        self.where = root.name
        self.limits = limits
        self._sizes: dict[str, int] = {}
        # linked folders are followed as linked files are (a class folder that is a symlink
        # would otherwise vanish without a word); a link back into a folder being walked
        # would walk forever, and is refused
        walking: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames[:] = [d for d in dirnames if not _ignored(d)]
            rel = Path(dirpath).relative_to(root)
            real = os.path.realpath(dirpath)
            for ancestor in rel.parents:
                if walking.get(ancestor.as_posix()) == real:
                    raise DatasetError(
                        f"{self.where}: folder link {rel.as_posix()!r} leads back to "
                        f"{ancestor.as_posix()!r}, a loop"
                    )
            walking[rel.as_posix()] = real
            for f in filenames:
                p = Path(dirpath) / f
                if p.is_file():
                    self._sizes[(rel / f).as_posix()] = p.stat().st_size

    def names(self) -> list[str]:
        return list(self._sizes)

    def size(self, name: str) -> int:
        return self._sizes[name]

    def read(self, names: Sequence[str]) -> list[bytes]:
        for n in names:
            self.limits.check("max_member_bytes", self._sizes[n], f"{self.where}: file {n} bytes")
        self.limits.check(
            "max_total_bytes", sum(self._sizes[n] for n in names), f"{self.where}: image bytes"
        )

        def one(i: int) -> bytes:
            try:
                return (self.root / names[i]).read_bytes()
            except OSError as exc:
                raise DatasetError(f"cannot read {names[i]}: {exc}") from exc

        return _parallel(one, len(names))


class _ZipReader(_Reader):
    def __init__(
        self, path: Path, limits: DatasetLimits = DEFAULT_LIMITS, budget: Budget | None = None
    ) -> None:
        self.where = path.name
        self.limits = limits
        self.budget = budget
        self.archive_bytes = path.stat().st_size
        self.zf = open_zip(path, limits, budget, "zip archive")  # entries counted first
        self.members: dict[str, zipfile.ZipInfo] = {}
        try:
            infos = self.zf.infolist()
            limits.check("max_members", len(infos), f"{self.where}: archive entries")
            for info in infos:
                name = _safe_member(info.filename, self.where)
                if name is not None and not info.is_dir():
                    if stat.S_ISLNK(info.external_attr >> 16) and _is_image(name):
                        # its data is the target's path, not an image
                        raise DatasetError(
                            f"{self.where}: member {info.filename!r} is a symbolic link; zip "
                            "links are not followed: put the image itself in the archive"
                        )
                    _check_unique(self.members, name, info.filename, self.where)
                    self.members[name] = info
        except DatasetError:
            self.zf.close()
            raise

    def names(self) -> list[str]:
        return list(self.members)

    def size(self, name: str) -> int:
        return self.members[name].file_size

    def read(self, names: Sequence[str]) -> list[bytes]:
        out = []
        for n in names:
            info = self.members[n]
            if info.flag_bits & 0x1:  # zipfile would ask for a password (RuntimeError)
                raise DatasetError(f"{self.where}: member {n} is encrypted")
            # the declared size first (cheap); then counted while inflating (it can lie)
            self.limits.check(
                "max_member_bytes", info.file_size, f"{self.where}: member {n} declared bytes"
            )
            try:
                with self.zf.open(info) as fh:
                    out.append(self._read_stream(fh, n, info.compress_size))
            except DatasetError:
                raise
            except ZIP_ERRORS as exc:
                raise DatasetError(f"{self.where}: cannot read member {n}: {_plain(exc)}") from exc
        return out

    def __exit__(self, *exc: object) -> None:
        self.zf.close()


class _TarReader(_Reader):
    """A tar, plain or compressed, walked through a :class:`MeteredStream`: the headers are
    walked (and what they skip inflated) under the stream bound, the ratio and the CPU
    budget, and each header's declared size is checked as it is read."""

    def __init__(
        self, path: Path, limits: DatasetLimits = DEFAULT_LIMITS, budget: Budget | None = None
    ) -> None:
        self.where = path.name
        self.limits = limits
        self.budget = budget or Budget(limits)
        self.stream = MeteredStream(path, limits, self.budget)
        try:
            self.tf = tarfile.open(fileobj=self.stream, mode="r:")  # noqa: SIM115 - __exit__
        except DatasetError:
            self.stream.close()
            raise
        except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as exc:
            self.stream.close()
            raise DatasetError(f"{path.name}: not a readable tar archive: {_plain(exc)}") from exc
        self.members: dict[str, tarfile.TarInfo] = {}
        links: dict[str, tuple[str, str]] = {}  # link -> (its target, its name as archived)
        count = 0
        bound = limits.stream_bytes()
        try:
            # one entry at a time, so a flood of entries stops at the limit, not in memory,
            # and a header declaring gigabytes is refused before they are inflated to skip it
            while (info := self.tf.next()) is not None:
                count += 1
                self.tf.members.clear()  # tarfile's own list of every entry: not kept
                limits.check("max_members", count, f"{self.where}: archive entries")
                name = _safe_member(info.name, self.where)
                if info.issym() or info.islnk():
                    target = _check_link(info, self.where)
                    if name is not None:
                        links[name] = (target, info.name)
                    continue  # resolved once every member is known (a target may follow)
                if not info.isfile() or name is None:
                    continue
                _check_unique(self.members, name, info.name, self.where)
                if bound is not None and info.offset_data + info.size > bound:
                    limits.check(
                        "max_total_bytes",
                        info.offset_data + info.size,
                        f"{self.where}: member {name} declares {info.size:,} bytes; the tar "
                        "stream up to its end",
                    )
                if _is_image(name):
                    limits.check(
                        "max_member_bytes", info.size, f"{self.where}: member {name} bytes"
                    )
                self.members[name] = info
            self._follow(links)
        except DatasetError:
            self.__exit__()
            raise
        except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as exc:
            self.__exit__()
            raise DatasetError(f"{path.name}: not a readable tar archive: {_plain(exc)}") from exc

    def _follow(self, links: dict[str, tuple[str, str]]) -> None:
        """An image that is a link (GNU tar stores a second path to one file as a hard link;
        a symlink within the archive) reads its target's data: dropping it would silently
        lose images, or a whole class. A link to a folder, to nothing in the archive, or
        round in a loop is refused by name."""
        folders = {posixpath.dirname(n) for n in self.members}
        for folder in list(folders):
            while folder:
                folder = posixpath.dirname(folder)
                folders.add(folder)
        for name, (target, archived) in links.items():
            if any(_ignored(p) for p in name.split("/")):
                continue
            seen = {name}
            while target in links and target not in seen:  # a link to a link
                seen.add(target)
                target = links[target][0]
            if target in self.members:
                if _is_image(name):
                    _check_unique(self.members, name, archived, self.where)
                    self.members[name] = self.members[target]
            elif target in seen:
                raise DatasetError(f"{self.where}: link {archived!r} leads round in a loop")
            elif target in folders:
                raise DatasetError(
                    f"{self.where}: link {archived!r} points to the folder {target!r}; links to "
                    "folders are not followed: put the images themselves in the archive"
                )
            elif _is_image(name):
                raise DatasetError(
                    f"{self.where}: link {archived!r} points to {target!r}, which is not a "
                    "file in the archive"
                )

    def names(self) -> list[str]:
        return list(self.members)

    def size(self, name: str) -> int:
        return self.members[name].size

    def read(self, names: Sequence[str]) -> list[bytes]:
        # in archive order, so a compressed stream is only ever read forwards
        order = sorted(range(len(names)), key=lambda i: self.members[names[i]].offset_data)
        out: list[bytes] = [b""] * len(names)
        last: tuple[tarfile.TarInfo, bytes] | None = None
        for i in order:
            info = self.members[names[i]]
            if last is not None and last[0] is info:  # a link to the member just read
                out[i] = last[1]
                self._count(len(last[1]), names[i])
                continue
            self.limits.check(
                "max_member_bytes", info.size, f"{self.where}: member {names[i]} bytes"
            )
            try:
                fh = self.tf.extractfile(info)
                if fh is None:
                    raise DatasetError(f"{self.where}: member {names[i]} is not a file")
                out[i] = self._read_stream(fh, names[i], None)  # the stream meters the ratio
                last = (info, out[i])
            except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as exc:
                raise DatasetError(
                    f"{self.where}: cannot read member {names[i]}: {_plain(exc)}"
                ) from exc
        return out

    def __exit__(self, *exc: object) -> None:
        self.tf.close()
        self.stream.close()


def _check_link(info: tarfile.TarInfo, where: str) -> str:
    """The member a link points to, as a normalised name; a link whose target lies outside
    the archive is refused (symlinks are relative to their own folder, hard links to the
    archive root)."""
    target = info.linkname.replace("\\", "/")
    if target.startswith("/"):
        raise DatasetError(f"{where}: unsafe archive link {info.name!r} -> {target!r}")
    if info.issym():
        target = posixpath.join(posixpath.dirname(info.name.replace("\\", "/")), target)
    target = posixpath.normpath(target)
    if target == ".." or target.startswith("../"):
        raise DatasetError(f"{where}: unsafe archive link {info.name!r} -> {info.linkname!r}")
    return "" if target == "." else target


def _check_unique(members: dict[str, Any], name: str, archived: str, where: str) -> None:
    """Refuse a second member of the same name (an archive may hold ``a/1.png`` twice, or as
    ``a//1.png`` and ``./a/1.png``): which copy is the image would be a guess."""
    if name in members:
        raise DatasetError(
            f"{where}: member {name!r} appears twice (again as {archived!r}); which copy is "
            "the image is ambiguous"
        )


def _ignored(part: str) -> bool:
    return part.startswith(".") or part == "__MACOSX"


def _is_image(name: str) -> bool:
    return PurePosixPath(name).suffix.lower() in IMAGE_EXTENSIONS


def _class_files(names: Iterable[str], where: str) -> dict[str, list[str]]:
    """Class folder -> sorted image files (recursively), after unwrapping single top-level
    folders; hidden entries, __MACOSX and other files beside the class folders (a README)
    are ignored, and an image beside them is refused (:func:`_refuse_stray`)."""
    visible = [n for n in names if not any(_ignored(p) for p in n.split("/"))]
    prefix = ""
    while True:
        below = [n[len(prefix) :] for n in visible if n.startswith(prefix)]
        top_dirs = {n.split("/", 1)[0] for n in below if "/" in n}
        top_images = [n for n in below if "/" not in n and _is_image(n)]
        if len(top_dirs) == 1 and not top_images:
            # a lone folder holding folders wraps the classes (a zip of the dataset's folder),
            # even with images beside those folders: as the only class it could never load,
            # as a wrapper its stray images are named below
            (only,) = top_dirs
            if any("/" in n[len(only) + 1 :] for n in below if n.startswith(only + "/")):
                prefix += only + "/"
                continue
        break
    classes: dict[str, list[str]] = {}
    spelt: dict[str, str] = {}
    stray: list[str] = []
    for n in visible:
        if not n.startswith(prefix):
            continue
        rest = n[len(prefix) :]
        if "/" not in rest:  # beside the class folders: a README or labels.csv is no image
            if _is_image(rest):
                stray.append(n)
            continue
        folder = rest.split("/", 1)[0]
        # one spelling of a name whatever the file system wrote: macOS stores "café" as
        # decomposed characters (NFD), Linux as composed (NFC); the same dataset zipped on
        # either must have the same classes (and digest). Two folders that differ only in
        # that form are two classes nobody could tell apart: refused.
        cls = unicodedata.normalize("NFC", folder)
        if spelt.setdefault(cls, folder) != folder:
            raise DatasetError(
                f"{where}: class folders {spelt[cls]!r} and {folder!r} are the same name in two "
                "Unicode forms (composed and decomposed): merge or rename one"
            )
        files = classes.setdefault(cls, [])
        if _is_image(rest):
            files.append(n)
    if not classes:
        raise DatasetError(
            f"{where}: no class folders found (expected one sub-folder of images per class)"
        )
    _refuse_stray(sorted(stray), where)
    empty = sorted(c for c, f in classes.items() if not f)
    if empty:
        raise DatasetError(
            f"{where}: class folder(s) with no images: {', '.join(empty)} "
            f"(image extensions: {', '.join(sorted(IMAGE_EXTENSIONS))})"
        )
    return {c: sorted(classes[c]) for c in sorted(classes)}


def _refuse_stray(images: Sequence[str], where: str) -> None:
    """Images beside the class folders belong to no class: skipping them would lose them
    without a word (a class's images extracted one level too high, a cover picture), and
    which class they were meant for is a guess. Named, so they can be moved or deleted."""
    if images:
        raise DatasetError(
            f"{where}: {len(images)} image file(s) beside the class folders, in no class "
            f"({_listed(images)}); move each into its class's folder, or delete it"
        )


def _load_folder(
    reader: _Reader,
    name: str,
    max_per_class: int | None,
    seed: int,
    limits: DatasetLimits = DEFAULT_LIMITS,
) -> TargetDataset:
    where = reader.where
    classes = _class_files(reader.names(), where)
    class_names = list(classes)
    if len(class_names) < 2:
        raise DatasetError(f"{where}: need at least 2 classes, found {class_names}")
    files = [f for c in class_names for f in classes[c]]
    labels = np.array([k for k, c in enumerate(class_names) for _ in classes[c]], dtype=np.int64)
    _check_classes(labels, class_names, where, limits, folders=True)
    keep = _subsample(labels, class_names, max_per_class, seed)
    files = [files[i] for i in keep]
    labels = labels[keep]
    for f in files:  # declared sizes first: a bomb is named before anything is inflated
        limits.check("max_member_bytes", reader.size(f), f"{where}: member {f} declared bytes")
    total = sum(reader.size(f) for f in files)
    limits.check("max_total_bytes", total, f"{where}: declared image bytes")
    blobs = reader.read(files)
    # decode each image once now, so a corrupt file is named at load time
    budget = reader.budget or Budget(limits)

    gate = _PixelGate(2 * limits.max_pixels if limits.max_pixels else None)

    def check(i: int) -> None:
        budget.check(where)
        source = f"{where}/{files[i]}"
        with gate.hold(_decode_pixels(blobs[i], limits, source)):
            _decode(blobs[i], source, draft=True, limits=limits)

    _parallel(check, len(blobs))
    ds = TargetDataset(name, labels, class_names, "", blobs, files, limits=limits)
    ds.digest = ds.compute_digest()
    return ds


_SPLIT_LIMITS = replace(DEFAULT_LIMITS, min_per_class=0)
"""The defaults, less ``min_per_class``: test data may lack a class of the training data's
``class_names`` (a small test split often does); training data may not."""


def load_test_data(
    path: str | Path,
    train_path: str | Path,
    class_names: Sequence[str],
    limits: DatasetLimits | None = None,
) -> TargetDataset:
    """The test data a run names, checked against its training data's classes.

    The training file itself as test data means that file's own test split (Keras layout
    ``x_test``/``y_test``): testing on the training images would be a silent wrong answer.
    Its labels are mapped onto ``class_names`` by name: a test folder that lacks a class, or
    lists the classes in another order, is read as the training data names them. A test class
    with images that the training data never has is a :class:`DatasetError` (a model trained
    on it cannot predict it). One function, so ``zoopick train`` refuses what its workers
    would fail on. ``limits``: those of the training data (default: the library's); a test
    set may lack a class, so ``min_per_class`` is lifted."""
    same = Path(path).expanduser().resolve() == Path(train_path).expanduser().resolve()
    bounds = _SPLIT_LIMITS if limits is None else replace(limits, min_per_class=0)
    test = load_dataset(path, split="test" if same else "train", limits=bounds)
    counts = test.class_counts()
    unseen = [n for n in test.class_names if counts[n] and n not in set(class_names)]
    if unseen:
        raise DatasetError(
            f"test data has {len(unseen)} class(es) the training data never has: "
            f"{_preview(unseen)} (its classes: {_preview(class_names)}); a model trained on it "
            "cannot predict them, so its test accuracy would count each of their images as wrong"
        )
    if list(test.class_names) == list(class_names):
        return test
    index = {name: i for i, name in enumerate(class_names)}
    # a listed test class without images maps nowhere, and no label points at it
    mapping = np.array([index.get(name, -1) for name in test.class_names], dtype=np.int64)
    mapped = replace(test, labels=mapping[test.labels], class_names=list(class_names))
    mapped.digest = mapped.compute_digest()  # the labels and names are part of it
    return mapped


def check_test_split_labels(
    y_train: np.ndarray, y_test: Any, class_names: Sequence[str] | None, where: str, keys: str
) -> None:
    """An npz's Keras test split (``y_test``) may hold no label its training split (``keys``:
    ``y_train`` or ``y``) never has: a model trained on it cannot predict such a label, and
    the test accuracy would count each of its images as wrong without a word. ``y_train`` is
    the checked training labels as the file has them (before any remapping)."""
    y = np.asarray(y_test)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        raise DatasetError(
            f"{where}: y_test must be a 1-D vector of integer labels, got shape {y.shape} "
            f"and dtype {y.dtype}"
        )
    unseen = np.setdiff1d(np.unique(y), np.unique(np.asarray(y_train).reshape(-1)))
    if not len(unseen):
        return
    names = list(class_names) if class_names is not None else []

    def label(v: int) -> str:
        return f"{v} ({names[v]!r})" if 0 <= v < len(names) else str(v)

    shown = ", ".join(label(int(v)) for v in unseen[:5])
    more = f" and {len(unseen) - 5} more" if len(unseen) > 5 else ""
    counted = int(np.isin(y, unseen).sum())
    raise DatasetError(
        f"{where}: y_test has {len(unseen)} label(s) that {keys} never has: {shown}{more} "
        f"({counted} test image(s)); a model trained on {keys} cannot predict them, so its "
        "test accuracy would count each as wrong: remove them from x_test/y_test, or add "
        "training images of them"
    )


def _preview(names: Sequence[str], shown: int = 5) -> str:
    """A few class names for a message (a dataset may have thousands)."""
    head = ", ".join(repr(str(n)) for n in list(names)[:shown])
    more = len(names) - shown
    return f"[{head}{f', ... {more} more' if more > 0 else ''}] ({len(names)})"


# --------------------------------------------------------------------------------------------
# splitting


def split_count(members: int, fraction: float) -> int:
    """How many of a class's ``members`` images :func:`split_dataset` holds out:
    ``round(members * fraction)``, at least 1 and leaving at least 1; none of a class with
    fewer than 2 (one place for the rule, so a planner can count a split without loading)."""
    if members < 2:
        return 0
    return min(max(int(round(members * fraction)), 1), members - 1)


def training_count(
    counts: Iterable[int], *, max_per_class: int | None = None, fractions: Sequence[float] = ()
) -> int:
    """Images left to train on from classes of these sizes, without loading them: each class
    capped at ``max_per_class``, less each split's held-out share in turn (:func:`split_count`,
    the trainer's own rule), and 0 where a split finds no class of 2 images to split (the
    trainer refuses that run). The one count a race's plan and a fine-tune's submission use."""
    if max_per_class is not None:  # as load_dataset takes it (2.5 had capped at 2.5 images)
        max_per_class = _whole(max_per_class, "max_per_class", least=1)
    sizes = [min(int(n), max_per_class) if max_per_class else int(n) for n in counts]
    for fraction in fractions:
        if not any(n >= 2 for n in sizes):  # split_dataset refuses: nothing to split
            return 0
        sizes = [n - split_count(n, fraction) for n in sizes]
    return sum(sizes)


def split_dataset(
    ds: TargetDataset, test_fraction: float, seed: int
) -> tuple[TargetDataset, TargetDataset]:
    """Stratified (train, test) split: each class with at least 2 images puts
    ``round(count * test_fraction)`` of them (at least 1, and leaving at least 1) into test.
    Both parts keep the original order."""
    if not 0 < test_fraction < 1:
        raise DatasetError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    seed = _whole(seed, "seed", least=0)
    test_idx = []
    for c, cname in enumerate(ds.class_names):
        members = np.flatnonzero(ds.labels == c)
        n_test = split_count(len(members), test_fraction)
        if not n_test:
            continue
        rng = np.random.default_rng([seed, zlib.crc32(str(cname).encode())])
        test_idx.append(rng.choice(members, n_test, replace=False))
    if not test_idx:
        raise DatasetError(f"dataset {ds.name!r}: no class has 2 images to split")
    mask = np.zeros(len(ds), dtype=bool)
    mask[np.concatenate(test_idx)] = True
    return ds.subset(np.flatnonzero(~mask)), ds.subset(np.flatnonzero(mask))
