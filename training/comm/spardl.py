"""``spardl``: SparDL (Zhao et al. 2023) sparse reduce-scatter + all-gather, global residuals.

Per bucket, with ``k = ceil(density * numel)``, the flattened ``acc = gradient + residual`` of a
team of ``t`` workers is cut into ``t`` contiguous blocks; block ``j`` ends up owned by the
worker at team position ``j`` and carries at most ``kb = ceil(k / t)`` (index, value) pairs.

Spar-Reduce-Scatter (SRS)
-------------------------
``spardl_schedule(t)`` lists ``ceil(log2 t)`` rounds of transfers ``src -> dst: [blocks]``.
Before every send the sender re-takes the top-``kb`` of each block's accumulated partial sum,
so a message never carries more than ``kb`` pairs per block however many contributions the
sum already holds. The receiver adds the pairs into its partial sums.

``split="gap"`` (the default) is SparDL's schedule for any ``t``: with ``R = ceil(log2 t)``,
round sizes ``t - 2^(R-1), 2^(R-2), ..., 2, 1`` blocks and the gap between sender and
receiver halving each round, every worker sends exactly one message to one peer and receives
one per round, so the slowest worker makes ``R`` message steps and sends ``t - 1`` blocks for
every ``t`` (see ``_gap_schedule``; ``message_steps`` counts the critical path). P=5, G=4:
round 1 ``i -> i+4: [i+4]``, round 2 ``i -> i+2: [i+2, i+3]``, round 3 ``i -> i+1: [i+1]``
(mod 5).

The older ``split="halving"`` recursively splits a contiguous range of workers (= the range
of blocks they will own) into halves A (first ``ceil(s/2)``) and B. Each
worker of A hands its partial sums for B's blocks to B and vice versa; afterwards A and B
recurse independently. Invariant: for every block of a group, each worker's contribution
lies in exactly one group member's partial sum. A split keeps it if every partial of a block
of the other half goes to exactly one worker of that half; which one is free, so the ``x*y``
(sender, block) cells of a half of size ``x`` sending to a half of size ``y`` are dealt in
row-major order, ``x`` consecutive cells per receiver: cell ``c = p*y + m`` (sender ``p``,
block ``m``) goes to receiver ``c // x``. Equal halves give the classic pairwise recursive
halving; unequal halves (odd sizes) make some workers talk to two peers, but every worker
still receives exactly as many blocks as the other half has workers; for ``t`` not a power of
two that costs more message steps than rounds (P=5: 5 steps in 3 rounds, P=9: 7 in 4). A
worker in a group of size ``s`` whose half has size ``h`` sends ``s - h`` blocks; summed over
the rounds this telescopes to exactly ``t - 1`` blocks sent (and received) per worker.

Worked examples (``src->dst:[blocks]``; after the last round worker j holds block j with one
contribution of every worker):

P=3   round 1: 0->2:[2] 1->2:[2] 2->0:[0] 2->1:[1]   round 2: 0->1:[1] 1->0:[0]
      block 2 at worker 2: own + 0 + 1 in round 1; block 0 at worker 0: own + 2 (round 1)
      + 1's own (round 2); block 1 likewise.
P=5   round 1 ({0,1,2} | {3,4}): 0->3:[3,4] 1->3:[3] 1->4:[4] 2->4:[3,4]
                                 3->0:[0,1] 3->1:[2] 4->1:[0] 4->2:[1,2]
      round 2 ({0,1,2} as P=3 round 1; {3,4} pairwise): 0->2:[2] 1->2:[2] 2->0:[0]
                                 2->1:[1] 3->4:[4] 4->3:[3]
      round 3 ({0,1}): 0->1:[1] 1->0:[0]
P=6   round 1 ({0,1,2} | {3,4,5}, pairwise): 0<->3, 1<->4, 2<->5, three blocks each way
      rounds 2-3: each half runs the P=3 schedule on its own blocks.

``split="pow2"`` instead splits off the largest power of two ``2^(ceil(log2 s)-1)`` first, so
the first round carries the ``s - 2^(ceil(log2 s)-1)`` extra blocks and the remaining rounds
are classic recursive halving (P=5: 0..3->4:[4], 4->j:[j] for j<4, then halving on {0..3});
it sends the same ``t - 1`` blocks per worker but loads the extra workers more in round 1.

Spar-All-Gather with teams
--------------------------
With ``teams=d`` the ``P`` workers form ``d`` teams of ``t = P/d`` consecutive ranks; SRS runs
inside each team on ``t`` blocks (so ``kb = ceil(k / t)``). The ``d`` owners of the same block
(one per team) then trade latency for bandwidth as the paper means it: each takes only the
top-``h`` of its team's partial sum, with ``h`` about ``kb / d``, sends it to the other
owners, and each sums the ``d`` pieces in team order; the merged union is then at most
``d h`` pairs and the owner keeps the top-``kb`` of it (identical on all of them; normally
the whole union). ``h`` starts at ``ceil(kb / d)`` and adapts online from the union size
(overlapping selections make the union smaller than ``d h``; ``h`` grows by
``sqrt(kb / union)`` until the union is near ``kb``, within ``[ceil(kb / d), kb]``). What an
owner did not send stays in its residual. Finally the owners spread their block's ``kb``
pairs (fixed capacity: when the union is smaller, the rest are zero-valued repeats of chosen
positions) to their team by direct messages. Per worker and bucket
this sends ``(t - 1) kb`` pairs in SRS, ``(d - 1) h`` across teams and ``(t - 1) kb`` in the
spread: with ``h = k / P`` about ``k (2P - d - 1) / P`` pairs, ``(d - 1) k / P`` fewer than
one team's ``2 k (P - 1) / P``, in ``log2(t) + 2`` phases instead of ``log2(P)`` plus a
``P``-way all-gather (fewer message steps on latency-bound links). No host sync: the union
is found by sorting the ``d h`` positions (fixed size), and its size, which steers ``h``, is
read one iteration later, when the bucket comes back (``hostread.Deferred``), so ``h``
follows exactly the same sequence as if it were read at once.

Every message carries its indices and values in one packed byte buffer (``pairs.PairCodec``):
one send per peer and round. Pairs take 8 bytes (int32 index, float32 value), 6 with
``fp16=True``, or 4 with ``pairs16="fp16"`` / ``"bf16"``: a 16-bit index relative to the
block start (blocks longer than 65,536 elements carry one int32 count per 65,536-element
chunk) and a 16-bit value, rounded like ``fp16`` with the rounding kept in the residual.

Global residual collection
--------------------------
Each worker works on its own copy ``W`` of ``acc``: a send subtracts exactly what the receiver
will see (fp16 rounding included), a receive adds it, the owner subtracts what it applies, and
in the cross-team step each owner adds back its own piece where the final selection dropped it
(plus, on team 0's owner, the rounding of re-quantising the final values). ``W`` left over is
the residual, so summed over workers: residuals = sum of inputs - applied sum. Nothing is lost
and nothing counted twice.
"""

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist

from zoopick.training.comm import triton_kernels
from zoopick.training.comm.errors import CommError
from zoopick.training.comm.exchange import (
    PairSum,
    add_pairs,
    allgather_parts,
    p2p_exchange,
    round_to,
)
from zoopick.training.comm.hostread import Deferred
from zoopick.training.comm.pairs import PairCodec
from zoopick.training.comm.select import (
    SAMPLED_MIN_NUMEL,
    Blocks,
    block_topk_indices,
    cpu_kernels,
    cpu_shortcut,
    even_bounds,
    k_for,
    topk_indices,
)
from zoopick.training.comm.state import HookState, id_key, named_key, run_hook
from zoopick.training.comm.store import BucketLayout
from zoopick.training.comm_options import SparDLOptions

SPLITS = ("gap", "halving", "pow2")
PAIRS16 = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Transfer:
    """In one round, ``src`` sends its partial sums of ``blocks`` to ``dst``."""

    src: int
    dst: int
    blocks: tuple[int, ...]


def _split_size(size: int, split: str) -> int:
    if split == "halving":
        return (size + 1) // 2
    return 1 << (math.ceil(math.log2(size)) - 1)


def _deal(xlo: int, xhi: int, ylo: int, yhi: int) -> list[Transfer]:
    """Transfers from half [xlo, xhi) of the blocks of half [ylo, yhi) (see module doc)."""
    x, y = xhi - xlo, yhi - ylo
    msgs: dict[tuple[int, int], list[int]] = {}
    for p in range(x):
        for m in range(y):
            msgs.setdefault((xlo + p, ylo + (p * y + m) // x), []).append(ylo + m)
    return [Transfer(s, d, tuple(b)) for (s, d), b in msgs.items()]


def _gap_schedule(P: int) -> tuple[tuple[Transfer, ...], ...]:
    """SparDL's reduce-scatter for any ``P``: ``R = ceil(log2 P)`` rounds, in each of which
    every worker sends one message to one peer (and receives one).

    Worker ``i`` sees block ``(i + o) mod P`` at offset ``o``. Round 1 uses the gap
    ``G = 2^(R-1)``: ``i`` sends its offsets ``G .. P-1`` (``P - G`` blocks) to ``i + G``,
    where they land at offsets ``0 .. P-G-1``. Each later round halves the gap ``g``: ``i``
    sends offsets ``g .. 2g-1`` (``g`` blocks) to ``i + g``. A contribution at offset ``o``
    thus moves by the binary digits of ``o`` and ends at offset 0 of worker ``i + o``, its
    block's owner, exactly once. Round sizes ``P - 2^(R-1), 2^(R-2), ..., 2, 1`` sum to
    ``P - 1`` blocks per worker (the time-reverse of Bruck's all-gather)."""
    if P == 1:
        return ()
    R = math.ceil(math.log2(P))
    rounds: list[tuple[Transfer, ...]] = []
    span = P
    g = 1 << (R - 1)
    while g >= 1:
        rounds.append(
            tuple(
                Transfer(i, (i + g) % P, tuple((i + o) % P for o in range(g, span)))
                for i in range(P)
            )
        )
        span, g = g, g // 2
    return tuple(rounds)


@lru_cache(maxsize=64)
def spardl_schedule(P: int, split: str = "gap") -> tuple[tuple[Transfer, ...], ...]:
    """The Spar-Reduce-Scatter rounds for ``P`` workers (block j ends at worker j)."""
    if P < 1:
        raise CommError(f"spardl: need at least one worker, got {P}")
    if split not in SPLITS:
        raise CommError(f"spardl: split must be one of {SPLITS}, got {split!r}")
    if split == "gap":
        return _gap_schedule(P)
    rounds: list[tuple[Transfer, ...]] = []
    groups = [(0, P)]
    while any(hi - lo > 1 for lo, hi in groups):
        transfers: list[Transfer] = []
        nxt: list[tuple[int, int]] = []
        for lo, hi in groups:
            if hi - lo == 1:
                nxt.append((lo, hi))
                continue
            mid = lo + _split_size(hi - lo, split)
            transfers += _deal(lo, mid, mid, hi) + _deal(mid, hi, lo, mid)
            nxt += [(lo, mid), (mid, hi)]
        rounds.append(tuple(transfers))
        groups = nxt
    return tuple(rounds)


def simulate_schedule(
    P: int, rounds: tuple[tuple[Transfer, ...], ...]
) -> list[dict[int, Counter[int]]]:
    """Play ``rounds`` on contributor multisets: ``out[w][j]`` counts, for each worker, how
    many times each worker's contribution to block j sits in w's partial sum at the end.

    Sends of a round use the holdings at the start of the round (a worker cannot forward
    what it receives in the same round). Raises ``CommError`` if a worker sends a block it
    does not hold."""
    hold: list[dict[int, Counter[int]]] = [{j: Counter({w: 1}) for j in range(P)} for w in range(P)]
    for i, rnd in enumerate(rounds):
        outgoing: list[tuple[int, int, Counter[int]]] = []
        for tr in rnd:
            for j in tr.blocks:
                if j not in hold[tr.src]:
                    raise CommError(f"round {i}: worker {tr.src} sends block {j} it lacks")
                outgoing.append((tr.dst, j, hold[tr.src].pop(j)))
        for dst, j, contrib in outgoing:
            hold[dst].setdefault(j, Counter()).update(contrib)
    return hold


def message_steps(rounds: tuple[tuple[Transfer, ...], ...]) -> int:
    """Message steps on the critical path: per round, the most messages any one worker sends
    or receives (a worker handles its messages one after another), summed over the rounds."""
    total = 0
    for rnd in rounds:
        out = Counter(tr.src for tr in rnd)
        inc = Counter(tr.dst for tr in rnd)
        total += max([*out.values(), *inc.values()], default=0)
    return total


class SparDLState(HookState):
    name = "spardl"

    def __init__(
        self, options: SparDLOptions, process_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(options, process_group)
        self.teams = options.teams
        self.split = options.split
        self.pairs16 = options.pairs16
        if self.pairs16 is not None:
            self.codec = PairCodec(PAIRS16[self.pairs16], index16=True)
        else:
            self.codec = PairCodec(torch.float16 if self.fp16 else torch.float32)
        self.shares: dict[tuple[int, ...], int] = {}  # cross-team share h per bucket
        # (bucket numel, team size, message blocks, device) -> Blocks, for batched selection
        self.blocks: dict[tuple[Any, ...], Blocks] = {}
        # per bucket: (union size of the last iteration, its h, kbq, d), read when it returns
        self.unions: dict[tuple[int, ...], tuple[Deferred, int, int, int]] = {}

    def graphable(self) -> bool:
        """One team only: with teams the cross-team share adapts on the host."""
        return self.teams == 1

    def device_buffers(self) -> list[Any]:
        """The scratch buffers and the batched selection's block tables."""
        return super().device_buffers() + list(self.blocks.values())

    def scan_spans(self, numel: int, density: float) -> list[tuple[int, int]] | None:
        """Every team block long enough for the CPU's sampled selection (``take``)."""
        t = self.size // self.teams
        if self.size % self.teams or 8 * k_for(density, numel) > numel:
            return []
        bounds = even_bounds(numel, t)
        return [
            (bounds[j], bounds[j + 1])
            for j in range(t)
            if bounds[j + 1] - bounds[j] >= SAMPLED_MIN_NUMEL
        ]

    def reset_state(self) -> None:
        super().reset_state()
        self.shares.clear()
        self.unions.clear()

    def settle(self) -> None:
        for key in list(self.unions):
            _adapt_pending(self, key)

    def scheme_state(self, names: dict[int, str]) -> dict[Any, Any]:
        """The adapted cross-team shares per bucket."""
        return {named_key(key, names): int(h) for key, h in self.shares.items()}

    def load_scheme_state(self, params: dict[str, torch.Tensor], blob: dict[Any, Any]) -> None:
        self.shares = {id_key(named, params): int(h) for named, h in blob.items()}


def _share(state: "SparDLState", key: tuple[int, ...], kbq: int, d: int) -> int:
    """The cross-team share ``h`` an owner sends for its block (see the module docstring)."""
    return state.shares.get(key, min(kbq, math.ceil(kbq / d)))


def _adapt_share(state: "SparDLState", key, h: int, union: int, kbq: int, d: int) -> None:
    """Next ``h``: scaled by ``sqrt(kbq / union)`` (damped) toward a merged union of ``kbq``
    pairs, within ``[ceil(kbq / d), kbq]``. Every owner of the block sees the same union, so
    all of them keep the same ``h`` without exchanging it."""
    scaled = round(h * math.sqrt(kbq / max(union, 1)))
    state.shares[key] = max(min(kbq, math.ceil(kbq / d)), min(kbq, scaled))


def _merge(
    pos: torch.Tensor, block_sum: torch.Tensor, kbq: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The owner's final selection from the ``d`` pieces' positions ``pos`` (block-relative,
    with repeats where pieces overlap): ``(positions[cap], valid[cap], union size)``, with
    ``cap = min(kbq, len(pos))``, the top-``kbq`` of the merged union by ``|block_sum|``
    (all of it when it is smaller). Fixed sizes, nothing read on the host: the positions
    are sorted, repeats marked invalid (they become zero-valued pairs at a position already
    chosen) and ranked below every real entry."""
    spos, _ = torch.sort(pos)
    first = torch.ones_like(spos, dtype=torch.bool)
    first[1:] = spos[1:] != spos[:-1]
    union = torch.count_nonzero(first)
    cap = min(kbq, spos.numel())
    if cap == spos.numel():
        return spos, first, union
    score = torch.where(first, block_sum[spos].abs(), torch.full_like(block_sum[spos], -1.0))
    top = torch.topk(score, cap, sorted=False).indices
    return spos[top], first[top], union


def _adapt_pending(state: "SparDLState", key: tuple[int, ...]) -> None:
    """Adapt ``h`` from the union size of this bucket's previous iteration (deferred)."""
    pending = state.unions.pop(key, None)
    if pending is not None:
        union, h, kbq, d = pending
        _adapt_share(state, key, h, int(union.get()), kbq, d)


class _Bucket:
    """One bucket's exchange on this worker: its team's blocks, ``W`` (this worker's copy of
    ``acc``, its residual when the exchange ends) and the selection steps that take pairs out
    of ``W`` for a message (see the module docstring's global residual collection)."""

    def __init__(self, state: SparDLState, acc: torch.Tensor, density: float) -> None:
        self.state, self.acc = state, acc
        self.t = t = state.size // state.teams
        self.team, self.q = divmod(state.rank, t)
        self.base = self.team * t  # group rank of team position 0
        self.n = n = acc.numel()
        self.k = k = k_for(density, n)
        self.bounds = bounds = even_bounds(n, t)
        kb = math.ceil(k / t) if k else 0
        self.kbs = [min(kb, bounds[j + 1] - bounds[j]) for j in range(t)]
        self.codec = state.codec
        self.stats = state.stats
        self.W = acc  # becomes this worker's residual
        # momentum factor masking is the only reader of the sent positions
        self.sent = (
            torch.zeros(n, dtype=torch.bool, device=acc.device) if state.momentum > 0 else None
        )

    def extent(self, j: int, count: int | None = None) -> tuple[int, int, int]:
        """(pairs, first element, length) of block j, for the codec."""
        bounds = self.bounds
        return (self.kbs[j] if count is None else count), bounds[j], bounds[j + 1] - bounds[j]

    def size(self, j: int, count: int | None = None) -> int:
        """Bytes of block j's pairs on the wire."""
        pairs, _, length = self.extent(j, count)
        return self.codec.nbytes(pairs, length)

    def take_fused(self, js: tuple[int, ...], count: int) -> list[tuple[torch.Tensor, ...]]:
        """``take`` of blocks ``js`` at once by the Triton kernels (CUDA with
        ``select.cuda_triton()``): one selection whose last pass also rounds the values and
        takes them out of W; a single block starts from the first radix level that the
        error-feedback pass took (``triton_kernels.Scan``)."""
        W, bounds = self.W, self.bounds
        with self.stats.timer("select_s"):
            starts = [bounds[j] for j in js]
            lengths = [bounds[j + 1] - bounds[j] for j in js]
            scan = self.state.prescan
            hist = None
            if len(js) == 1 and isinstance(scan, triton_kernels.Scan):
                hist = scan.histogram(starts[0], starts[0] + lengths[0])
            where = triton_kernels.blocks(starts, lengths, W.device)
            idx, payload = triton_kernels.take_topk(W, where, count, self.codec.value_dtype, hist)
            if self.sent is not None:
                self.sent.index_fill_(0, idx.flatten(), True)
        return [(i, v, v.float()) for i, v in zip(idx.unbind(0), payload.unbind(0), strict=True)]

    def take(
        self, j: int, cap: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove the top-``cap`` (default kb) pairs of block j from W: (positions, payload,
        value seen)."""
        W, state = self.W, self.state
        lo, hi = self.bounds[j], self.bounds[j + 1]
        if triton_kernels.applies(W):
            i, v, seen = self.take_fused((j,), self.kbs[j] if cap is None else cap)[0]
            return i, v, seen
        with self.stats.timer("select_s"):
            scratch = state.scratch(self.acc.device, hi - lo)
            peaks = None if state.prescan is None else state.prescan.peaks(lo, hi)
            count = self.kbs[j] if cap is None else cap
            idx = topk_indices(W[lo:hi], count, scratch=scratch, peaks=peaks) + lo
            kernels = cpu_kernels(W) if self.codec.value_dtype == torch.float32 else None
            if kernels is not None:  # the same values and residual, one compiled loop
                payload = seen = kernels.take(W, idx)
            else:
                payload, seen = round_to(W.index_select(0, idx), self.codec.value_dtype)
                W.index_add_(0, idx, -seen)
            if self.sent is not None:
                self.sent.index_fill_(0, idx, True)
        return idx, payload, seen

    def take_message(self, blocks: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``take(j)`` for every block of one message: (positions, payload) per block. Off
        the CPU shortcut, one batched ``topk`` over the blocks (``block_topk_indices``) when
        they keep the same count; on the CPU, block by block (the sampled selection there
        costs a sixth of a ``topk``)."""
        W, bounds, kbs = self.W, self.bounds, self.kbs
        kmsg = kbs[blocks[0]]
        lengths = [bounds[j + 1] - bounds[j] for j in blocks]
        uneven = any(kbs[j] != kmsg for j in blocks) or kmsg > min(lengths)
        if len(blocks) == 1 or cpu_shortcut(W) or uneven:
            return [self.take(j)[:2] for j in blocks]
        if triton_kernels.applies(W):
            return [(i, v) for i, v, _ in self.take_fused(blocks, kmsg)]
        with self.stats.timer("select_s"):
            key = (self.n, self.t, blocks, self.acc.device)
            spec = self.state.blocks.get(key)
            if spec is None:
                spec = self.state.blocks[key] = Blocks.of(
                    [bounds[j] for j in blocks], lengths, self.acc.device
                )
            idx = block_topk_indices(W, spec, kmsg)
            payload, seen = round_to(W[idx], self.codec.value_dtype)
            flat = idx.flatten()
            W.index_add_(0, flat, -seen.flatten())
            if self.sent is not None:
                self.sent.index_fill_(0, flat, True)
        return list(zip(idx.unbind(0), payload.unbind(0), strict=True))

    def pack(self, j: int, idx: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        return self.codec.pack(idx, payload, self.bounds[j], self.bounds[j + 1] - self.bounds[j])


def _reduce_scatter(b: _Bucket) -> None:
    """Spar-Reduce-Scatter inside the team: one packed message per peer and round; afterwards
    this worker's W holds its team's partial sum of the block it owns."""
    state, q, base = b.state, b.q, b.base
    for rnd in spardl_schedule(b.t, state.split):
        sends, recvs, layouts = [], [], []
        for tr in rnd:
            if tr.src == q:
                picked = b.take_message(tr.blocks)
                buf = torch.cat([b.pack(j, *p) for j, p in zip(tr.blocks, picked, strict=True)])
                sends.append((base + tr.dst, [buf]))
            if tr.dst == q:
                length = sum(b.size(j) for j in tr.blocks)
                recvs.append((base + tr.src, [(length, torch.uint8)]))
                layouts.append([b.extent(j) for j in tr.blocks])
        if sends or recvs:
            got = p2p_exchange(state, sends, recvs)
            received = [
                pair
                for g, lay in zip(got, layouts, strict=True)
                for pair in b.codec.split(g[0], lay)
            ]
            add_pairs(b.W, received)
            if state.prescan is not None:  # those values may have grown: rescan them
                for idx, _ in received:
                    state.prescan.touch(idx)


def _merge_teams(b: _Bucket, key: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The owned block's final pairs with teams (d > 1): each owner sends the top-``h`` of its
    team's sum to the other teams' owners, all sum the ``d`` pieces in team order and keep the
    top-``kb`` of the union; what an owner's piece lost goes back into its W."""
    state, W, q, team, t, k, n = b.state, b.W, b.q, b.team, b.t, b.k, b.n
    d, codec, bounds = state.teams, b.codec, b.bounds
    lo = bounds[q]
    kbq = b.kbs[q]
    h = kbq if k >= n else _share(state, key, kbq, d)
    own_idx, own_payload, own_seen = b.take(q, h)
    peers = [s * t + q for s in range(d) if s != team]
    got = p2p_exchange(
        state,
        [(peer, [b.pack(q, own_idx, own_payload)]) for peer in peers],
        [(peer, [(b.size(q, h), torch.uint8)]) for peer in peers],
    )
    pieces = [codec.unpack(g[0], *b.extent(q, h)) for g in got]
    pieces.insert(team, (own_idx, own_payload))  # team order: same sum on every owner
    with b.stats.timer("select_s"):
        block_sum = torch.zeros(bounds[q + 1] - lo, device=b.acc.device)
        add_pairs(block_sum, [(i.long() - lo, v) for i, v in pieces])
        fin, fin_valid, union = _merge(
            torch.cat([i.long() for i, _ in pieces]) - lo, block_sum, kbq
        )
        if k < n:  # read (and h adapted) when this bucket comes back: no host sync
            state.unions[key] = (Deferred(union), h, kbq, d)
        kept = torch.zeros_like(block_sum).index_add_(0, fin, fin_valid.float()) > 0
        dropped = ~kept[own_idx - lo]
        W.index_add_(0, own_idx, own_seen * dropped)
        vals = block_sum[fin] * fin_valid
        fin_payload, fin_seen = round_to(vals, codec.value_dtype)
        if team == 0 and codec.value_dtype != torch.float32:
            W.index_add_(0, fin + lo, vals - fin_seen)
    return fin + lo, fin_payload


def _spread(
    b: _Bucket, final: tuple[torch.Tensor, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every block's final pairs, in block order: this worker's ``final`` sent to its team
    (everyone, when there is one team) and theirs received."""
    state, q, t, codec = b.state, b.q, b.t, b.codec
    mine = b.pack(q, *final)
    if state.teams == 1:
        sizes = [[b.size(j)] for j in range(t)]
        gathered = allgather_parts(state, [mine], sizes)
        return [codec.unpack(g[0], *b.extent(j)) for j, g in enumerate(gathered)]
    mates = [j for j in range(t) if j != q]
    got = p2p_exchange(
        state,
        [(b.base + j, [mine]) for j in mates],
        [(b.base + j, [(b.size(j), torch.uint8)]) for j in mates],
    )
    blocks = [codec.unpack(g[0], *b.extent(j)) for j, g in zip(mates, got, strict=True)]
    blocks.insert(q, final)
    return blocks


def _exchange(state: SparDLState, layout: BucketLayout, acc: torch.Tensor, density: float):
    """SparDL's three steps on one bucket (see the module docstring): the sum is a
    ``PairSum`` of every block's final pairs, W what stays behind."""
    P, d = state.size, state.teams
    if P % d:
        raise CommError(f"spardl: teams={d} does not divide the {P} workers")
    _adapt_pending(state, layout.key)
    b = _Bucket(state, acc, density)
    _reduce_scatter(b)
    final = _merge_teams(b, layout.key) if d > 1 else b.take(b.q)[:2]
    blocks = _spread(b, final)
    state.stats.add(nnz=sum(int(i.numel()) for i, _ in blocks))
    return PairSum(blocks), b.W, b.sent


def spardl_hook(state: SparDLState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """SparDL sparse reduce-scatter + (team) all-gather with global residual collection."""
    return run_hook(state, bucket, _exchange)
