"""A dataset decoded once at validation (``selection.decoded``) is the dataset the loader gives:
same labels, classes, pixels and digest (so the same feature-cache keys and scores), a
``max_per_class`` subset included; scoring reads it without the file, and falls back to the
loader (and its limits) where the copy is missing or over today's limits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from zoopick.selection import decoded
from zoopick.selection.data import DatasetError, load_dataset


def _same(a, b) -> None:
    assert a.digest == b.digest
    assert a.class_names == b.class_names
    assert np.array_equal(a.labels, b.labels)
    for i in range(len(a)):
        assert np.array_equal(np.asarray(a.image(i)), np.asarray(b.image(i)))


def test_the_decoded_copy_is_the_loaded_dataset(tiny_imagefolder: Path, tmp_path: Path) -> None:
    loaded = load_dataset(tiny_imagefolder)
    assert decoded.write(loaded, tmp_path / "decoded", max_bytes=None)
    _same(decoded.load(tmp_path / "decoded"), loaded)
    # a per-class subset: the loader's pick and digest, from the stored file hashes
    _same(
        decoded.load(tmp_path / "decoded", max_per_class=3),
        load_dataset(tiny_imagefolder, max_per_class=3),
    )


def test_no_copy_over_its_bound_or_of_arrays(tiny_imagefolder, tiny_npz, tmp_path) -> None:
    assert not decoded.write(load_dataset(tiny_imagefolder), tmp_path / "a", max_bytes=1000)
    assert not decoded.write(load_dataset(tiny_npz), tmp_path / "b", max_bytes=None)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert decoded.load(tmp_path / "a") is None


def test_scoring_reads_the_copy_within_todays_limits(tiny_imagefolder, tmp_path) -> None:
    from zoopick.service import datasets as store
    from zoopick.service.settings import Settings

    settings = Settings(storage_dir=tmp_path / "storage")
    path = tmp_path / "ds" / "images"  # the dataset's file (here a folder): decoded/ beside it
    loaded = load_dataset(tiny_imagefolder)
    assert decoded.write(loaded, store.decoded_dir(path), max_bytes=None)
    # the file is not there: only the copy can give the dataset
    _same(store.for_scoring(path, settings), loaded)
    # a limit lowered since validation: the copy is not read, the loader refuses the file
    small = replace(settings.dataset_limits(), max_pixels=10)
    assert decoded.load(store.decoded_dir(path), limits=small) is None
    lowered = settings.model_copy(update={"dataset_max_pixels": 10})
    with pytest.raises(DatasetError, match="not found"):
        store.for_scoring(path, lowered)
