"""How a block's (index, value) pairs travel: 8, 6 or 4 bytes a pair.

``PairCodec(value_dtype, index16=False)`` packs the pairs of one block into one byte
buffer and back; a message of several blocks is their concatenation (both sides know each
block's pair count and extent, so no sizes travel).

* ``index16=False``: int32 absolute indices, then the values (float32: 8 bytes a pair;
  float16 or bfloat16: 6).
* ``index16=True`` (issue 9's "4 bytes a pair"): indices relative to the block start in 16
  bits with 16-bit values. A 16-bit offset reaches 65,536 elements, so a longer block is cut
  into chunks of ``CHUNK`` elements: the pairs are sorted by position and a header of one
  int32 count per chunk says how many fall into each (``ceil(length / CHUNK)`` counts, 4
  bytes each: 112 bytes for a 1.8M-element block, against 4 bytes for each of its pairs).
  The receiver rebuilds ``chunk * CHUNK + offset`` exactly, for any block length. The
  counts are computed on the device and expanded with ``searchsorted`` (no host sync).

Values are rounded by the caller (``exchange.to_wire``), which keeps what was lost in the
residual; the codec only moves bits.
"""

from __future__ import annotations

import math

import torch

from zoopick.training.comm.errors import CommError

CHUNK = 1 << 16
VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class PairCodec:
    def __init__(self, value_dtype: torch.dtype, index16: bool = False) -> None:
        if value_dtype not in VALUE_DTYPES:
            raise CommError(f"pair values must be one of {VALUE_DTYPES}, got {value_dtype}")
        if index16 and value_dtype == torch.float32:
            raise CommError("16-bit indices go with 16-bit values (float16 or bfloat16)")
        self.value_dtype = value_dtype
        self.index16 = index16
        self.value_bytes = torch.empty(0, dtype=value_dtype).element_size()

    def chunks(self, length: int) -> int:
        """Chunk counts in the header of a block of ``length`` elements (16-bit form)."""
        return math.ceil(length / CHUNK) if self.index16 else 0

    def nbytes(self, count: int, length: int) -> int:
        """Bytes of ``count`` pairs of a block of ``length`` elements."""
        if not self.index16:
            return count * (4 + self.value_bytes)
        return 4 * self.chunks(length) + count * (2 + self.value_bytes)

    def pack(self, idx: torch.Tensor, values: torch.Tensor, lo: int, length: int) -> torch.Tensor:
        """One uint8 buffer for the pairs (absolute ``idx`` within ``[lo, lo + length)``,
        ``values`` already in ``value_dtype``)."""
        values = values.to(self.value_dtype)
        if not self.index16:
            parts = [idx.to(torch.int32), values]
        else:
            rel, order = torch.sort(idx.long() - lo)
            counts = torch.zeros(self.chunks(length), dtype=torch.int32, device=idx.device)
            counts.index_add_(0, rel // CHUNK, torch.ones_like(rel, dtype=torch.int32))
            offsets = ((rel % CHUNK) - CHUNK // 2).to(torch.int16)  # in int16's range
            parts = [counts, offsets, values[order]]
        return torch.cat([p.contiguous().view(torch.uint8) for p in parts])

    def unpack(
        self, buf: torch.Tensor, count: int, lo: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`pack`: (absolute int64 indices, values in ``value_dtype``)."""
        if buf.numel() != self.nbytes(count, length):
            raise CommError(
                f"pair buffer of {buf.numel()} bytes, expected {self.nbytes(count, length)}"
            )
        if buf.storage_offset() % 4:  # a later block of a message: realign to view int32
            buf = buf.clone()
        if not self.index16:
            idx = buf[: 4 * count].view(torch.int32)
            return idx.long(), buf[4 * count :].view(self.value_dtype)
        head = 4 * self.chunks(length)
        counts = buf[:head].view(torch.int32)
        offsets = buf[head : head + 2 * count].view(torch.int16).to(torch.int64) + CHUNK // 2
        ends = torch.cumsum(counts, 0)
        chunk = torch.searchsorted(ends, torch.arange(count, device=buf.device), right=True)
        return lo + chunk * CHUNK + offsets, buf[head + 2 * count :].view(self.value_dtype)

    def split(
        self, buf: torch.Tensor, blocks: list[tuple[int, int, int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Unpack a message of several blocks, given (count, lo, length) of each in order."""
        out, at = [], 0
        for count, lo, length in blocks:
            size = self.nbytes(count, length)
            out.append(self.unpack(buf[at : at + size], count, lo, length))
            at += size
        if at != buf.numel():
            raise CommError(f"message of {buf.numel()} bytes, blocks take {at}")
        return out
