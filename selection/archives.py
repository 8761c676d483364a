"""Archive streams read under :class:`~zoopick.selection.limits.DatasetLimits` *while* their
bytes are parsed or inflated, never afterwards.

Two holes closed here, shared by every reader that opens a zip (ImageFolder zips and ``.npz``
files alike) or a tar (plain, gzip, bzip2, xz):

- ``zipfile.ZipFile`` parses the whole central directory into objects before anyone can count
  them (about 470 bytes each: 3,000,000 entries cost 1.4 GB). :func:`check_zip_directory`
  reads the end record and walks the directory's fixed-size records from the file first,
  counting entries in constant memory, so ``max_members`` fires before ``ZipFile`` is built.
- ``tarfile`` inflates a compressed tar to walk its headers (skipping a member means
  inflating it). :class:`MeteredStream` is the file ``tarfile`` reads: every byte it inflates
  is counted against the stream bound, the compression ratio and the CPU budget as it comes
  out, and a read that a header sized beyond the bound is refused before it starts.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO

from zoopick.selection.errors import DatasetError, LimitExceeded
from zoopick.selection.limits import Budget, DatasetLimits

__all__ = ["ZIP_ERRORS", "MeteredStream", "check_zip_directory", "open_zip"]

_CHUNK = 1 << 20
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s4s4H3L5H2L")  # central directory file header (46 bytes)
_MAX_COMMENT = 0xFFFF


def check_zip_directory(path: Path, limits: DatasetLimits, budget: Budget | None = None) -> int:
    """The number of entries of the zip at ``path``, counted record by record from its central
    directory (without materialising one), refusing it once over ``max_members``, and refusing
    a directory larger than that many entries could need (``ZipFile`` reads it whole).
    A file that is no zip is left for ``ZipFile`` to name (0 is returned)."""
    where = path.name
    with path.open("rb") as fh:
        size = fh.seek(0, io.SEEK_END)
        tail_len = min(size, _EOCD.size + _MAX_COMMENT)
        fh.seek(size - tail_len)
        tail = fh.read(tail_len)
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + _EOCD.size > len(tail):
            return 0
        _, _, _, _, declared, cd_size, _, _ = _EOCD.unpack_from(tail, at)
        location = size - tail_len + at
        if at >= _EOCD64_LOCATOR.size:
            sig, _, eocd64_at, _ = _EOCD64_LOCATOR.unpack_from(tail, at - _EOCD64_LOCATOR.size)
            if sig == b"PK\x06\x07" and 0 <= eocd64_at < size:
                fh.seek(eocd64_at)
                rec = fh.read(_EOCD64.size)
                if len(rec) == _EOCD64.size and rec[:4] == b"PK\x06\x06":
                    _, _, _, _, _, _, _, declared, cd_size, _ = _EOCD64.unpack(rec)
                    location = eocd64_at
        limits.check("max_members", declared, f"{where}: archive entries (declared)")
        if limits.max_members is not None:
            most = max(16 << 20, limits.max_members * limits.HEADER_BYTES_PER_ENTRY // 4)
            if cd_size > most:
                raise LimitExceeded(
                    f"{where}: the archive's directory ({cd_size:,} bytes) is larger than "
                    f"{limits.max_members:,} entries may need, over the limit "
                    f"max_members={limits.max_members:,}"
                )
        start = location - cd_size
        if start < 0:
            return 0  # ZipFile names the truncated directory
        fh.seek(start)
        reader = io.BufferedReader(fh, _CHUNK)  # type: ignore[arg-type]
        count = consumed = 0
        while consumed + _CENTRAL.size <= cd_size:
            head = reader.read(_CENTRAL.size)
            if len(head) < _CENTRAL.size or head[:4] != b"PK\x01\x02":
                break  # ZipFile names the corrupt directory
            name_len, extra_len, comment_len = struct.unpack_from("<3H", head, 28)
            skip = name_len + extra_len + comment_len
            reader.seek(skip, io.SEEK_CUR)
            consumed += _CENTRAL.size + skip
            count += 1
            if limits.max_members is not None and count > limits.max_members:
                limits.check("max_members", count, f"{where}: archive entries")
            if budget is not None and not count % 65536:
                budget.check(where)
        return count


#: What zipfile raises on a malformed archive (a name that is not the UTF-8 its flag claims is
#: a ``UnicodeDecodeError``, a ValueError), on opening or reading it.
ZIP_ERRORS = (
    zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, zlib.error,
    lzma.LZMAError, struct.error,
)  # fmt: skip


def open_zip(path: Path, limits: DatasetLimits, budget: Budget | None, what: str) -> Any:
    """``zipfile.ZipFile(path)``, its entries counted first (:func:`check_zip_directory`);
    a malformed archive is a ``DatasetError`` saying the file is not a readable ``what``."""
    try:
        check_zip_directory(path, limits, budget)
        return zipfile.ZipFile(path)
    except DatasetError:
        raise
    except ZIP_ERRORS as exc:
        raise DatasetError(f"{path.name}: not a readable {what}: {_plain(exc)}") from exc


def _plain(exc: BaseException) -> str:
    import re

    text = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the data", str(exc)).strip()
    return text or type(exc).__name__


def _opener(magic: bytes) -> Any:
    if magic.startswith(b"\x1f\x8b"):
        return lambda raw: gzip.GzipFile(fileobj=raw, mode="rb")
    if magic.startswith(b"BZh"):
        return bz2.BZ2File
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile
    return None


class MeteredStream(io.RawIOBase):
    """The (inflated) byte stream of a tar file, for ``tarfile.open(fileobj=..., mode="r:")``.

    Counted as it is produced: the furthest position ever inflated is held to
    :meth:`DatasetLimits.stream_bytes`, and (compressed input) to ``max_compression_ratio``
    against the compressed bytes consumed so far; the CPU budget is checked every chunk.
    Seeking forward inflates (and counts) what it skips; seeking back rewinds the
    decompressor, so readers should read members in archive order. A single read larger than
    a member may be (a pax or long-name header claiming gigabytes) is refused before it
    starts."""

    def __init__(self, path: Path, limits: DatasetLimits, budget: Budget) -> None:
        super().__init__()
        self.where = path.name
        self.name = str(path)
        self.limits = limits
        self.budget = budget
        self.bound = limits.stream_bytes()
        self.raw: BinaryIO = path.open("rb")
        magic = self.raw.read(6)
        self.raw.seek(0)
        opener = _opener(magic)
        self.compressed = opener is not None
        try:
            self.inner: Any = opener(self.raw) if opener else self.raw
        except (OSError, EOFError, lzma.LZMAError) as exc:
            self.raw.close()
            raise DatasetError(f"{self.where}: not a readable tar archive: {exc}") from exc
        self.pos = 0
        self.high = 0  # the furthest byte of the stream inflated so far

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def _advance(self, n: int) -> None:
        self.pos += n
        if self.pos <= self.high:
            return
        self.high = self.pos
        if self.bound is not None and self.high > self.bound:
            raise LimitExceeded(
                f"{self.where}: the tar stream inflates past {self.bound:,} bytes, over the "
                f"limit max_total_bytes={self.limits.max_total_bytes:,} (plus headers)"
            )
        if self.compressed:
            self.limits.check_ratio(self.high, self.raw.tell(), self.where)
        self.budget.check(self.where)

    def _refuse_beyond(self, end: int, what: str) -> None:
        if self.bound is not None and end > self.bound:
            raise LimitExceeded(
                f"{self.where}: {what} reaches byte {end:,} of the tar stream, past "
                f"{self.bound:,}, over the limit max_total_bytes="
                f"{self.limits.max_total_bytes:,} (plus headers)"
            )

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = (self.bound if self.bound is not None else 1 << 62) - self.pos + 1
        one = max(_CHUNK, self.limits.max_member_bytes or 0)
        if size > one:  # tarfile reads member data in chunks; only a header reads this much
            raise LimitExceeded(
                f"{self.where}: a tar header declares {size:,} bytes of metadata, over the "
                f"limit max_member_bytes={self.limits.max_member_bytes:,}"
            )
        self._refuse_beyond(self.pos + size, "a read")
        parts = []
        while size > 0:
            chunk = self.inner.read(min(size, _CHUNK))
            if not chunk:
                break
            parts.append(chunk)
            size -= len(chunk)
            self._advance(len(chunk))
        return b"".join(parts)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self.pos
        elif whence != io.SEEK_SET:
            raise OSError("a tar stream is not seekable from its end")
        if offset < 0:
            raise OSError("negative seek position")
        self._refuse_beyond(offset, "a member")
        if not self.compressed:
            self.pos = self.inner.seek(offset)
            self.high = max(self.high, min(self.pos, self.raw.tell()))
            return self.pos
        if offset < self.pos:  # back: rewind the decompressor and inflate forwards again
            self.inner.seek(0)
            self.pos = 0
        while self.pos < offset:
            chunk = self.inner.read(min(offset - self.pos, _CHUNK))
            if not chunk:
                break
            self._advance(len(chunk))
        return self.pos

    def close(self) -> None:
        try:
            if self.inner is not self.raw:
                self.inner.close()
        finally:
            self.raw.close()
            super().close()
