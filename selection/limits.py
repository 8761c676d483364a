"""Resource limits for loading a dataset from an untrusted file.

A small upload can declare (or decompress to) gigabytes: a zip member that inflates to 1 GiB,
an ``.npz`` whose ``x`` claims shape (2, 23170, 23170), a PNG header of 60000 x 60000 pixels,
200,000 classes of one image each. Every limit here is checked *before* the memory it
guards is allocated: archive members are counted while they stream (their headers can lie),
npz arrays by the shapes in their ``.npy`` headers, images by their header's size. Each
rejection names the limit (its field name), so an operator knows which setting to raise.

The defaults suit a command-line user's own data; the service passes its ``ZOOPICK_*``
settings (``zoopick.service.settings``), kept far below a worker's memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from zoopick.selection.errors import LimitExceeded

__all__ = ["DEFAULT_LIMITS", "Budget", "DatasetLimits"]

MiB = 1 << 20
GiB = 1 << 30


def _exceeded(message: str) -> Exception:
    return LimitExceeded(message)


@dataclass(frozen=True)
class DatasetLimits:
    """Bounds on what loading one dataset may cost. ``None`` switches a limit off."""

    max_member_bytes: int | None = 256 * MiB
    """Uncompressed bytes of one archive member (one encoded image)."""
    max_total_bytes: int | None = 4 * GiB
    """Uncompressed bytes of all images of an archive, or of all arrays of an npz."""
    max_compression_ratio: float | None = 200.0
    """Uncompressed / compressed size of a zip member (or a whole compressed tar), checked once
    more than ``RATIO_FLOOR`` bytes came out (small files cannot be bombs)."""
    max_members: int | None = 1_000_000
    """Entries of an archive (files, folders, links alike) or images of an npz."""
    max_pixels: int | None = 64 * 1024 * 1024
    """Pixels (width x height) of one image, read from its header before decoding. It stands
    in for Pillow's own bound (``PIL.Image.MAX_IMAGE_PIXELS``) while a dataset's image is
    decoded: ``None`` lifts both; a number keeps Pillow's too, if lower, in our words."""
    max_classes: int | None = 100_000
    """Classes of a dataset (every metric's memory grows with it)."""
    max_class_name_chars: int | None = 200
    """Characters of one class name (a folder's name or an npz's ``class_names`` entry): the
    names are stored, listed and shown with the dataset, so their size is bounded too."""
    min_per_class: int = 1
    """Images every class must have, a class that an npz's ``class_names`` declares without
    images included (it has 0). 0 lets such a class be empty, as a test split may be."""
    max_cpu_seconds: float | None = None
    """CPU seconds (of the loading process, threads included) one load may spend reading,
    inflating and decoding: the backstop for inputs cheap in bytes and costly in work."""

    RATIO_FLOOR = 1 * MiB
    HEADER_BYTES_PER_ENTRY = 1024
    """What an archive entry's own headers may add to a tar stream (512-byte header, padding,
    a long name), and (a quarter of it) to a zip's central directory."""

    def stream_bytes(self) -> int | None:
        """Bytes an archive's whole inflated stream may hold (images, headers, padding, other
        members alike): ``max_total_bytes`` plus headers for ``max_members`` entries. A tar
        must be inflated to be walked, so this bounds walking it, not only reading images."""
        if self.max_total_bytes is None:
            return None
        return self.max_total_bytes + self.HEADER_BYTES_PER_ENTRY * (self.max_members or 0)

    def check(self, name: str, value: float, what: str) -> None:
        """Raise ``zoopick.selection.data.LimitExceeded`` if ``value`` is over limit ``name``."""
        limit = getattr(self, name)
        if limit is not None and value > limit:
            raise _exceeded(f"{what} ({value:,.0f}) is over the limit {name}={limit:,}")

    def check_ratio(self, produced: int, compressed: int, what: str) -> None:
        limit = self.max_compression_ratio
        if limit is None or produced <= self.RATIO_FLOOR:
            return
        ratio = produced / max(compressed, 1)
        if ratio > limit:
            raise _exceeded(
                f"{what} expands {ratio:,.0f}-fold, over the limit max_compression_ratio={limit:g}"
            )


class Budget:
    """The CPU time one load has spent, checked (``check``) between chunks of work, so a load
    that is cheap in bytes and costly in work stops at ``max_cpu_seconds``, not minutes later.
    Process CPU time: the decoding threads count too; a pool process' earlier tasks do not."""

    def __init__(self, limits: DatasetLimits) -> None:
        self.limit = limits.max_cpu_seconds
        self.start = time.process_time()

    def spent(self) -> float:
        return time.process_time() - self.start

    def check(self, what: str) -> None:
        if self.limit is not None and (spent := self.spent()) > self.limit:
            raise _exceeded(
                f"{what}: validation took {spent:.1f} s of CPU, over the limit "
                f"max_cpu_seconds={self.limit:g}"
            )


#: What :func:`zoopick.selection.data.load_dataset` applies when given no limits.
DEFAULT_LIMITS = DatasetLimits()
