"""Datasets as other systems write them: links in archives and folders, names in another
Unicode form or encoding, repeated members, phone photos' EXIF orientation, 16-bit and float
images. Each case once lost images or classes without a word, decoded pixels that depended on
other pixels, or crashed with an error that was not a DatasetError."""

from __future__ import annotations

import io
import os
import tarfile
import unicodedata
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from zoopick.selection.data import (
    DatasetError,
    TargetDataset,
    load_dataset,
    load_test_data,
    split_dataset,
    training_count,
)
from zoopick.selection.limits import DatasetLimits, LimitExceeded


def _png(value: int, size: tuple[int, int] = (4, 4)) -> bytes:
    buf = io.BytesIO()
    Image.new("L", size, value).save(buf, format="PNG")
    return buf.getvalue()


def _encoded(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _folder(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _tar(path: Path, files: dict[str, bytes], links: dict[str, tuple[bytes, str]]) -> Path:
    """Files, then links (name -> (tarfile.SYMTYPE or LNKTYPE, target)), in that order."""
    with tarfile.open(path, "w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, (kind, target) in links.items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tf.addfile(info)
    return path


FILES = {"cat/0.png": _png(10), "cat/1.png": _png(20), "fox/0.png": _png(30)}


# -- links -----------------------------------------------------------------------------------


def test_tar_links_to_images_read_their_targets_data(tmp_path):
    """GNU tar stores a second path to one file as a hard link: dog/ made of hard links, and
    a symlink in fox/, load as the folder they were made from does (same digest)."""
    plain = {**FILES, "dog/0.png": _png(10), "dog/1.png": _png(20), "fox/1.png": _png(10)}
    folder = load_dataset(_folder(tmp_path / "plain", plain))
    links = {
        "dog/0.png": (tarfile.LNKTYPE, "cat/0.png"),
        "dog/1.png": (tarfile.LNKTYPE, "cat/1.png"),
        "fox/1.png": (tarfile.SYMTYPE, "../cat/0.png"),
    }
    tarred = load_dataset(_tar(tmp_path / "l.tar", FILES, links))
    assert tarred.class_counts() == {"cat": 2, "dog": 2, "fox": 2}
    assert tarred.digest == folder.digest


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ({"dog": (tarfile.SYMTYPE, "cat")}, "points to the folder 'cat'"),
        ({"dog/0.png": (tarfile.SYMTYPE, "../cat/9.png")}, "not a file in the archive"),
        (
            {"dog/0.png": (tarfile.SYMTYPE, "1.png"), "dog/1.png": (tarfile.SYMTYPE, "0.png")},
            "loop",
        ),
    ],
)
def test_tar_links_that_lead_nowhere_are_refused_by_name(tmp_path, links, message):
    with pytest.raises(DatasetError, match=message):
        load_dataset(_tar(tmp_path / "bad.tar", FILES, links))


def test_a_linked_class_folder_is_followed_and_a_loop_refused(tmp_path):
    elsewhere = _folder(tmp_path / "elsewhere", {"0.png": _png(40), "1.png": _png(50)})
    root = _folder(tmp_path / "root", FILES)
    os.symlink(elsewhere, root / "dog")
    assert load_dataset(root).class_counts() == {"cat": 2, "dog": 2, "fox": 1}
    os.symlink(root, root / "fox" / "again")  # fox/again/ is root itself
    with pytest.raises(DatasetError, match="leads back to '.', a loop"):
        load_dataset(root)


def test_zip_members_repeated_or_linked_are_refused(tmp_path):
    with zipfile.ZipFile(tmp_path / "twice.zip", "w") as zf:
        for name, data in FILES.items():
            zf.writestr(name, data)
        zf.writestr("./cat//0.png", _png(99))  # the same member, spelt another way
    with pytest.raises(DatasetError, match="'cat/0.png' appears twice"):
        load_dataset(tmp_path / "twice.zip")
    with zipfile.ZipFile(tmp_path / "link.zip", "w") as zf:
        for name, data in FILES.items():
            zf.writestr(name, data)
        link = zipfile.ZipInfo("fox/1.png")
        link.external_attr = (0o120777) << 16  # a symlink, its data the target's path
        zf.writestr(link, "../cat/0.png")
    with pytest.raises(DatasetError, match="'fox/1.png' is a symbolic link"):
        load_dataset(tmp_path / "link.zip")
    files = {"cat/0.png": _png(1), "fox/0.png": _png(2)}
    _tar(tmp_path / "twice.tar", files, {})
    with tarfile.open(tmp_path / "twice.tar", "a") as tf:
        info = tarfile.TarInfo("cat/0.png")
        info.size = len(files["cat/0.png"])
        tf.addfile(info, io.BytesIO(files["cat/0.png"]))
    with pytest.raises(DatasetError, match="appears twice"):
        load_dataset(tmp_path / "twice.tar")


# -- names -----------------------------------------------------------------------------------


def test_class_names_have_one_unicode_form_and_undecodable_ones_are_refused(tmp_path):
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    assert nfc != nfd
    mac = {f"{nfd}/0.png": _png(1), "dog/0.png": _png(2)}
    linux = {f"{nfc}/0.png": _png(1), "dog/0.png": _png(2)}
    decomposed = load_dataset(_folder(tmp_path / "mac", mac))
    assert decomposed.class_names[0] == nfc  # composed, as the same files from Linux
    assert decomposed.digest == load_dataset(_folder(tmp_path / "linux", linux)).digest
    both = {f"{nfc}/0.png": _png(1), f"{nfd}/0.png": _png(2)}
    with pytest.raises(DatasetError, match="same name in two Unicode forms"):
        load_dataset(_folder(tmp_path / "both", both))
    # an archive from a Latin-1 system: its folder name is not UTF-8
    with tarfile.open(
        tmp_path / "latin1.tar", "w", format=tarfile.GNU_FORMAT, encoding="latin-1"
    ) as tf:
        for name in ("caf\xe9/0.png", "caf\xe9/1.png", "dog/0.png", "dog/1.png"):
            info = tarfile.TarInfo(name)
            info.size = len(_png(3))
            tf.addfile(info, io.BytesIO(_png(3)))
    for cap in (None, 1):  # the cap's seeded pick once crashed encoding the name
        with pytest.raises(DatasetError, match="not valid UTF-8"):
            load_dataset(tmp_path / "latin1.tar", max_per_class=cap)


def test_a_colon_in_a_class_name_is_a_name_and_a_drive_is_refused(tmp_path):
    with zipfile.ZipFile(tmp_path / "ratios.zip", "w") as zf:
        zf.writestr("4:3/0.png", _png(1))
        zf.writestr("16:9/0.png", _png(2))
    assert load_dataset(tmp_path / "ratios.zip").class_names == ["16:9", "4:3"]
    with zipfile.ZipFile(tmp_path / "drive.zip", "w") as zf:
        zf.writestr("a/0.png", _png(1))
        zf.writestr("C:\\b\\0.png", _png(2))
    with pytest.raises(DatasetError, match="absolute path"):
        load_dataset(tmp_path / "drive.zip")


# -- pixels ----------------------------------------------------------------------------------


def _decoded(tmp_path: Path, name: str, data: bytes) -> np.ndarray:
    root = _folder(tmp_path / name, {f"a/{name}": data, "b/0.png": _png(0)})
    ds = load_dataset(root)
    return np.asarray(ds.image(ds.sources.index(f"a/{name}")))[..., 0]


def test_wide_images_scale_by_their_mode_not_by_their_own_values(tmp_path):
    """16-bit 25,700 is 8-bit 100 (25,700 * 255 / 65,535) whether or not the image holds a
    brighter pixel, in a PNG (I;16) as in a 32-bit integer TIFF (mode I); float 0.2 is 51."""
    plain = np.full((4, 4), 25_700, np.uint16)
    bright = plain.copy()
    bright[0, 0] = 65_535
    for name, arr in (("plain.png", plain), ("bright.png", bright)):
        got = _decoded(tmp_path, name, _encoded(Image.fromarray(arr), "PNG"))
        assert (got.reshape(-1)[1:] == 100).all() and got[0, 0] in (100, 255)
    deep = _encoded(Image.fromarray(plain.astype(np.int32)), "TIFF")
    assert Image.open(io.BytesIO(deep)).mode == "I"
    assert (_decoded(tmp_path, "deep.tif", deep) == 100).all()
    floats = np.full((4, 4), 0.2, np.float32)
    assert (_decoded(tmp_path, "f.tif", _encoded(Image.fromarray(floats), "TIFF")) == 51).all()
    for name, arr, message in (
        ("over.tif", floats + 0.9, r"float pixels must lie in \[0, 1\], found 1.1 to 1.1"),
        ("nan.tif", np.where(np.eye(4) > 0, np.nan, floats).astype(np.float32), "NaN"),
        ("wide.tif", np.full((4, 4), 70_000, np.int32), "0..65535"),
    ):
        data = _encoded(Image.fromarray(arr), "TIFF")
        with pytest.raises(DatasetError, match=message) as caught:
            _decoded(tmp_path, name, data)
        assert "corrupt" not in str(caught.value)  # said once, plainly


def test_exif_orientation_is_applied(tmp_path):
    """A phone's portrait photo: stored 40 x 20 (red left, blue right) with orientation 6
    (turn 90 degrees clockwise to view), it is 20 wide and 40 high, red on top."""
    stored = Image.new("RGB", (40, 20), (255, 0, 0))
    stored.paste((0, 0, 255), (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    root = _folder(tmp_path / "photos", {"a/p.jpg": _encoded(stored, "JPEG", exif=exif)})
    _folder(root, {"b/0.png": _png(0)})
    ds = load_dataset(root)
    img = np.asarray(ds.image(ds.sources.index("a/p.jpg"))).astype(int)
    assert img.shape == (40, 20, 3)
    top, bottom = img[:15].mean(axis=(0, 1)), img[25:].mean(axis=(0, 1))
    assert top[0] > 200 > top[2] and bottom[2] > 200 > bottom[0]


# -- npz headers, split counts ---------------------------------------------------------------


def test_npz_labels_and_names_are_bounded_by_their_headers(tmp_path):
    """A few kilobytes declaring 48 MB of labels in the wrong shape, or one class name of
    4 million characters, are refused before they are inflated."""
    x = np.zeros((6, 4, 4), np.uint8)
    np.savez_compressed(tmp_path / "y.npz", x=x, y=np.zeros((1, 6_000_000), np.int64))
    with pytest.raises(DatasetError, match=r"1-D vector \(or N x 1\), got shape \(1, 6000000\)"):
        load_dataset(tmp_path / "y.npz")
    names = np.array(["a" * 4_000_000, "b"])
    np.savez_compressed(tmp_path / "n.npz", x=x, y=np.arange(6) % 2, class_names=names)
    with pytest.raises(LimitExceeded, match="class_names width"):
        load_dataset(tmp_path / "n.npz", limits=DatasetLimits(max_class_name_chars=200))


def test_training_count_is_zero_where_the_trainer_cannot_split():
    """Two classes of 10 capped at 2: the test split leaves one image a class, and the
    validation split then has no class of 2 to split (split_dataset refuses it), so the count
    is 0, not the 2 a race's plan once accepted."""
    x = np.zeros((20, 4, 4), np.uint8)
    from zoopick.selection.data import TargetDataset

    ds = TargetDataset.from_arrays(x, np.arange(20) % 2, ["a", "b"]).subset(
        [0, 1, 2, 3]
    )  # two a class
    train, _ = split_dataset(ds, 0.2, 0)
    with pytest.raises(DatasetError, match="no class has 2 images"):
        split_dataset(train, 0.1, 1)
    assert training_count([10, 10], max_per_class=2, fractions=(0.2, 0.1)) == 0
    assert training_count([10, 10], max_per_class=2, fractions=(0.2,)) == len(train) == 2
    assert training_count([10, 10], max_per_class=3, fractions=(0.2, 0.1)) == 2
    for bad in (0, -1, True, 2.5, 3.0):
        with pytest.raises(DatasetError, match="max_per_class"):
            training_count([10, 10], max_per_class=bad)
    assert training_count([10, 10], max_per_class=np.int64(3)) == 6


# -- Pillow's pixel bound --------------------------------------------------------------------


def _many(per_class: int, size: int) -> dict[str, bytes]:
    return {
        f"{c}/{i}.png": _png(40 * k, (size, size))
        for k, c in enumerate("ab")
        for i in range(per_class)
    }


def test_max_pixels_none_lifts_pillows_own_bound_for_our_decodes_only(tmp_path, monkeypatch):
    """Pillow refuses images over twice ``Image.MAX_IMAGE_PIXELS`` whatever our limit says:
    lowered to 100 here, 32 x 32 images stand for legit images beyond Pillow's default.
    ``max_pixels=None`` (no limit) loads them (in threads: 80 images) and decodes them again
    later; Pillow's global is untouched and still applies outside our decodes."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    root = _folder(tmp_path / "big", _many(40, 32))
    ds = load_dataset(root, limits=DatasetLimits(max_pixels=None))
    assert ds.class_counts() == {"a": 40, "b": 40}
    assert ds.image(0).size == (32, 32) and ds.subset([1]).image(0).size == (32, 32)
    assert Image.MAX_IMAGE_PIXELS == 100
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(_png(0, (32, 32))))
    # a limit that is set: ours refuses in its own words, and Pillow's lower bound too
    for limit, needle in ((500, "over the limit max_pixels=500"), (10_000, "MAX_IMAGE_PIXELS")):
        with pytest.raises(LimitExceeded, match=needle) as caught:
            load_dataset(root, limits=DatasetLimits(max_pixels=limit))
        assert "a/0.png" in str(caught.value) and "max_pixels" in str(caught.value)
        assert "DOS" not in str(caught.value) and "Image size" not in str(caught.value)
    # between once and twice Pillow's bound Pillow only warns: not in our decodes either
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 600)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        for limit in (None, 10_000):
            assert len(load_dataset(root, limits=DatasetLimits(max_pixels=limit))) == 80
        with pytest.raises(Image.DecompressionBombWarning):
            Image.open(io.BytesIO(_png(0, (32, 32))))


def test_pillows_bound_is_lifted_in_the_decoding_thread_only(monkeypatch):
    """The scope is per thread: another thread decoding meanwhile keeps Pillow's bound."""
    import threading

    from zoopick.selection import data

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    png, seen = _png(0, (32, 32)), []

    def other() -> None:
        try:
            Image.open(io.BytesIO(png))
            seen.append("opened")
        except Image.DecompressionBombError:
            seen.append("refused")

    with data._pillow_limits(DatasetLimits(max_pixels=None), "x.png"):
        assert Image.open(io.BytesIO(png)).size == (32, 32)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert seen == ["refused"]


# -- classes, seeds, counts ------------------------------------------------------------------


def _npz_named(path: Path, names: list[str], labels: tuple[int, ...], **extra) -> Path:
    x = np.zeros((len(labels), 4, 4), np.uint8)
    np.savez(path, x=x, y=np.array(labels), class_names=np.array(names), **extra)
    return path


def test_a_declared_class_without_images_is_short_of_min_per_class(tmp_path):
    """An npz's class_names may name a class no label uses: it has 0 images, refused by the
    library as by the service (its message), unless min_per_class=0 allows it, as test data
    (a test split may lack a class) and in-memory arrays do."""
    path = _npz_named(tmp_path / "n.npz", ["a", "b", "never"], (0, 0, 1, 1))
    for least in (1, 2):
        with pytest.raises(LimitExceeded, match=f"min_per_class={least}") as caught:
            load_dataset(path, limits=DatasetLimits(min_per_class=least))
        assert "1 class(es) with no images ('never')" in str(caught.value)
    with pytest.raises(LimitExceeded, match="'never'"):
        load_dataset(path)  # the default, min_per_class=1
    lenient = load_dataset(path, limits=DatasetLimits(min_per_class=0))
    assert lenient.class_counts() == {"a": 2, "b": 2, "never": 0}
    from zoopick.selection.data import TargetDataset, load_test_data

    x = np.zeros((6, 4, 4), np.uint8)
    keras = tmp_path / "k.npz"
    np.savez(
        keras,
        x_train=x,
        y_train=np.arange(6) % 3,
        x_test=x[:4],
        y_test=np.array([0, 1, 0, 1]),
        class_names=np.array(["a", "b", "c"]),
    )
    train = load_dataset(keras)
    assert load_test_data(keras, keras, train.class_names).class_counts()["c"] == 0
    arrays = TargetDataset.from_arrays(x[:4], np.array([0, 1, 0, 1]), ["a", "b", "c"])
    assert arrays.class_counts()["c"] == 0


def _keras(path: Path, y_train, y_test, names=None) -> Path:
    x = np.zeros((len(y_train), 4, 4), np.uint8)
    extra = {} if names is None else {"class_names": np.array(names)}
    arrays = {"x_train": x, "y_train": np.array(y_train), "x_test": x[: len(y_test)]}
    np.savez(path, **arrays, y_test=np.array(y_test), **extra)
    return path


def test_a_test_split_with_labels_training_never_has_is_refused_naming_them(tmp_path):
    """An npz whose Keras test split holds a label its training split never has was read
    without a word at validation: a run tested on it counted each such image as wrong. The
    labels are named (with their class names when the file has them), whatever the limits."""
    from zoopick.selection.data import load_test_data

    plain = _keras(tmp_path / "p.npz", [0, 1, 2] * 2, [0, 1, 2, 3, 3, 7])
    with pytest.raises(DatasetError, match="y_test has 2 label") as caught:
        load_dataset(plain)
    assert "y_train never has: 3, 7 (3 test image(s))" in str(caught.value)
    lenient = DatasetLimits(min_per_class=0)  # lets class_names declare an empty class
    named = _keras(tmp_path / "n.npz", [0, 1, 0, 1], [0, 1, 2], names=["a", "b", "c"])
    with pytest.raises(DatasetError, match=r"never has: 2 \('c'\)"):
        load_dataset(named, limits=lenient)
    # x / y beside the test split: named as y
    x = np.zeros((4, 4, 4), np.uint8)
    np.savez(tmp_path / "xy.npz", x=x, y=np.array([0, 1, 0, 1]), x_test=x, y_test=np.arange(4))
    with pytest.raises(DatasetError, match=r"label\(s\) that y never has: 2, 3"):
        load_dataset(tmp_path / "xy.npz")
    # a test split that lacks a class, or uses only what training has, is fine
    fine = _keras(tmp_path / "f.npz", [0, 1, 2] * 2, [2, 0, 0], names=["a", "b", "c"])
    test = load_test_data(fine, fine, load_dataset(fine).class_names)
    assert test.class_counts() == {"a": 2, "b": 0, "c": 1}
    # separate test data whose classes are a subset, or in another order: mapped by name
    train_named = _keras(tmp_path / "t.npz", [0, 1, 2] * 2, [0], names=["a", "b", "c"])
    names = load_dataset(train_named).class_names
    subset = tmp_path / "subset.npz"
    np.savez(subset, x=np.zeros((3, 4, 4), np.uint8), y=np.array([0, 1, 1]),
             class_names=np.array(["c", "a"]))  # fmt: skip
    mapped = load_test_data(subset, train_named, names)
    assert mapped.class_names == ["a", "b", "c"]
    assert [names[i] for i in mapped.labels] == ["c", "a", "a"]
    assert mapped.digest == mapped.compute_digest()
    # separate test data with a class the training data has not: named too
    other = tmp_path / "other.npz"
    np.savez(other, x=np.zeros((4, 4, 4), np.uint8), y=np.array([0, 1, 5, 5]))
    with pytest.raises(DatasetError, match=r"1 class\(es\) the training data never has: \['5'\]"):
        load_test_data(other, plain, ["0", "1", "2"])


LOOKALIKES = [
    ([" cat", "dog"], ["' cat'", "begins or ends with a space"]),
    (["cat ", "dog"], ["'cat '", "begins or ends with a space"]),
    (["cat\xa0", "dog"], [r"'cat\xa0'", "begins or ends with a space"]),
    (["\xa0\xa0", "dog"], [r"'\xa0\xa0'", "blank"]),
    (["   ", "dog"], ["'   '", "blank"]),
    (["ca\u202et", "dog"], [r"'ca\u202et'", "U+202E"]),
    (["\u2066cat\u2069", "dog"], ["U+2066, U+2069", "bidirectional"]),
    (["cat\u200e", "dog"], ["U+200E"]),
    (["cat\u200f", "dog"], ["U+200F"]),
    (["cat", "ｃａｔ"], ["'ｃａｔ'", "look alike"]),  # full width
    (["cat", "ca\u200bt"], [r"'ca\u200bt'", "look alike"]),  # a zero-width space
    (["cat", "\ufeffcat"], ["look alike"]),  # a byte-order mark
    (["ﬁsh", "fish"], ["'ﬁsh'", "'fish'"]),  # a ligature
    (["ſ", "s"], ["'ſ'", "'s'"]),  # the long s: a compatibility form of s, and its case fold
]
"""Names refused in an ImageFolder and an npz alike: a person cannot tell them apart."""

FOLDER_LOOKALIKES = [
    (["cat", "Cat"], ["'Cat'", "'cat'", "differ only in letter case", "case-insensitive"]),
    (["A", "a"], ["'A'", "'a'", "differ only in letter case"]),
    (["cat.", "cat"], ["'cat.'", "look alike"]),  # one folder on Windows
    (["ﬁsh", "FISH"], ["'ﬁsh'", "'FISH'"]),  # a ligature (case folding expands it)
]
"""Names refused as folder names only: one folder on a case-insensitive file system (macOS,
Windows), or on Windows, which drops a folder name's trailing dots. An npz's class_names
never become folders, and there they are names a person tells apart (EMNIST's A and a)."""


def _zip_named(path: Path, names: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name in names:
            zf.writestr(f"{name}/0.png", _png(1))
    return path


def _refused(path: Path, needles: list[str]) -> None:
    with pytest.raises(DatasetError) as caught:
        load_dataset(path)
    for needle in needles:
        assert needle in str(caught.value), (path.name, str(caught.value))


@pytest.mark.parametrize(("names", "needles"), LOOKALIKES + FOLDER_LOOKALIKES)
def test_lookalike_folder_names_are_refused_by_name(tmp_path, names, needles):
    """Folder names: a zip made on Linux holds 'cat' and 'Cat'; extracted on macOS or
    Windows they are one folder, and one class's images land in the other's."""
    _refused(_zip_named(tmp_path / "d.zip", names), needles)


@pytest.mark.parametrize(("names", "needles"), LOOKALIKES)
def test_lookalike_npz_class_names_are_refused_by_name(tmp_path, names, needles):
    """Refused for what a person sees, never for letter case or trailing dots, which an
    npz's names may differ in."""
    with pytest.raises(DatasetError) as caught:
        load_dataset(_npz_named(tmp_path / "d.npz", names, (0, 1, 0, 1)))
    text = str(caught.value)
    assert all(needle in text for needle in needles), text
    assert "letter case" not in text and "trailing dots" not in text, text
    # arrays in memory are validated as an npz is
    x = np.zeros((4, 4, 4), np.uint8)
    with pytest.raises(DatasetError) as caught:
        TargetDataset.from_arrays(x, np.array([0, 1, 0, 1]), names)
    assert all(needle in str(caught.value) for needle in needles), str(caught.value)


@pytest.mark.parametrize("names", [n for n, _ in FOLDER_LOOKALIKES])
def test_npz_class_names_may_differ_in_case_or_trailing_dots(tmp_path, names):
    """What only a file system merges is a difference in an npz's class_names."""
    ds = load_dataset(_npz_named(tmp_path / "d.npz", names, (0, 1, 0, 1)))
    assert ds.class_names == names
    assert ds.class_counts() == {names[0]: 2, names[1]: 2}


def test_npz_with_upper_and_lower_case_letters_maps_each_label_to_its_own_class(tmp_path):
    """EMNIST-style classes: 'A' and 'a' (and 'B' and 'b') are four classes, each label
    naming its own, each image kept with its label, in a file, its Keras test split and in
    memory; subsampling picks each class's images on its own."""
    names = ["A", "B", "a", "b"]
    y = np.array([2, 0, 3, 1, 0, 2, 1, 3, 2, 0])
    x = (np.arange(len(y), dtype=np.uint8) * 20)[:, None, None] * np.ones((1, 4, 4), np.uint8)
    path = tmp_path / "letters.npz"
    np.savez(path, x=x, y=y, class_names=np.array(names),
             x_test=x[:4], y_test=y[:4])  # fmt: skip
    ds = load_dataset(path)
    assert ds.class_names == names
    assert [ds.class_names[k] for k in ds.labels] == ["a", "A", "b", "B", "A", "a", "B", "b",
                                                     "a", "A"]  # fmt: skip
    assert ds.class_counts() == {"A": 3, "B": 2, "a": 3, "b": 2}
    assert [int(np.asarray(ds.image(i)).flat[0]) for i in (0, 1)] == [0, 20]
    test = load_test_data(path, path, ds.class_names)
    assert [test.class_names[k] for k in test.labels] == ["a", "A", "b", "B"]
    memory = TargetDataset.from_arrays(x, y, names)
    assert memory.class_names == names and memory.digest == ds.digest
    kept = load_dataset(path, max_per_class=1)
    assert kept.class_counts() == {"A": 1, "B": 1, "a": 1, "b": 1}
    # test data is mapped by the names as they are: its 'A' is not the training data's 'a'
    other = tmp_path / "upper.npz"
    np.savez(other, x=x[:2], y=np.array([0, 1]), class_names=np.array(["A", "b"]))
    with pytest.raises(DatasetError, match=r"1 class\(es\) the training data never has: \['A'\]"):
        load_test_data(other, path, ["a", "b"])


def test_ordinary_unicode_class_names_load(tmp_path):
    # a space inside a name is a name; a dot inside one too; an emoji's joiner is no look-alike
    names = ["猫", "café", "Straße", "кот", "a b", "v1.2", "👩\u200d🔬"]
    ds = load_dataset(_folder(tmp_path / "u", {f"{n}/0.png": _png(1) for n in names}))
    assert sorted(ds.class_names) == sorted(names)
    labels = tuple(range(len(names)))
    assert load_dataset(_npz_named(tmp_path / "u.npz", names, labels)).class_names == names
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    with pytest.raises(DatasetError, match="two Unicode forms"):
        load_dataset(_npz_named(tmp_path / "forms.npz", [nfc, nfd], (0, 1)))


def test_an_image_beside_the_class_folders_is_refused_by_name(tmp_path):
    """An image at the ImageFolder's root belongs to no class: named, not skipped. A README,
    .DS_Store, AppleDouble and __MACOSX files there are still ignored, in a folder as in a
    zip whose top folder wraps the classes."""
    junk = {
        "README.txt": b"about",
        ".DS_Store": b"junk",
        "._cover.jpg": b"resource fork",
        "__MACOSX/._a": b"junk",
        "labels.csv": b"a,b",
    }
    root = _folder(tmp_path / "ds", {**FILES, **junk})
    assert load_dataset(root).class_counts() == {"cat": 2, "fox": 1}
    (root / "cover.jpg").write_bytes(_encoded(Image.new("RGB", (4, 4)), "JPEG"))
    with pytest.raises(DatasetError, match=r"beside the class folders.*'cover\.jpg'"):
        load_dataset(root)
    with zipfile.ZipFile(tmp_path / "wrapped.zip", "w") as zf:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                zf.write(path, f"ds/{path.relative_to(root).as_posix()}")
    with pytest.raises(DatasetError, match=r"beside the class folders.*'ds/cover\.jpg'"):
        load_dataset(tmp_path / "wrapped.zip")


def test_seed_and_max_per_class_take_integers_numpy_ones_included(tmp_path):
    """A negative seed is named (numpy's own refusal named none of our arguments, and
    without max_per_class it passed unseen); a numpy integer count is a count, a bool or
    float is not."""
    root = _folder(tmp_path / "d", FILES)
    for call in (
        lambda: load_dataset(root, seed=-1),
        lambda: load_dataset(root, max_per_class=1, seed=-1),
        lambda: split_dataset(load_dataset(root), 0.5, -1),
    ):
        with pytest.raises(DatasetError, match="seed must be a non-negative integer, got -1"):
            call()
    plain = load_dataset(root, max_per_class=1, seed=3)
    numpy = load_dataset(root, max_per_class=np.int64(1), seed=np.int64(3))
    assert numpy.digest == plain.digest and numpy.class_counts() == {"cat": 1, "fox": 1}
    full = load_dataset(root)
    assert split_dataset(full, 0.5, np.int32(7))[1].digest == split_dataset(full, 0.5, 7)[1].digest
    for bad in (True, np.bool_(True), 1.0, np.float64(1.0), 0, np.int64(-2)):
        with pytest.raises(DatasetError, match="max_per_class must be a positive integer"):
            load_dataset(root, max_per_class=bad)
    with pytest.raises(DatasetError, match="seed must be"):
        load_dataset(root, seed=1.5)
