"""The dataset files the one loader (:func:`zoopick.selection.data.load_dataset`) reads, by
name: the only list of them, for the loader, the service's uploads and their messages.

Plain Python (no numpy, no Pillow), so the API checks an upload's name without importing the
loader.
"""

from __future__ import annotations

__all__ = ["ARCHIVE_SUFFIXES", "FILE_SUFFIXES", "file_format", "file_suffix", "listed"]

ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
"""ImageFolder archives (one sub-folder per class); a ``.zip`` or a tar of any compression."""
FILE_SUFFIXES = (".npz", *ARCHIVE_SUFFIXES)
"""Every file the loader reads (an ImageFolder directory aside)."""
_SAME_AS = {".tgz": ".tar.gz"}


def file_suffix(name: str) -> str:
    """The suffix of :data:`FILE_SUFFIXES` that the file ``name`` ends with, lower case (the
    longest that fits; "" for none)."""
    lower = name.lower()
    return next((s for s in sorted(FILE_SUFFIXES, key=len, reverse=True) if lower.endswith(s)), "")


def file_format(name: str) -> str | None:
    """The format the loader reads the file ``name`` as: ``npz``, ``zip``, ``tar``,
    ``tar.gz`` (``.tgz`` too), ``tar.bz2`` or ``tar.xz``; None for a name it does not read."""
    suffix = file_suffix(name)
    return _SAME_AS.get(suffix, suffix)[1:] or None


def listed(suffixes: tuple[str, ...] = FILE_SUFFIXES) -> str:
    """``suffixes`` as words, for messages: ``.npz, .zip, ... or .tar.xz``."""
    return f"{', '.join(suffixes[:-1])} or {suffixes[-1]}"
