"""Datasets as other systems write them: links in archives and folders, names in another
Unicode form or encoding, repeated members, phone photos' EXIF orientation, 16-bit and float
images. Each case once lost images or classes without a word, decoded pixels that depended on
other pixels, or crashed with an error that was not a DatasetError."""

from __future__ import annotations

import io
import os
import tarfile
import unicodedata
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from zoopick.selection.data import DatasetError, load_dataset, split_dataset, training_count
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
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="max_per_class"):
            training_count([10, 10], max_per_class=bad)
