"""A corpus of hostile dataset files, at any size: every supported archive format, npz and
image inputs built to cost a reader far more than their bytes (bombs, ratio tricks, headers
that lie, floods of entries, links and names that point outside, encrypted or truncated
members). Each is refused by the dataset loader with a ``DatasetError`` naming what is wrong.

The suite builds it at small :class:`Sizes` (tests/test_hostile_corpus.py, with limits scaled
down to match) and ``benchmarks/hostile`` at full size against a running service. Huge content
is never held: zero streams are one compressed block repeated, entry floods one record
repeated.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from tests.bombs import MiB, many_classes_npz, npz_declaring, png_bytes, zip_bomb

GiB = 1 << 30
PNG = png_bytes(8, 8, 100)
PAD = {"a/0.png": PNG, "a/1.png": PNG, "b/0.png": PNG, "b/1.png": PNG}  # 2 classes, 2 each


@dataclass(frozen=True)
class Sizes:
    """How big the corpus is. Defaults are the suite's; ``FULL`` is the issue's probe."""

    bomb_mib: int = 1
    """Compressed MiB of zeros in the stream bombs (each MiB inflates to about 1 GiB)."""
    entries: int = 5_000
    """Entries of the entry floods (zip directory records, tar headers)."""
    member_mib: int = 16
    """Declared MiB of the tar members of zeros (within the stream bound, so the ratio
    limit is what stops them)."""
    images: int = 200
    """float64 64x64x3 images of zeros in the npz ratio bomb."""


FULL = Sizes(bomb_mib=42, entries=3_000_000, member_mib=512, images=10_900)


@dataclass(frozen=True)
class Hostile:
    name: str  # the upload's file name (its suffix picks the reader)
    build: Callable[[], bytes]
    refused: tuple[str, ...]  # the error names one of these (a limit, or the plain reason)
    about: str  # what the input tries, in a few words


# ---- streams of zeros, never held inflated


def _repeated(member: bytes, total_compressed: int) -> bytes:
    """Concatenated compressed members (gzip, bzip2 and xz readers all continue across
    members) up to about ``total_compressed`` bytes."""
    return member * max(1, total_compressed // len(member))


_ZERO_MIB = bytes(MiB)


def gzip_zeros(compressed: int) -> bytes:
    return _repeated(gzip.compress(_ZERO_MIB * 4, 9), compressed)


def bz2_zeros(compressed: int) -> bytes:
    return _repeated(bz2.compress(_ZERO_MIB * 16, 9), compressed)


def xz_zeros(compressed: int) -> bytes:
    return _repeated(lzma.compress(_ZERO_MIB * 16), compressed)


# ---- tar


def tar_header(name: str, size: int, kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.type = kind
    info.linkname = link
    return info.tobuf(format=tarfile.GNU_FORMAT)  # GNU: sizes over 8 GiB in base-256


def tar_entries(files: dict[str, bytes]) -> bytes:
    """Tar entries for ``files`` without the end-of-archive blocks (more may follow)."""
    out = []
    for name, data in files.items():
        out.append(tar_header(name, len(data)) + data + bytes(-len(data) % tarfile.BLOCKSIZE))
    return b"".join(out)


def tar_of(files: dict[str, bytes]) -> bytes:
    return tar_entries(files) + bytes(2 * tarfile.BLOCKSIZE)


def tar_declaring_huge(sizes: Sizes) -> bytes:
    """The issue's item 1: a tar.gz whose one header declares an 8 GiB member, followed by
    gzip members of zeros (walking to the next header inflates them all)."""
    head = gzip.compress(tar_entries(PAD) + tar_header("a/big.png", 8 * GiB))
    return head + gzip_zeros(sizes.bomb_mib * MiB)


def tar_zeros(sizes: Sizes, compress: Callable[[int], bytes], opener: Callable) -> bytes:
    """An honest header for a member of zeros (not an image, so only walked past) whose
    stream inflates about 1000-fold or more."""
    body = compress(sizes.bomb_mib * MiB)
    return opener(tar_entries(PAD) + tar_header("a/zeros.bin", sizes.member_mib * MiB)) + body


def tar_entry_flood(sizes: Sizes, *, repeated: bool = False) -> bytes:
    """``entries`` headers of empty files, each of its own name (or, ``repeated``, one
    header over and over), gzip-compressed in chunks."""
    comp = zlib.compressobj(6, zlib.DEFLATED, 31)  # gzip framing
    parts, done, block = [], 0, 4096
    while done < sizes.entries:
        n = min(block, sizes.entries - done)
        if repeated:
            headers = tar_header("a/empty.png", 0) * n
        else:
            headers = b"".join(tar_header(f"a/{i}.png", 0) for i in range(done, done + n))
        parts.append(comp.compress(headers))
        done += n
    parts.append(comp.compress(bytes(1024)) + comp.flush())
    return b"".join(parts)


def tar_huge_metadata(kind: bytes) -> Callable[[Sizes], bytes]:
    """A pax or GNU long-name header that declares a gigabyte of metadata (tarfile reads
    metadata in one call), followed by zeros."""

    def build(sizes: Sizes) -> bytes:
        return gzip.compress(tar_header("././@meta", GiB, kind)) + gzip_zeros(sizes.bomb_mib * MiB)

    return build


def tar_link(name: str, target: str, kind: bytes) -> bytes:
    return tar_entries(PAD) + tar_header(name, 0, kind, target) + bytes(1024)


# ---- zip


def zip_of(files: dict[str, bytes], *, flag_bits: int = 0, method: int | None = None) -> bytes:
    """A stored zip of ``files``; ``flag_bits`` / ``method`` patched into every header."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), data)
    out = bytearray(buf.getvalue())
    for sig, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = out.find(sig)
        while at >= 0:
            out[at + flag_at] |= flag_bits
            if method is not None:
                struct.pack_into("<H", out, at + flag_at + 2, method)
            at = out.find(sig, at + 4)
    return bytes(out)


def zip_directory_flood(sizes: Sizes, *, declare: int | None = None) -> bytes:
    """The issue's item 2: central-directory records only (one record repeated), no data;
    ``declare``: the entry count the end record claims instead of the truth."""
    name = b"a/000000.png"
    record = struct.pack(
        "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 33, 0, 0, 0, len(name), 0, 0, 0, 0, 0, 0
    ) + name  # fmt: skip
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 33, 0, 0, 0, len(name), 0)
    local += name  # one empty member the records all point at (an npz must start with one)
    n = sizes.entries
    count = min(declare if declare is not None else n, 0xFFFF)
    at = len(local)
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(record) * n, at, 0)
    if declare is None and n > 0xFFFF:  # the true count needs the zip64 end record
        eocd64 = struct.pack(
            "<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(record) * n, at
        )
        locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, at + len(record) * n, 1)
        eocd = eocd64 + locator + struct.pack(
            "<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0
        )  # fmt: skip
    return local + record * n + eocd


def zip_overlapping(sizes: Sizes) -> bytes:
    """Many directory entries pointing at one deflated member of zeros (the overlapping-file
    bomb): each member alone looks fair, together they inflate without end."""
    one = zip_bomb([("a/k.png", 4)], PAD)
    local_end = one.index(b"PK\x01\x02")
    central = one[local_end : one.index(b"PK\x05\x06")]
    first = central[: 46 + struct.unpack_from("<H", central, 28)[0]]
    records = [central]
    for i in range(max(8, sizes.bomb_mib * 64)):
        name = f"a/o{i:06d}.png".encode()
        rec = bytearray(first[:46]) + name
        struct.pack_into("<H", rec, 28, len(name))
        records.append(bytes(rec))
    cd = b"".join(records)
    n = sum(1 for _ in _records(cd))
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, n, n, len(cd), local_end, 0)
    return one[:local_end] + cd + eocd


def _records(cd: bytes) -> Iterator[int]:
    at = 0
    while at + 46 <= len(cd):
        yield at
        at += 46 + sum(struct.unpack_from("<3H", cd, at + 28))


# ---- images


def jpeg_claiming(width: int, height: int) -> bytes:
    """A small JPEG whose frame header claims ``width`` x ``height``."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="JPEG")
    out = bytearray(buf.getvalue())
    sof = out.find(b"\xff\xc0")
    struct.pack_into(">HH", out, sof + 5, height, width)
    return bytes(out)


def gif_claiming(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("P", (8, 8)).save(buf, format="GIF")
    out = bytearray(buf.getvalue())
    struct.pack_into("<HH", out, 6, width, height)  # the logical screen
    at = out.find(b"\x2c")  # the image descriptor
    struct.pack_into("<HH", out, at + 5, width, height)
    return bytes(out)


# ---- npz


def npz_ratio(sizes: Sizes) -> bytes:
    """The issue's item 3: float64 images of zeros, compressed (ratio about 680 and more)."""
    buf = io.BytesIO()
    np.savez_compressed(
        buf, x=np.zeros((sizes.images, 64, 64, 3)), y=np.arange(sizes.images, dtype=np.int64) % 2
    )
    return buf.getvalue()


def npz_truncated() -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "|u1", "fortran_order": False, "shape": (100, 8, 8)}
    )
    y = io.BytesIO()
    np.save(y, np.arange(100) % 2)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("x.npy", header.getvalue() + bytes(10))
        zf.writestr("y.npy", y.getvalue())
    return buf.getvalue()


def npz_object() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=np.zeros((4, 8, 8), np.uint8), y=np.array([0, 1, 0, 1], dtype=object))
    return buf.getvalue()


def _noise_pad() -> dict[str, bytes]:
    """Two classes of two incompressible PNGs (a cut compressed stream ends mid-member)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    out = {}
    for name in PAD:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, "PNG")
        out[name] = buf.getvalue()
    return out


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def corpus(sizes: Sizes = Sizes()) -> list[Hostile]:  # noqa: B008 - frozen default
    """Every hostile input at ``sizes``."""
    s = sizes
    flood = ("max_members",)
    RATIO = ("max_compression_ratio",)  # noqa: N806
    PIXELS = ("max_pixels", "is too large")  # noqa: N806 - Pillow's own bomb check, first
    return [
        # tar, every compression
        Hostile("declared-8gib.tar.gz", lambda: tar_declaring_huge(s), ("max_total_bytes",),
                "a header declaring an 8 GiB member, then gzip members of zeros"),
        Hostile("zeros.tar.gz", lambda: tar_zeros(s, gzip_zeros, gzip.compress),
                RATIO, "a member of zeros walked past (gzip)"),
        Hostile("zeros.tar.bz2", lambda: tar_zeros(s, bz2_zeros, bz2.compress),
                RATIO, "a member of zeros walked past (bzip2)"),
        Hostile("zeros.tar.xz", lambda: tar_zeros(s, xz_zeros, lzma.compress),
                RATIO, "a member of zeros walked past (xz)"),
        Hostile("bz2-inside.tar.gz", lambda: tar_zeros(s, bz2_zeros, bz2.compress), RATIO,
                "a bzip2 bomb named .tar.gz (read by its content)"),
        Hostile("xz-inside.tar.gz", lambda: tar_zeros(s, xz_zeros, lzma.compress), RATIO,
                "an xz bomb named .tar.gz"),
        Hostile("entries.tar.gz", lambda: tar_entry_flood(s), flood, "a flood of tar headers"),
        Hostile("repeats.tar.gz", lambda: tar_entry_flood(s, repeated=True), ("appears twice",),
                "a flood of one tar header repeated"),
        Hostile("pax.tar.gz", lambda: tar_huge_metadata(tarfile.XHDTYPE)(s),
                ("max_member_bytes", "max_total_bytes"), "a pax header of 1 GiB"),
        Hostile("longname.tar.gz", lambda: tar_huge_metadata(tarfile.GNUTYPE_LONGNAME)(s),
                ("max_member_bytes", "max_total_bytes"), "a GNU long name of 1 GiB"),
        Hostile("symlink.tar", lambda: tar_link("a/x.png", "../../etc/passwd", tarfile.SYMTYPE),
                ("unsafe archive link",), "a symlink out of the archive"),
        Hostile("hardlink.tar", lambda: tar_link("a/x.png", "/etc/passwd", tarfile.LNKTYPE),
                ("unsafe archive link",), "a hard link to an absolute path"),
        Hostile("traversal.tar", lambda: tar_of({**PAD, "../evil.png": PNG}),
                ("unsafe archive member",), "a member named ../"),
        Hostile("zip-inside.tar.gz", lambda: zip_of(PAD), ("not a readable tar",),
                "a zip named .tar.gz"),
        Hostile("truncated.tar.gz", lambda: _half(gzip.compress(tar_of(_noise_pad()))),
                ("not a readable tar", "cannot read member", "no class folders"),
                "a gzip stream cut short"),
        # zip
        Hostile("member-bomb.zip", lambda: zip_bomb([("a/bomb.png", 64 * s.bomb_mib)], PAD),
                ("max_member_bytes", "max_compression_ratio"), "a member of zeros"),
        Hostile("liar.zip", lambda: zip_bomb([("a/bomb.png", 64 * s.bomb_mib)], PAD, declare=900),
                ("max_compression_ratio", "max_member_bytes", "Bad CRC-32"),
                "a member lying about its size (zipfile reads only what it declares)"),
        Hostile("overlap.zip", lambda: zip_overlapping(s),
                ("max_compression_ratio", "max_total_bytes", "Overlapped"),
                "many entries sharing one compressed member"),
        Hostile("directory.zip", lambda: zip_directory_flood(s), flood,
                "central-directory records only"),
        Hostile("directory-liar.zip", lambda: zip_directory_flood(s, declare=2), flood,
                "directory records, the end record claiming 2"),
        Hostile("encrypted.zip", lambda: zip_of(PAD, flag_bits=1), ("encrypted",),
                "members flagged as encrypted"),
        Hostile("method.zip", lambda: zip_of(PAD, method=99), ("compression method",),
                "an unknown compression method"),
        Hostile("absolute.zip", lambda: zip_of({**PAD, "/etc/x.png": PNG}),
                ("unsafe archive member",), "an absolute member name"),
        Hostile("backslash.zip", lambda: zip_of({**PAD, "a\\..\\..\\x.png": PNG}),
                ("unsafe archive member",), "a traversal with backslashes"),
        Hostile("not-a-zip.zip", lambda: b"PK\x03\x04" + bytes(100), ("not a readable zip",),
                "a zip signature and nothing else"),
        # images
        Hostile("png-pixels.zip", lambda: zip_of({**PAD, "a/big.png": png_bytes(5000, 5000)}),
                ("max_pixels",), "a 25-megapixel PNG of a few KB"),
        Hostile("jpeg-pixels.zip",
                lambda: zip_of({**PAD, "a/big.jpg": jpeg_claiming(60000, 60000)}),
                PIXELS, "a JPEG header claiming 60000 x 60000"),
        Hostile("gif-pixels.zip", lambda: zip_of({**PAD, "a/big.gif": gif_claiming(65535, 65535)}),
                PIXELS, "a GIF header claiming 65535 x 65535"),
        Hostile("garbage-image.zip",
                lambda: zip_of({**PAD, "a/x.png": b"\x89PNG\r\n\x1a\n" + bytes(64)}),
                ("unreadable",), "a PNG signature and nothing else"),
        # npz
        Hostile("ratio.npz", lambda: npz_ratio(s), ("max_compression_ratio", "max_total_bytes"),
                "float64 zeros compressed"),
        Hostile("pixels.npz", lambda: npz_declaring((2, 23170, 23170)), ("max_pixels",),
                "an x header claiming 2 x 23170 x 23170"),
        Hostile("bytes.npz", lambda: npz_declaring((5000, 4000, 4000)),
                ("max_total_bytes", "max_pixels", "max_members"), "an x header claiming 80 GB"),
        Hostile("count.npz", lambda: npz_declaring((s.entries * 100, 2, 2)), flood,
                "an x header claiming a flood of images"),
        Hostile("classes.npz", lambda: many_classes_npz(max(s.entries, 3000)),
                ("max_classes", "max_members"), "one class per image"),
        Hostile("directory.npz", lambda: zip_directory_flood(s), flood,
                "an npz of directory records only"),
        Hostile("truncated.npz", npz_truncated, ("ends early",), "x's data cut short"),
        Hostile("object.npz", npz_object, ("object arrays",), "a pickled object array"),
        Hostile("encrypted.npz", lambda: zip_of({"x.npy": b"", "y.npy": b""}, flag_bits=1),
                ("encrypted",), "an npz of encrypted members"),
    ]  # fmt: skip
