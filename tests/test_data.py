"""Target datasets: npz and ImageFolder (dir, zip, tar.gz), subsampling, digests, errors."""

from __future__ import annotations

import io
import shutil
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import TINY_CLASSES, TINY_PER_CLASS, tiny_arrays, write_imagefolder
from zoopick.selection.data import DatasetError, TargetDataset, load_dataset, split_dataset
from zoopick.selection.limits import DatasetLimits


def _pixels(ds: TargetDataset) -> np.ndarray:
    return np.stack([np.asarray(ds.image(i)) for i in range(len(ds))])


def _zip_dir(folder: Path, dest: Path, *, top: str | None = None) -> Path:
    with zipfile.ZipFile(dest, "w") as zf:
        for p in sorted(folder.rglob("*")):
            rel = p.relative_to(folder).as_posix()
            zf.write(p, f"{top}/{rel}" if top else rel)
    return dest


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


# -- npz -------------------------------------------------------------------------------------


def test_npz_grayscale_with_class_names(tiny_npz):
    x, y, names = tiny_arrays()
    ds = load_dataset(tiny_npz)
    assert ds.name == "tiny" and len(ds) == len(y) == 24
    assert ds.class_names == list(TINY_CLASSES) == names
    assert ds.labels.dtype == np.int64 and np.array_equal(ds.labels, y)
    img = ds.image(5)
    assert img.mode == "RGB" and img.size == (28, 28)
    rgb = np.asarray(img)
    assert np.array_equal(rgb[..., 0], x[5]) and np.array_equal(rgb[..., 2], x[5])
    assert ds.class_counts() == dict.fromkeys(TINY_CLASSES, TINY_PER_CLASS)
    # the classes differ in brightness (what the fixture promises its users)
    means = [_pixels(ds)[ds.labels == k].mean() for k in range(3)]
    assert means[0] < means[1] < means[2]


def test_npz_rgb_float_and_keras_layout(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (6, 5, 4, 3), dtype=np.uint8)
    y = np.array([3, 7, 3, 7, 9, 9])
    np.savez(tmp_path / "k.npz", x_train=x, y_train=y[:, None], x_test=x[:4], y_test=y[:4])
    ds = load_dataset(tmp_path / "k.npz")
    assert ds.class_names == ["3", "7", "9"]  # str(label), labels remapped to indices
    assert list(ds.labels) == [0, 1, 0, 1, 2, 2]
    assert np.array_equal(np.asarray(ds.image(2)), x[2])
    test = load_dataset(tmp_path / "k.npz", split="test")
    assert len(test) == 4 and test.class_names == ["3", "7"]
    np.savez(tmp_path / "f.npz", x=x.astype(np.float32) / 255, y=y)
    as_float = load_dataset(tmp_path / "f.npz")
    assert np.array_equal(_pixels(as_float), x)
    assert as_float.digest == ds.digest  # same content, other encoding
    np.savez(tmp_path / "c1.npz", x=x[..., :1], y=y)
    assert np.asarray(load_dataset(tmp_path / "c1.npz").image(0)).shape == (5, 4, 3)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((4, 3, 8, 8), np.uint8), "y": [0, 1, 0, 1]}, "channels-first"),
        ({"x": np.zeros((4, 8), np.uint8), "y": [0, 1, 0, 1]}, "x must be"),
        ({"x": np.zeros((4, 8, 8), np.uint8), "y": [0, 1, 0]}, "4 images but y has 3"),
        ({"x": np.zeros((4, 8, 8), np.uint8), "y": [0.0, 1, 0, 1]}, "integer labels"),
        ({"x": np.full((4, 8, 8), 2.0), "y": [0, 1, 0, 1]}, r"\[0, 1\]"),
        ({"x": np.zeros((4, 8, 8), np.complex64), "y": [0, 1, 0, 1]}, "dtype"),
        ({"x": np.zeros((4, 8, 8), np.uint8), "y": [0, 0, 0, 0]}, "at least 2 classes"),
        ({"x": np.zeros((4, 8, 8), np.uint8), "y": [0, 1, 0, 1], "class_names": ["a"]}, "label 1"),
        ({"x": np.zeros((4, 8, 8), np.uint8), "y": [0, 1, 0, 1], "x_test": [1]}, None),
        ({"images": np.zeros((4, 8, 8), np.uint8)}, "needs arrays 'x_train'"),
    ],
)
def test_npz_errors(tmp_path, arrays, message):
    np.savez(tmp_path / "d.npz", **arrays)
    if message is None:  # a valid file (x_test alone does not matter for split="train")
        assert len(load_dataset(tmp_path / "d.npz")) == 4
        with pytest.raises(DatasetError, match="y_test"):
            load_dataset(tmp_path / "d.npz", split="test")
        return
    with pytest.raises(DatasetError, match=message):
        load_dataset(tmp_path / "d.npz")


def test_npz_object_array_refused(tmp_path):
    np.savez(tmp_path / "o.npz", x=np.zeros((2, 4, 4), np.uint8), y=np.array([0, 1], dtype=object))
    with pytest.raises(DatasetError, match="cannot read arrays"):
        load_dataset(tmp_path / "o.npz")


# -- ImageFolder -----------------------------------------------------------------------------


def test_imagefolder_dir_matches_npz(tiny_imagefolder, tiny_npz):
    ds = load_dataset(tiny_imagefolder)
    ref = load_dataset(tiny_npz)
    assert ds.name == "tiny_images"
    assert ds.class_names == sorted(TINY_CLASSES)  # folder names, sorted
    assert ds.class_counts() == dict.fromkeys(sorted(TINY_CLASSES), TINY_PER_CLASS)
    # same images, per class (order within a class follows file names)
    for name in TINY_CLASSES:
        got = _pixels(ds)[ds.labels == ds.class_names.index(name)]
        want = _pixels(ref)[ref.labels == ref.class_names.index(name)]
        assert np.array_equal(got, want)
    assert ds.sources[0].startswith("bright/")


def test_zip_and_tar_gz_same_content_same_digest(tiny_imagefolder, tmp_path):
    base = load_dataset(tiny_imagefolder)
    z = load_dataset(_zip_dir(tiny_imagefolder, tmp_path / "flat.zip"))
    zt = load_dataset(_zip_dir(tiny_imagefolder, tmp_path / "top.zip", top="tiny"))
    with tarfile.open(tmp_path / "t.tar.gz", "w:gz") as tf:
        tf.add(tiny_imagefolder, arcname="wrapped")
    t = load_dataset(tmp_path / "t.tar.gz")
    with tarfile.open(tmp_path / "plain.tar", "w") as tf:
        for p in sorted(tiny_imagefolder.iterdir()):
            tf.add(p, arcname=p.name)
    assert z.name == "flat" and t.name == "t"
    for other in (z, zt, t, load_dataset(tmp_path / "plain.tar")):
        assert other.class_names == base.class_names
        assert np.array_equal(other.labels, base.labels)
        assert other.digest == base.digest
        assert np.array_equal(_pixels(other), _pixels(base))
    # a copy elsewhere has the same digest
    copy = shutil.copytree(tiny_imagefolder, tmp_path / "elsewhere")
    assert load_dataset(copy).digest == base.digest


def test_imagefolder_ignores_hidden_macosx_and_other_files(tmp_path):
    root = tmp_path / "ds"
    x, y, names = tiny_arrays(per_class=2)
    write_imagefolder(root, x, y, names)
    (root / "README.txt").write_text("hello")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.png").write_bytes(_png(x[0]))
    (root / "dark" / ".DS_Store").write_bytes(b"junk")
    (root / "dark" / "notes.txt").write_text("not an image")
    (root / "mid" / "UPPER.PNG").write_bytes(_png(x[1]))
    (root / "mid" / "sub").mkdir()
    (root / "mid" / "sub" / "deep.jpeg").write_bytes(_png(x[2]))  # content sniffed, not ext
    ds = load_dataset(root)
    assert ds.class_names == ["bright", "dark", "mid"]
    assert ds.class_counts() == {"bright": 2, "dark": 2, "mid": 4}
    zpath = _zip_dir(root, tmp_path / "mac.zip", top="ds")
    with zipfile.ZipFile(zpath, "a") as zf:
        zf.writestr("__MACOSX/ds/dark/._img000.png", b"resource fork")
        zf.writestr("ds/dark/._img001.png", b"resource fork")
    assert load_dataset(zpath).digest == ds.digest


def test_rgba_palette_and_16bit_images_become_rgb(tmp_path):
    root = tmp_path / "modes"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    Image.new("RGBA", (6, 4), (10, 20, 30, 128)).save(root / "a" / "rgba.png")
    Image.new("P", (6, 4), 3).save(root / "a" / "pal.gif")
    Image.fromarray(np.full((4, 6), 65535, np.uint16)).save(root / "b" / "deep.png")
    Image.new("L", (6, 4), 7).save(root / "b" / "gray.jpg")
    ds = load_dataset(root)
    for i in range(len(ds)):
        img = ds.image(i)
        assert img.mode == "RGB" and img.size == (6, 4)
    deep = ds.image(ds.sources.index("b/deep.png"))
    assert np.asarray(deep).min() == 255  # scaled, not clipped to garbage


def test_imagefolder_errors(tmp_path):
    x, y, names = tiny_arrays(per_class=2)
    one = write_imagefolder(tmp_path / "one", x[y == 0], y[y == 0], names)
    with pytest.raises(DatasetError, match="at least 2 classes"):
        load_dataset(one)
    empty = write_imagefolder(tmp_path / "empty", x, y, names)
    (empty / "zzz").mkdir()
    (empty / "zzz" / "a.txt").write_text("x")
    with pytest.raises(DatasetError, match="class folder.*no images: zzz"):
        load_dataset(empty)
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "a.png").write_bytes(_png(x[0]))
    with pytest.raises(DatasetError, match="no class folders"):
        load_dataset(flat)
    corrupt = write_imagefolder(tmp_path / "corrupt", x, y, names)
    good = (corrupt / "mid" / "img001.png").read_bytes()
    (corrupt / "mid" / "img001.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(DatasetError, match=r"corrupt image corrupt/mid/img001\.png"):
        load_dataset(corrupt)
    (corrupt / "mid" / "img001.png").write_bytes(b"not an image at all")
    with pytest.raises(DatasetError, match=r"mid/img001\.png"):
        load_dataset(_zip_dir(corrupt, tmp_path / "corrupt.zip"))


def test_missing_and_unknown_format(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_dataset(tmp_path / "nope.npz")
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        load_dataset(tmp_path / "data.csv")
    (tmp_path / "bad.zip").write_bytes(b"PK not really")
    with pytest.raises(DatasetError, match="not a readable zip"):
        load_dataset(tmp_path / "bad.zip")
    (tmp_path / "bad.tgz").write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(DatasetError, match="not a readable tar"):
        load_dataset(tmp_path / "bad.tgz")
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(DatasetError, match=r"bad\.npz"):
        load_dataset(tmp_path / "bad.npz")


def test_archive_without_class_folders(tmp_path):
    with zipfile.ZipFile(tmp_path / "flat.zip", "w") as zf:
        zf.writestr("a.png", _png(np.zeros((4, 4), np.uint8)))
        zf.writestr("b.png", _png(np.zeros((4, 4), np.uint8)))
    with pytest.raises(DatasetError, match="no class folders"):
        load_dataset(tmp_path / "flat.zip")


@pytest.mark.parametrize("member", ["../evil/a.png", "cls/../../a.png", "/abs/a.png"])
def test_traversal_members_refused(tmp_path, member):
    img = _png(np.zeros((4, 4), np.uint8))
    with zipfile.ZipFile(tmp_path / "t.zip", "w") as zf:
        zf.writestr("a/x.png", img)
        zf.writestr("b/x.png", img)
        zf.writestr(zipfile.ZipInfo(member), img)
    with pytest.raises(DatasetError, match="unsafe archive member"):
        load_dataset(tmp_path / "t.zip")
    with tarfile.open(tmp_path / "t.tar", "w") as tf:
        for name in ("a/x.png", "b/x.png", member):
            info = tarfile.TarInfo(name)
            info.size = len(img)
            tf.addfile(info, io.BytesIO(img))
    with pytest.raises(DatasetError, match="unsafe archive member"):
        load_dataset(tmp_path / "t.tar")
    assert not (tmp_path / "evil").exists() and not Path("/abs").exists()


def test_tar_link_outside_refused(tmp_path):
    img = _png(np.zeros((4, 4), np.uint8))
    with tarfile.open(tmp_path / "l.tar", "w") as tf:
        for name in ("a/x.png", "b/x.png"):
            info = tarfile.TarInfo(name)
            info.size = len(img)
            tf.addfile(info, io.BytesIO(img))
        link = tarfile.TarInfo("a/y.png")
        link.type, link.linkname = tarfile.SYMTYPE, "../../etc/passwd"
        tf.addfile(link)
    with pytest.raises(DatasetError, match="unsafe archive link"):
        load_dataset(tmp_path / "l.tar")


# -- subsampling, digests, splits ------------------------------------------------------------


def test_max_per_class_deterministic_and_per_class(tmp_path):
    x, y, names = tiny_arrays(per_class=8)
    # unbalanced: class 2 keeps only 3 images
    keep = np.flatnonzero((y != 2) | (np.cumsum(y == 2) <= 3))
    np.savez(tmp_path / "u.npz", x=x[keep], y=y[keep], class_names=np.array(names))
    a = load_dataset(tmp_path / "u.npz", max_per_class=5, seed=1)
    b = load_dataset(tmp_path / "u.npz", max_per_class=5, seed=1)
    c = load_dataset(tmp_path / "u.npz", max_per_class=5, seed=2)
    assert a.class_counts() == {"dark": 5, "mid": 5, "bright": 3}
    assert a.digest == b.digest and np.array_equal(_pixels(a), _pixels(b))
    assert a.digest != c.digest
    full = load_dataset(tmp_path / "u.npz")
    assert full.digest not in (a.digest, c.digest)
    # the subset's images are images of the full set, of the right class
    fx = _pixels(full)
    for img, label in zip(_pixels(a), a.labels, strict=True):
        match = np.flatnonzero((fx == img).all(axis=(1, 2, 3)))
        assert len(match) and full.labels[match[0]] == label
    # a class's pick does not depend on the other classes
    np.savez(tmp_path / "two.npz", x=x[y < 2], y=y[y < 2], class_names=np.array(names))
    lenient = DatasetLimits(min_per_class=0)  # "bright" is declared, with no images left
    two = load_dataset(tmp_path / "two.npz", max_per_class=5, seed=1, limits=lenient)
    assert np.array_equal(_pixels(two)[two.labels == 0], _pixels(a)[a.labels == 0])
    with pytest.raises(DatasetError, match="max_per_class"):
        load_dataset(tmp_path / "u.npz", max_per_class=0)


def test_max_per_class_imagefolder(tiny_imagefolder, tmp_path):
    a = load_dataset(tiny_imagefolder, max_per_class=3, seed=0)
    assert a.class_counts() == dict.fromkeys(sorted(TINY_CLASSES), 3)
    z = load_dataset(_zip_dir(tiny_imagefolder, tmp_path / "d.zip"), max_per_class=3, seed=0)
    assert z.digest == a.digest and z.sources == a.sources


def test_digest_changes_with_content(tmp_path):
    x, y, names = tiny_arrays()
    np.savez(tmp_path / "a.npz", x=x, y=y, class_names=np.array(names))
    np.savez(tmp_path / "b.npz", x=x, y=y, class_names=np.array(names))
    x2 = x.copy()
    x2[0, 0, 0] ^= 1
    np.savez(tmp_path / "c.npz", x=x2, y=y, class_names=np.array(names))
    np.savez(tmp_path / "d.npz", x=x, y=y, class_names=np.array(["a", "b", "c"]))
    y2 = y.copy()
    y2[[0, 1]] = y2[[1, 0]]
    np.savez(tmp_path / "e.npz", x=x, y=y2, class_names=np.array(names))
    digests = [load_dataset(tmp_path / f"{n}.npz").digest for n in "abcde"]
    assert digests[0] == digests[1]
    assert len(set(digests)) == 4
    assert len(digests[0]) == 64


def test_subset_and_split(tiny_npz, tiny_imagefolder):
    for ds in (load_dataset(tiny_npz), load_dataset(tiny_imagefolder)):
        sub = ds.subset([3, 1, 2])
        assert list(sub.labels) == list(ds.labels[[3, 1, 2]])
        assert np.array_equal(np.asarray(sub.image(0)), np.asarray(ds.image(3)))
        assert sub.digest != ds.digest
        assert ds.subset(np.arange(len(ds))).digest == ds.digest
        assert ds.subset([3, 1, 2]).digest == sub.digest
        train, test = split_dataset(ds, 0.25, seed=0)
        assert len(train) + len(test) == len(ds)
        assert test.class_counts() == dict.fromkeys(ds.class_names, 2)
        again = split_dataset(ds, 0.25, seed=0)
        assert again[1].digest == test.digest
        assert split_dataset(ds, 0.25, seed=1)[1].digest != test.digest
        # disjoint, and together the whole dataset
        px = {np.asarray(train.image(i)).tobytes() for i in range(len(train))}
        assert not px & {np.asarray(test.image(i)).tobytes() for i in range(len(test))}
    with pytest.raises(DatasetError, match="test_fraction"):
        split_dataset(ds, 1.0, seed=0)


def test_from_arrays_matches_npz(tiny_npz):
    x, y, names = tiny_arrays()
    assert TargetDataset.from_arrays(x, y, names).digest == load_dataset(tiny_npz).digest
