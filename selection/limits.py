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

from dataclasses import dataclass

__all__ = ["DEFAULT_LIMITS", "DatasetLimits"]

MiB = 1 << 20
GiB = 1 << 30


def _exceeded(message: str) -> Exception:
    from zoopick.selection.data import LimitExceeded  # the dataset error family lives there

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
    """Pixels (width x height) of one image, read from its header before decoding."""
    max_classes: int | None = 100_000
    """Classes of a dataset (every metric's memory grows with it)."""
    min_per_class: int = 1
    """Images every class must have."""

    RATIO_FLOOR = 1 * MiB

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


#: What :func:`zoopick.selection.data.load_dataset` applies when given no limits.
DEFAULT_LIMITS = DatasetLimits()
