"""The pair codec (``training/comm/pairs.py``): 8, 6 and 4 bytes a pair, round trips.

Checked against plain expectations: indices come back exactly (sorted by position in the
16-bit form), values bit-identical to a plain cast to the value type (so within that
type's rounding of the input), sizes as documented, and the errors."""

from __future__ import annotations

import pytest
import torch

import zoopick.training.comm as comm
from zoopick.training.comm import CommError
from zoopick.training.comm.pairs import CHUNK, PairCodec

EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 0.0}


def _pairs(length: int, count: int, lo: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(length, generator=gen)[:count] + lo
    return idx, torch.randn(count, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 1000, CHUNK, CHUNK + 1, 3 * CHUNK + 17])
def test_sixteen_bit_round_trip(dtype, length):
    codec = PairCodec(dtype, index16=True)
    lo = 12_345
    count = min(length, 700)
    idx, vals = _pairs(length, count, lo)
    if length >= CHUNK:  # the edges of a chunk: offsets 0 and 65,535 of the first chunk
        idx[:2] = torch.tensor([lo, lo + CHUNK - 1])
    idx[-1] = lo + length - 1  # the block's last element
    buf = codec.pack(idx, vals.to(dtype), lo, length)
    assert buf.dtype == torch.uint8
    chunks = -(-length // CHUNK)
    assert buf.numel() == codec.nbytes(count, length) == 4 * chunks + 4 * count
    got_idx, got_vals = codec.unpack(buf, count, lo, length)
    order = torch.argsort(idx)
    assert torch.equal(got_idx, idx[order])  # exact, sorted by position
    assert torch.equal(got_vals, vals[order].to(dtype))  # the bits that were packed
    err = (got_vals.float() - vals[order]).abs()
    assert torch.all(err <= EPS[dtype] * vals[order].abs() + 1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_thirty_two_bit_indices_keep_their_order(dtype):
    codec = PairCodec(dtype)
    idx, vals = _pairs(10**6, 500, 7)
    buf = codec.pack(idx, vals.to(dtype), 7, 10**6)
    assert buf.numel() == codec.nbytes(500, 10**6) == 500 * (4 + codec.value_bytes)
    got_idx, got_vals = codec.unpack(buf, 500, 7, 10**6)
    assert torch.equal(got_idx, idx) and torch.equal(got_vals, vals.to(dtype))


def test_a_message_of_several_blocks_splits_back():
    """Odd pair counts put later blocks at offsets that are not multiples of 4."""
    codec = PairCodec(torch.float16, index16=True)
    blocks = [(3, 0, 10), (5, 10, CHUNK + 5), (1, CHUNK + 15, 4)]
    packed, expect = [], []
    for s, (count, lo, length) in enumerate(blocks):
        idx, vals = _pairs(length, count, lo, seed=s)
        packed.append(codec.pack(idx, vals.half(), lo, length))
        order = torch.argsort(idx)
        expect.append((idx[order], vals.half()[order]))
    got = codec.split(torch.cat(packed), blocks)
    for (gi, gv), (ei, ev) in zip(got, expect, strict=True):
        assert torch.equal(gi, ei) and torch.equal(gv, ev)
    with pytest.raises(CommError):
        codec.split(torch.cat(packed)[:-1], blocks)


def test_errors():
    with pytest.raises(CommError):
        PairCodec(torch.float32, index16=True)  # 16-bit indices need 16-bit values
    with pytest.raises(CommError):
        PairCodec(torch.float64)
    codec = PairCodec(torch.bfloat16, index16=True)
    with pytest.raises(CommError):
        codec.unpack(torch.zeros(9, dtype=torch.uint8), 1, 0, 10)  # wrong size
    with pytest.raises((IndexError, RuntimeError)):  # an index outside its block
        codec.pack(torch.tensor([CHUNK + 3]), torch.ones(1, dtype=torch.bfloat16), 0, CHUNK)
    with pytest.raises(CommError):
        comm.make_hook("spardl", pairs16="int8")
    with pytest.raises(CommError):
        comm.make_hook("spardl", pairs16="bf16", fp16=True)
    state, _ = comm.make_hook("spardl", pairs16="fp16")
    assert state.codec.value_dtype == torch.float16 and state.codec.index16
