"""Reading an ``.npz`` dataset under :class:`~zoopick.selection.limits.DatasetLimits`.

``numpy.load`` would parse the whole zip directory, inflate each array whole at whatever
ratio its member has, and leave the float-to-uint8 conversion to allocate several float
copies of ``x``: a 1.5 MB file of 10,900 float64 images (ratio about 680) cost 3.9 GB. Here
the zip directory is counted first (:func:`~zoopick.selection.archives.check_zip_directory`),
each array's size is read from its ``.npy`` header and checked, with the member's compression
ratio, before a byte of data is inflated, and ``x`` is streamed in chunks straight into the
uint8 array the dataset keeps (only the rows a ``max_per_class`` subset keeps), so the peak
is that array plus one chunk.
"""

from __future__ import annotations

import tokenize
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from zoopick.selection.archives import ZIP_ERRORS, open_zip
from zoopick.selection.data import (
    TargetDataset,
    _check_labels,
    _check_x_dtype,
    _check_x_shape,
    _plain,
    _subsample,
    _to_uint8,
    check_test_split_labels,
)
from zoopick.selection.errors import DatasetError
from zoopick.selection.limits import Budget, DatasetLimits

__all__ = ["load_npz"]

_CHUNK_ITEMS = 1 << 20
_READ_ERRORS = tuple(e for e in ZIP_ERRORS if e is not ValueError)


def _header(fh: BinaryIO, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) from an ``.npy`` header, reading nothing of the data."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(fh)
        else:
            raise DatasetError(f"{where}: unsupported .npy format version {version}")
    except DatasetError:
        raise
    except (ValueError, SyntaxError, TypeError, tokenize.TokenError, *_READ_ERRORS) as exc:
        # numpy tokenizes the header's dict: a mangled one can end in a TokenError
        raise DatasetError(f"{where}: malformed .npy header: {_plain(exc)}") from exc
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise DatasetError(f"{where}: cannot read arrays: object arrays are not allowed")
    return tuple(int(d) for d in shape), bool(fortran), dtype


def _read_exact(fh: BinaryIO, n: int, where: str) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise DatasetError(f"{where}: the array's data ends early ({len(data):,} of {n:,} bytes)")
    return data


class _Npz:
    """The arrays of one npz file: headers checked against the limits on opening each."""

    def __init__(self, path: Path, limits: DatasetLimits, budget: Budget) -> None:
        self.where = path.name
        self.limits = limits
        self.budget = budget
        self.zf = open_zip(path, limits, budget, ".npz file")
        self.infos: dict[str, zipfile.ZipInfo] = {}
        for info in self.zf.infolist():  # numpy's names: "x" for "x.npy"
            name = info.filename
            self.infos[name[:-4] if name.endswith(".npy") else name] = info
        self.total = 0

    def open(self, key: str) -> tuple[BinaryIO, tuple[int, ...], bool, np.dtype]:
        """The member's stream positioned at its data, its header checked: the bytes it
        declares (alone and with the arrays before it), the ratio of those bytes to the
        member's compressed size, and for ``x`` the image count and pixels per image."""
        info = self.infos[key]
        what = f"{self.where}: array {key!r}"
        if info.flag_bits & 0x1:  # zipfile would ask for a password (RuntimeError)
            raise DatasetError(f"{what} is encrypted")
        fh: Any = self.zf.open(info)
        try:
            shape, fortran, dtype = _header(fh, what)
            images = key.startswith("x")
            if images and len(shape) >= 3:
                self.limits.check("max_members", shape[0], f"{self.where}: images in {key!r}")
                self.limits.check(
                    "max_pixels", shape[1] * shape[2], f"{self.where}: pixels per image"
                )
            elif key.startswith("y") and shape:  # one label per image
                self.limits.check("max_members", shape[0], f"{self.where}: labels in {key!r}")
                if int(np.prod(shape, dtype=object)) != shape[0]:  # before it is inflated
                    raise DatasetError(
                        f"{what}: labels must be a 1-D vector (or N x 1), got shape {shape}"
                    )
            elif key == "class_names" and shape:
                self.limits.check("max_classes", shape[0], f"{self.where}: class_names")
                chars = dtype.itemsize // 4 if dtype.kind == "U" else dtype.itemsize
                if dtype.kind in "US":  # the widest name, from the header alone
                    self.limits.check(
                        "max_class_name_chars", chars, f"{self.where}: class_names width"
                    )
            size = dtype.itemsize * int(np.prod(shape, dtype=object))
            self.limits.check("max_total_bytes", size, f"{what} bytes")
            self.total += size
            self.limits.check("max_total_bytes", self.total, f"{self.where}: bytes of all arrays")
            if images:  # labels are bounded by their count (sorted ones compress 1000-fold)
                self.limits.check_ratio(size, info.compress_size, what)
        except BaseException:
            fh.close()
            raise
        return fh, shape, fortran, dtype

    def small(self, key: str) -> np.ndarray:
        """A labels or names array, read whole (its size was checked first)."""
        fh, shape, fortran, dtype = self.open(key)
        with fh:
            data = _read_exact(fh, dtype.itemsize * int(np.prod(shape)), self.where)
        arr = np.frombuffer(data, dtype)
        return arr.reshape(shape[::-1]).transpose() if fortran else arr.reshape(shape)

    def images(self, key: str, keep: np.ndarray | None) -> np.ndarray:
        """``x`` as uint8, converted chunk by chunk as it is inflated, only rows ``keep``."""
        fh, shape, fortran, dtype = self.open(key)
        what = self.where
        with fh:
            _check_x_shape(shape, what)
            _check_x_dtype(dtype, what)
            n, row = shape[0], int(np.prod(shape[1:]))
            if fortran:  # column-major: rows are not contiguous, read whole (size checked)
                data = _read_exact(fh, dtype.itemsize * n * row, what)
                arr = np.frombuffer(data, dtype).reshape(shape[::-1]).transpose()
                out = _to_uint8(arr if keep is None else arr[keep], what).reshape(-1)
            else:
                kept = np.ones(n, bool) if keep is None else np.zeros(n, bool)
                if keep is not None:
                    kept[keep] = True
                out = np.empty(int(kept.sum()) * row, np.uint8)
                done = written = 0
                while done < n * row:
                    k = min(_CHUNK_ITEMS, n * row - done)
                    chunk = np.frombuffer(_read_exact(fh, k * dtype.itemsize, what), dtype)
                    part = _to_uint8(chunk, what)
                    if keep is not None:
                        part = part[kept[(done + np.arange(k)) // row]]
                    out[written : written + len(part)] = part
                    written += len(part)
                    done += k
                    self.budget.check(what)
        images = out.reshape((-1, *shape[1:]))
        if images.ndim == 4 and images.shape[-1] == 1:
            images = images[..., 0]
        return np.ascontiguousarray(images)

    def close(self) -> None:
        self.zf.close()


def load_npz(
    path: Path,
    name: str,
    max_per_class: int | None,
    seed: int,
    split: str,
    limits: DatasetLimits,
    budget: Budget,
) -> TargetDataset:
    """An npz dataset (``x``/``y``, Keras ``x_train``... or ``x_test``... and optional
    ``class_names``), within ``limits``; see the module's docstring for how."""
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic[:4] != b"PK\x03\x04" and magic[:4] != b"PK\x05\x06":
        what = "a single .npy array" if magic.startswith(b"\x93NUM") else "not a zip file"
        raise DatasetError(
            f"{path.name}: not an .npz archive ({what}); save with numpy.savez(file, x=..., y=...)"
        )
    try:
        npz = _Npz(path, limits, budget)
    except (ValueError, *_READ_ERRORS) as exc:
        if isinstance(exc, DatasetError):
            raise
        raise DatasetError(f"{path.name}: not a readable .npz file: {_plain(exc)}") from exc
    try:
        files = set(npz.infos)
        if split == "train":
            keys = ("x", "y") if {"x", "y"} <= files else ("x_train", "y_train")
        else:
            keys = ("x_test", "y_test")
        if not set(keys) <= files:
            raise DatasetError(
                f"{path.name}: needs arrays {keys[0]!r} and {keys[1]!r} for split "
                f"{split!r} (has {', '.join(sorted(files)) or 'none'})"
            )
        y = npz.small(keys[1])
        class_names = npz.small("class_names") if "class_names" in files else None
        # x's header first: its image count is what y must match
        before = npz.total
        fh, shape, _, _ = npz.open(keys[0])
        fh.close()
        npz.total = before  # counted again when x is read
        _check_x_shape(shape, path.name)
        labels, names = _check_labels(y, class_names, shape[0], path.name, limits)
        if split == "train" and {"x_test", "y_test"} <= files:
            # its test split is what a run tested on this file reads (load_test_data): refused
            # now, when the file is validated, rather than counted wrong at the end of a run
            check_test_split_labels(
                y,
                npz.small("y_test"),
                names if class_names is not None else None,
                path.name,
                keys[1],
            )
        keep = _subsample(labels, names, max_per_class, seed)
        subset = len(keep) != len(labels)
        images = npz.images(keys[0], keep if subset else None)
    except DatasetError:
        raise
    except (ValueError, TypeError) as exc:  # malformed members
        raise DatasetError(f"{path.name}: cannot read arrays: {_plain(exc)}") from exc
    except _READ_ERRORS as exc:
        raise DatasetError(f"{path.name}: not a readable .npz file: {_plain(exc)}") from exc
    finally:
        npz.close()
    if subset:
        labels = labels[keep]
    ds = TargetDataset(name, labels, names, "", images)
    ds.digest = ds.compute_digest()
    return ds
