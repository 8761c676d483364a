"""Dataset limits (``zoopick.selection.limits``): hostile files are refused before the memory
they would cost is allocated, each refusal naming the limit. Peak memory is measured with
tracemalloc (numpy and zlib buffers are traced); no test ever holds the huge content."""

from __future__ import annotations

import io
import tarfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tests.bombs import MiB, many_classes_npz, npz_declaring, png_bytes, zip_bomb
from zoopick.selection.data import DatasetError, LimitExceeded, load_dataset
from zoopick.selection.limits import DatasetLimits

# the service's defaults (zoopick.service.settings)
SERVICE = DatasetLimits(
    max_member_bytes=64 * MiB,
    max_total_bytes=1024 * MiB,
    max_compression_ratio=100,
    max_members=200_000,
    max_pixels=4096 * 4096,
    max_classes=2000,
    min_per_class=2,
)
SMALL_PNG = png_bytes(8, 8, 100)
PAD = {"a/0.png": SMALL_PNG, "b/0.png": SMALL_PNG, "b/1.png": SMALL_PNG}  # 2 per class


def load_measured(path: Path, limits: DatasetLimits) -> tuple[Exception | None, int]:
    """(the error loading raised, peak traced bytes while loading)."""
    tracemalloc.start()
    try:
        load_dataset(path, limits=limits)
        error = None
    except DatasetError as exc:
        error = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return error, peak


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_1_gib_zip_member_is_refused_within_its_limit(tmp_path):
    path = write(tmp_path, "bomb.zip", zip_bomb([("a/bomb.png", 1024)], PAD))
    assert path.stat().st_size < 1.1 * MiB
    error, peak = load_measured(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "max_member_bytes" in str(error)
    assert peak < 16 * MiB  # the declared size is refused before a byte is inflated


def test_a_zip_member_lying_about_its_size_is_counted_while_streaming(tmp_path):
    bomb = zip_bomb([("a/bomb.png", 1024)], PAD, declare=1000)
    path = write(tmp_path, "liar.zip", bomb)
    error, peak = load_measured(path, SERVICE)
    assert isinstance(error, DatasetError), error
    assert peak < 96 * MiB
    # with no per-member limit the running total still holds
    no_member = DatasetLimits(max_member_bytes=None, max_total_bytes=32 * MiB)
    error, peak = load_measured(
        write(tmp_path, "big.zip", zip_bomb([("a/b.png", 200)], PAD)),
        no_member,
    )
    assert isinstance(error, LimitExceeded) and "max_total_bytes" in str(error)
    assert peak < 64 * MiB


def test_compression_ratio_total_bytes_and_member_count(tmp_path):
    path = write(tmp_path, "ratio.zip", zip_bomb([("a/r.png", 8)], PAD))
    error, _ = load_measured(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "max_compression_ratio" in str(error)

    many = [(f"a/{i}.png", 8) for i in range(12)]
    path = write(tmp_path, "total.zip", zip_bomb(many, PAD))
    limits = DatasetLimits(max_compression_ratio=None, max_total_bytes=64 * MiB)
    error, peak = load_measured(path, limits)
    assert isinstance(error, LimitExceeded) and "max_total_bytes" in str(error)
    assert peak < 100 * MiB

    files = {f"{c}/{i}.png": SMALL_PNG for c in "ab" for i in range(20)}
    path = write(tmp_path, "many.zip", zip_bomb([], files))
    error, _ = load_measured(path, DatasetLimits(max_members=30))
    assert isinstance(error, LimitExceeded) and "max_members" in str(error)
    assert load_dataset(path, limits=DatasetLimits(max_members=40)).labels.size == 40


def test_tar_entries_are_counted_one_at_a_time(tmp_path):
    path = tmp_path / "many.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for i in range(50):
            info = tarfile.TarInfo(f"{'ab'[i % 2]}/{i}.png")
            info.size = len(SMALL_PNG)
            tf.addfile(info, io.BytesIO(SMALL_PNG))
    error, _ = load_measured(path, DatasetLimits(max_members=20))
    assert isinstance(error, LimitExceeded) and "max_members" in str(error)
    error, _ = load_measured(path, DatasetLimits(max_member_bytes=10))
    assert isinstance(error, LimitExceeded) and "max_member_bytes" in str(error)


def test_pixels_per_image_are_read_from_the_header(tmp_path):
    big = png_bytes(5000, 5000)  # 25 Mpx, a few KB
    path = write(tmp_path, "px.zip", zip_bomb([], {"a/big.png": big, **PAD}))
    error, peak = load_measured(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "max_pixels" in str(error)
    assert peak < 20 * MiB  # not decoded: 25 MB of pixels never allocated


def test_npz_shapes_are_checked_from_the_npy_headers(tmp_path):
    path = write(tmp_path, "huge.npz", npz_declaring((2, 23170, 23170)))
    assert path.stat().st_size < 4096
    error, peak = load_measured(path, SERVICE)  # the 1.07 GB array
    assert isinstance(error, LimitExceeded) and "max_pixels" in str(error)
    assert peak < 4 * MiB
    path = write(tmp_path, "long.npz", npz_declaring((5000, 4000, 4000)))
    error, peak = load_measured(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "max_total_bytes" in str(error)
    assert peak < 4 * MiB
    path = write(tmp_path, "count.npz", npz_declaring((300_000, 2, 2)))
    error, _ = load_measured(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "max_members" in str(error)


def test_class_count_and_images_per_class(tmp_path):
    path = write(tmp_path, "flood.npz", many_classes_npz(200_000))
    error, _ = load_measured(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "max_classes" in str(error)
    path = write(tmp_path, "thin.npz", many_classes_npz(10, per_class=1))
    error, _ = load_measured(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "min_per_class=2" in str(error)
    ok = load_dataset(write(tmp_path, "ok.npz", many_classes_npz(10, 2)), limits=SERVICE)
    assert len(ok.class_names) == 10
    files = {f"c{c}/{i}.png": SMALL_PNG for c in range(3) for i in range(1 + (c > 0))}
    path = write(tmp_path, "thin.zip", zip_bomb([], files))
    error, _ = load_measured(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "c0" in str(error)


def test_defaults_still_load_ordinary_datasets(tmp_path):
    x = np.random.default_rng(0).integers(0, 255, (12, 8, 8), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, x=x, y=np.arange(12) % 3)
    ds = load_dataset(write(tmp_path, "fine.npz", buf.getvalue()), limits=SERVICE)
    assert ds.class_counts() == {"0": 4, "1": 4, "2": 4}
    with pytest.raises(LimitExceeded, match="max_total_bytes"):
        load_dataset(tmp_path / "fine.npz", limits=DatasetLimits(max_total_bytes=100))
