"""Communication primitives shared by the hooks, with byte accounting.

Only operations that both gloo (CPU) and NCCL (GPU) implement are used: ``all_gather`` (of
equal-size tensors: the hooks send fixed capacities, see ``hostread``), ``all_reduce``
and point-to-point ``isend``/``irecv`` batched with ``batch_isend_irecv`` (NCCL needs the
batch when two workers send to each other in the same round). All calls are synchronous: the
hooks return already-completed futures, which keeps multi-round schemes simple and makes every
worker issue the same collectives in the same order (DDP calls the hook bucket by bucket in
index order on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zoopick.training.comm import select
from zoopick.training.comm.errors import CommError

if TYPE_CHECKING:
    from zoopick.training.comm.state import HookState

FP16_MAX = 65504.0
INDEX_DTYPE = torch.int32

SPARSE_AVERAGE = True
"""``PairSum.write`` divides only the positions its pairs touch (the rest are zeros) instead
of the whole bucket; the same values. ``False`` keeps the full pass (the reference)."""


def to_wire(values: torch.Tensor, fp16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload to send, float32 value the receiver will see). With ``fp16`` the payload is
    half precision (clamped to its range); the caller keeps ``values - seen`` as residual, so
    rounding is fed back instead of lost."""
    return round_to(values, torch.float16 if fp16 else torch.float32)


def round_to(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`to_wire` for a value type: float32, float16 (clamped to its range) or
    bfloat16 (float32's range, 8 significant bits)."""
    if dtype == torch.float32:
        v = values.float()
        return v, v
    if dtype == torch.float16:
        values = values.clamp(-FP16_MAX, FP16_MAX)
    payload = values.to(dtype)
    return payload, payload.float()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def allreduce_sum(state: HookState, tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` in place over the group (ring model for the byte count)."""
    P = state.size
    if P > 1:
        with state.stats.timer("comm_s"):
            dist.all_reduce(tensor, group=state.group)
        b = _nbytes(tensor) * 2 * (P - 1) / P
        state.stats.add(bytes_sent=b, bytes_recv=b)
    return tensor


def allgather_parts(
    state: HookState,
    parts: Sequence[torch.Tensor],
    lengths: Sequence[Sequence[int]] | None = None,
) -> list[list[torch.Tensor]]:
    """All-gather 1-D tensors; returns ``out[r][i]`` = rank r's ``parts[i]``.

    ``lengths[r][i]``, when every rank already knows it, is the length of rank r's part i (no
    header is sent). Otherwise the lengths are all-gathered first (one int64 per part) and
    read on the host, a host sync that no hook's steady state uses. Parts are padded to the
    longest and trimmed after."""
    P = state.size
    if P == 1:
        return [list(parts)]
    group = state.group
    stats = state.stats
    if lengths is not None:
        mine = [p.numel() for p in parts]
        if list(lengths[state.rank]) != mine:
            raise CommError(f"all-gather: parts of length {mine}, announced {lengths[state.rank]}")
    with stats.timer("comm_s"):
        if lengths is None:
            dev = parts[0].device
            mine = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=dev)
            got = [torch.empty_like(mine) for _ in range(P)]
            dist.all_gather(got, mine, group=group)
            lengths = [g.tolist() for g in got]
            hb = _nbytes(mine) * (P - 1)
            stats.add(bytes_sent=hb, bytes_recv=hb)
        gathered: list[list[torch.Tensor]] = [[] for _ in range(P)]
        for i, part in enumerate(parts):
            longest = max(lengths[r][i] for r in range(P))
            if longest == 0:
                for r in range(P):
                    gathered[r].append(part.new_empty(0))
                continue
            if part.numel() < longest:
                pad = part.new_zeros(longest - part.numel())
                send = torch.cat([part, pad])
            else:
                send = part.contiguous()
            bufs = [torch.empty_like(send) for _ in range(P)]
            dist.all_gather(bufs, send, group=group)
            for r in range(P):
                gathered[r].append(bufs[r][: lengths[r][i]])
            b = _nbytes(send) * (P - 1)
            stats.add(bytes_sent=b, bytes_recv=b)
    return gathered


def p2p_exchange(
    state: HookState,
    sends: Sequence[tuple[int, Sequence[torch.Tensor]]],
    recvs: Sequence[tuple[int, Sequence[tuple[int, torch.dtype]]]],
) -> list[list[torch.Tensor]]:
    """One round of point-to-point messages (peers are ranks within the group).

    ``sends``: (peer, tensors); ``recvs``: (peer, [(numel, dtype), ...]) describing what that
    peer sends us, in the same order. Empty tensors are not sent (both sides know the sizes).
    Returns the received tensors per entry of ``recvs``."""
    device = state.device
    ops: list[dist.P2POp] = []
    out: list[list[torch.Tensor]] = []
    sent = 0
    recv = 0
    for peer, tensors in sends:
        g = state.global_rank(peer)
        for t in tensors:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t.contiguous(), g, group=state.group))
                sent += _nbytes(t)
    for peer, specs in recvs:
        g = state.global_rank(peer)
        got = []
        for numel, dtype in specs:
            t = torch.empty(numel, dtype=dtype, device=device)
            if numel:
                ops.append(dist.P2POp(dist.irecv, t, g, group=state.group))
                recv += _nbytes(t)
            got.append(t)
        out.append(got)
    if ops:
        with state.stats.timer("comm_s"):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    state.stats.add(bytes_sent=sent, bytes_recv=recv)
    return out


def add_pairs(out: torch.Tensor, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``out[idx] += val`` for each (idx, val) piece, one piece after another.

    Adding piece by piece (indices are unique within a piece, but for padding pairs, which
    add 0 at their slot's number: ``sparse.slot_numbers``) keeps the summation order the
    same on every rank and device, so all ranks apply bit-identical updates."""
    for idx, val in pieces:
        if idx.numel():
            out.index_add_(0, idx.long(), val.to(out.dtype))


class PairSum:
    """The summed update of a bucket as (positions, values) pieces, for schemes whose sum is
    sparse: ``write`` adds them into a zeroed output in the order of :func:`add_pairs`, so
    the driver fills the bucket buffer in place instead of materialising a dense sum and
    copying it (on a CPU the temporary's allocation, page faults and copy cost more than
    the selection of a 10M-element bucket)."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pieces = list(pieces)

    def write(self, out: torch.Tensor, divisor: int = 1, zeroed: bool = False) -> torch.Tensor:
        """``out`` becomes the sum divided by ``divisor`` (the average over the workers);
        ``zeroed``: it holds zeros already (``prescan.accumulate`` cleared it).

        Only the positions the pairs touch can differ from zero, and ``0 / divisor`` is zero,
        so when the pairs are few against ``out`` (a sixteenth or less) those positions are
        gathered, divided and put back instead of dividing all of ``out``: the same values
        (each element divided once; a repeated position gets its one quotient each time)
        for a pass over the pairs rather than over the bucket. On the CPU, for a bucket the
        compiled selection would take (``select.cpu_kernels``), one compiled loop adds and
        divides (``cpu_kernels.add_average``: the same values)."""
        if not zeroed:
            out.zero_()
        pairs = sum(int(idx.numel()) for idx, _ in self.pieces)
        if self._compiled(out, divisor, pairs):
            select.cpu_kernels(out).add_average(out, self.pieces, divisor)
            return out
        add_pairs(out, self.pieces)
        if divisor == 1:
            return out
        touched = [idx for idx, _ in self.pieces if idx.numel()]
        if not SPARSE_AVERAGE or 16 * pairs > out.numel():
            return out.div_(divisor)
        if touched:
            pos = torch.cat([idx.long() for idx in touched])
            out.index_copy_(0, pos, out.index_select(0, pos).div_(divisor))
        return out

    @staticmethod
    def _compiled(out: torch.Tensor, divisor: int, pairs: int) -> bool:
        """Whether ``write`` takes the compiled sparse average: a large contiguous float32
        CPU bucket (no numba import for small ones), a division, few pairs."""
        sparse = SPARSE_AVERAGE and divisor != 1 and 16 * pairs <= out.numel()
        if not sparse or out.numel() < select.SAMPLED_MIN_NUMEL:
            return False
        if out.dtype != torch.float32 or not out.is_contiguous():
            return False
        return select.cpu_kernels(out) is not None
