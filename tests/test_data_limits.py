"""Dataset limits (``zoopick.selection.limits``): hostile files are refused before the memory
they would cost is allocated, each refusal naming the limit. Peak memory is measured with
tracemalloc (numpy and zlib buffers are traced); no test ever holds the huge content."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tests.bombs import MiB, many_classes_npz, npz_declaring, png_bytes, zip_bomb
from tests.hostile import (
    Sizes,
    bz2_zeros,
    gzip_zeros,
    npz_ratio,
    tar_declaring_huge,
    tar_of,
    tar_zeros,
    xz_zeros,
    zip_directory_flood,
)
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

    many = [(f"a/big{i}.png", 8) for i in range(12)]
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


# ---- issue 21, items 1-3: limits hold while bytes are inflated, entries are counted first


def cpu_and_error(path: Path, limits: DatasetLimits) -> tuple[Exception | None, float, int]:
    """(the error, CPU seconds, peak traced bytes) of loading ``path``."""
    start = time.process_time()
    error, peak = load_measured(path, limits)
    return error, time.process_time() - start, peak


def test_a_tar_gz_header_declaring_8_gib_is_refused_before_inflating(tmp_path):
    # the 42 MB file at 1 MB: one header claims 8 GiB, then gzip members of zeros that
    # walking past the member would inflate (about 1 GiB here, minutes of CPU at full size)
    path = write(tmp_path, "huge.tar.gz", tar_declaring_huge(Sizes(bomb_mib=1)))
    error, cpu, peak = cpu_and_error(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "max_total_bytes" in str(error), error
    assert "a/big.png declares 8,589,934,592 bytes" in str(error)
    assert cpu < 0.5 and peak < 8 * MiB


@pytest.mark.parametrize(
    "name, compress, opener",
    [("z.tar.gz", gzip_zeros, gzip.compress), ("z.tar.bz2", bz2_zeros, bz2.compress),
     ("z.tar.xz", xz_zeros, lzma.compress)],
)  # fmt: skip
def test_every_tar_compression_is_metered_while_walking(tmp_path, name, compress, opener):
    # an honest header within the limits; its zeros are inflated only to walk past them
    sizes = Sizes(bomb_mib=1, member_mib=512)
    path = write(tmp_path, name, tar_zeros(sizes, compress, opener))
    error, cpu, peak = cpu_and_error(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "max_compression_ratio" in str(error), error
    assert cpu < 0.5 and peak < 16 * MiB


@pytest.mark.parametrize("declare", [None, 2])
def test_zip_directory_entries_are_counted_before_they_are_parsed(tmp_path, declare):
    # the 3,000,000 directory records at 30,000 (the end record honest, or lying)
    path = write(tmp_path, "dir.zip", zip_directory_flood(Sizes(entries=30_000), declare=declare))
    error, _, peak = cpu_and_error(path, DatasetLimits(max_members=10_000))
    assert isinstance(error, LimitExceeded) and "max_members=10,000" in str(error), error
    assert peak < 2 * MiB  # zipfile's objects for 30,000 entries would be about 14 MB
    npz = write(tmp_path, "dir.npz", path.read_bytes())  # numpy.load parses the same way
    error, _, peak = cpu_and_error(npz, DatasetLimits(max_members=10_000))
    assert isinstance(error, LimitExceeded) and "max_members=10,000" in str(error), error
    assert peak < 2 * MiB


def test_npz_compression_ratio_is_checked(tmp_path):
    # the 10,900 float64 images of zeros at 600: 59 MB from a 60 KB file
    path = write(tmp_path, "ratio.npz", npz_ratio(Sizes(images=600)))
    assert path.stat().st_size < 256 * 1024
    error, _, peak = cpu_and_error(path, SERVICE)
    assert isinstance(error, LimitExceeded) and "max_compression_ratio" in str(error), error
    assert peak < 4 * MiB


def test_npz_x_is_converted_while_streaming(tmp_path):
    # 2000 float64 images (49 MB) become 6 MB of uint8 without a whole float copy
    rng = np.random.default_rng(1)
    x = rng.random((2000, 32, 32, 3))
    y = np.arange(2000) % 5
    np.savez(tmp_path / "f.npz", x=x, y=y)
    start = time.process_time()
    error, peak = load_measured(tmp_path / "f.npz", SERVICE)
    assert error is None and peak < x.nbytes * 0.75, peak  # numpy.load alone holds all of x
    ds = load_dataset(tmp_path / "f.npz", limits=SERVICE)
    plain = np.array([[round(v * 255) for v in img] for img in x.reshape(2000, -1)[:50]])
    assert np.array_equal(ds.images[:50].reshape(50, -1), plain)  # a plain conversion
    assert np.array_equal(ds.images, np.rint(x * 255).astype(np.uint8))
    sub = load_dataset(tmp_path / "f.npz", max_per_class=7, seed=3, limits=SERVICE)
    assert sub.class_counts() == dict.fromkeys("01234", 7)
    rows = {r.tobytes(): i for i, r in enumerate(ds.images)}
    idx = [rows[r.tobytes()] for r in sub.images]  # streamed rows = rows of the whole load
    assert sub.digest == ds.subset(idx).digest and idx == sorted(idx)
    # column-major arrays are read whole, the same
    np.savez(tmp_path / "c.npz", x=np.asfortranarray(x[:20]), y=np.asfortranarray(y[:20]))
    assert np.array_equal(load_dataset(tmp_path / "c.npz").images, ds.images[:20])
    assert time.process_time() - start < 10


def test_cpu_seconds_are_a_limit_of_their_own(tmp_path):
    files = {f"{c}/{i}.png": png_bytes(64, 64, i) for c in "ab" for i in range(40)}
    for name, data in (("d.zip", zip_bomb([], files)), ("d.tar.gz", tar_gz_of(files))):
        path = write(tmp_path, name, data)
        with pytest.raises(LimitExceeded, match=r"s of CPU, over the limit max_cpu_seconds=1e-06"):
            load_dataset(path, limits=DatasetLimits(max_cpu_seconds=1e-6))
        assert len(load_dataset(path, limits=DatasetLimits(max_cpu_seconds=60))) == 80


def tar_gz_of(files: dict[str, bytes]) -> bytes:
    return gzip.compress(tar_of(files))


def test_npz_labels_are_bounded_by_count_not_ratio(tmp_path):
    # 140,000 sorted labels (over 1 MiB) compress about 1000-fold: fair; a label flood is not
    buf = io.BytesIO()
    np.savez_compressed(buf, x=np.zeros((140_000, 1, 1), np.uint8), y=np.arange(140_000) // 1000)
    path = write(tmp_path, "labels.npz", buf.getvalue())
    assert len(load_dataset(path, limits=DatasetLimits(max_members=140_000))) == 140_000
    error, peak = load_measured(path, DatasetLimits(max_members=1000))
    assert isinstance(error, LimitExceeded) and "labels in 'y'" in str(error), error
    assert peak < 2 * MiB


def test_pixels_decoded_at_once_are_bounded(tmp_path, monkeypatch):
    # as on an 8-core machine: 8 decoding threads, 64 images of max_pixels each
    import threading

    import zoopick.selection.data as data

    monkeypatch.setattr(data.os, "cpu_count", lambda: 8)
    files = {f"{c}/{i}.png": png_bytes(500, 500, i) for c in "ab" for i in range(32)}
    path = write(tmp_path, "big.zip", zip_bomb([], files))
    lock, flight, peak = threading.Lock(), [0], [0]
    decode = data._decode

    def counted(blob: bytes, where: str, **kw):
        with lock:
            flight[0] += 1
            peak[0] = max(peak[0], flight[0])
        try:
            time.sleep(0.002)  # overlap, as a slower decode would
            return decode(blob, where, **kw)
        finally:
            with lock:
                flight[0] -= 1

    monkeypatch.setattr(data, "_decode", counted)
    ds = load_dataset(path, limits=DatasetLimits(max_pixels=250_000))
    assert len(ds) == 64
    assert peak[0] <= 2  # 2 x max_pixels in flight, not 8 images
