"""Small files that declare (or inflate to) huge sizes, made in milliseconds without ever holding
the huge content: decompression-bomb zips, npz files whose ``.npy`` headers claim giant
arrays, datasets with a flood of classes. For the dataset-limit tests (library and service).
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import numpy as np

MiB = 1 << 20
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01


def _zero_deflate(mib: int) -> tuple[bytes, int]:
    """(raw deflate stream, crc32) of ``mib`` MiB of zero bytes: one MiB compressed once and
    repeated (a full flush makes each copy independent of the one before)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = comp.compress(bytes(MiB)) + comp.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    zero = bytes(MiB)
    for _ in range(mib):
        crc = zlib.crc32(zero, crc)
    final = zlib.compressobj(9, zlib.DEFLATED, -15).flush(zlib.Z_FINISH)  # empty final block
    return block * mib + final, crc


def zip_bomb(
    members: list[tuple[str, int]],
    extra: dict[str, bytes] | None = None,
    *,
    declare: int | None = None,
) -> bytes:
    """A zip whose members ``(name, MiB of zeros)`` inflate to that size (about 1000:1), plus
    ordinary stored ``extra`` members. ``declare``: the size the bomb members' headers claim
    (a lie), instead of the truth."""
    out = io.BytesIO()
    central = []
    entries: list[tuple[str, bytes, int, int, int]] = []  # name, data, crc, usize, method
    for name, mib in members:
        data, crc = _zero_deflate(mib)
        entries.append((name, data, crc, mib * MiB if declare is None else declare, 8))
    for name, blob in (extra or {}).items():
        entries.append((name, blob, zlib.crc32(blob), len(blob), 0))
    for name, data, crc, usize, method in entries:
        offset = out.tell()
        fname = name.encode()
        out.write(
            struct.pack(
                "<4s5H3L2H",
                b"PK\x03\x04",
                20,
                0,
                method,
                0,
                _DOS_DATE,
                crc,
                len(data),
                usize,
                len(fname),
                0,
            )  # fmt: skip
        )
        out.write(fname + data)
        central.append(
            struct.pack(
                "<4s6H3L5H2L",
                b"PK\x01\x02",
                20,
                20,
                0,
                method,
                0,
                _DOS_DATE,
                crc,
                len(data),
                usize,
                len(fname),
                0,
                0,
                0,
                0,
                0,
                offset,
            )  # fmt: skip
            + fname
        )
    cd_offset = out.tell()
    for c in central:
        out.write(c)
    cd_size = out.tell() - cd_offset
    out.write(
        struct.pack(
            "<4s4H2LH", b"PK\x05\x06", 0, 0, len(central), len(central), cd_size, cd_offset, 0
        )
    )
    return out.getvalue()


def png_bytes(width: int, height: int, value: int = 0) -> bytes:
    """A grey PNG; width x height may be large (a flat image compresses to a few KB)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height), value).save(buf, format="PNG")
    return buf.getvalue()


def npz_declaring(shape: tuple[int, ...], dtype: str = "|u1", *, labels: int = 2) -> bytes:
    """An npz whose ``x.npy`` header declares ``shape`` but holds no data (loading it would
    allocate the whole declared array before noticing), with a small valid ``y``."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": dtype, "fortran_order": False, "shape": shape}
    )
    y = io.BytesIO()
    np.save(y, np.arange(labels, dtype=np.int64) % 2)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("x.npy", header.getvalue() + b"\0" * 64)
        zf.writestr("y.npy", y.getvalue())
    return buf.getvalue()


def many_classes_npz(classes: int, per_class: int = 1, size: int = 2) -> bytes:
    """``classes`` classes of ``per_class`` tiny images each (the class-count flood)."""
    n = classes * per_class
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        x=np.zeros((n, size, size), np.uint8),
        y=np.repeat(np.arange(classes, dtype=np.int64), per_class),
    )
    return buf.getvalue()
