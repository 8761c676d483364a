"""Compiled (numba) single-pass selection for the CPU's sampled top-k (issue 19).

The CPU path of a sparse hook reads a bucket's gradient once to form the error-feedback sum
``acc = residual + gradient``; the sampled selection (``select._sampled_topk``) then needs,
per block, a strided sample of ``|acc|`` for its threshold, the positions where ``|acc| >=
threshold`` and their ``|acc|`` for the exact trim. Done as torch operations that is a chain
of passes over tens of MB (``add_``, ``zero_``, ``abs``, a compare, ``nonzero``, or the
grouped scan's ``amax``/``amin`` and its gather) and gathers from memory that has left the
cache, each paying memory traffic and per-element work in a loop of its own. Here one
compiled loop does it per block, 64 elements at a time (vectorised: the sum, the zeroing,
the comparison as a 64-bit mask): the set bits of a mask are written out, as positions and
``|acc|``, into preallocated buffers, and the sample's elements are kept on the way, all
while they are in L1.

The threshold has to be known before that pass, but the selection's exact threshold (the
strided sample's ``rank``-th largest ``|acc|``, ``select._sample_threshold``) is taken when a
block is selected, after the scheme may have changed ``acc``. So the pass uses a lower
*pre-threshold*, from a sparser strided sample of ``residual + gradient`` taken before the
pass, expected to pass ``PRE_MARGIN / SAMPLE_MARGIN`` times as many elements. Between the
pass and a block's selection ``acc`` may change only at positions the scheme *touches*
(``Scan.touch``: spardl's received pairs) or in ranges the driver reports (``Scan.changed``:
an unused parameter's residual held out; the block then takes the torch path). When a block
is selected (``BlockScan.topk_indices``):

1. the kept sample, with its touched elements read anew, is the reference's sample of
   ``|acc|``, so the exact threshold ``t`` is bit for bit the reference's;
2. if ``t`` is at least the pre-threshold ``t0``, every position with ``|acc| >= t`` is a
   candidate of the pass or touched: an untouched value is the one the pass saw, and it
   passed ``t0 <= t``. ``_candidates`` keeps those of the kept candidates (with their kept
   ``|acc|``) and of the touched positions (``|acc|`` read anew) at or above ``t``: the
   positions of the reference's list (``sparse_positions(|acc| >= t)``) and their
   magnitudes (ascending where nothing was touched);
3. the top ``k`` among the candidates are the set the reference's trim (``torch.topk``)
   chooses: ``_top_k`` finds the ``k``-th largest ``|acc|`` by quickselect and keeps the
   candidates at or above it where exactly ``k`` are (the set is then unique); where the
   ``k``-th value is tied with a candidate left out, and where fewer than ``k`` pass, the
   reference's own code decides (``select.trim_candidates``, on the candidates in ascending
   order), so ties are broken alike. The positions' order may differ from ``torch.topk``'s;
   the hooks use the set only (pairs are summed by position, one add per position and
   piece), so their averages and residuals are the reference's bit for bit.

When ``t < t0`` (the sample changed more than the margin allows), the block was selected
before (its values changed), a reported change overlaps it, or the pass's buffer overflowed
(a degenerate input: e.g. a sample of only zeros, whose threshold is the least subnormal),
the block takes the torch path (``select._sampled_topk_grouped`` without maxima): the same
positions, only slower. ``COUNTS`` counts how often each way was taken.

The same selection design serves both devices (``triton_kernels.py`` is the GPU's): a
cheap first look at the magnitudes gives a threshold, one fused pass forms ``acc`` in place
and zeroes the spent gradient, and an exact trim makes the count exactly ``k``. On a GPU the
first look is a sorted stratified sample whose ranks bracket the ``k``-th magnitude (the
exact radix levels where the bracket fails), so nothing needs a host decision; here it is a
strided sample taken before the pass, the pass compacts the candidates into preallocated
buffers, and the count is read (free on a CPU), so the exact threshold can be re-taken at
selection time and the result equals the reference bit for bit.

One core per worker: the kernels release the GIL (``nogil``, so ``async_comm``'s thread and
the backward pass overlap) and never start threads. They are compiled on first use and
cached on disk next to this file (``cache=True``); ``select.cpu_kernels`` imports this
module only then, and falls back to the torch path when numba cannot be imported.
``add_average`` is the same idea for the sparse average (``exchange.PairSum.write``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from zoopick.training.comm import select

PRE_MARGIN = 2.0
"""The pass's pre-threshold expects about ``PRE_MARGIN * k`` candidates per block (the exact
threshold ``select.SAMPLE_MARGIN * k``): room for the sample's noise (``PRE_SAMPLE``) and for
``acc`` to change between the pass and the selection (received pairs raise the exact
threshold, almost never lower it)."""

PRE_SAMPLE = 4096
"""Elements in the pre-threshold's strided sample of ``residual + gradient`` (or every
``select.SAMPLE_STRIDE``-th element where that is fewer): each one costs a cache miss, and
``PRE_MARGIN`` covers its noise (about 2 % of 4096 pass, a relative spread of 11 %)."""


def pre_stride(n: int) -> int:
    """The pre-threshold sample's stride for a block of ``n`` elements."""
    return max(select.SAMPLE_STRIDE, n // PRE_SAMPLE)


COUNTS: Counter[str] = Counter()
"""Selections per way: ``kernel`` (the pass's candidates), ``fallback`` (the torch path; see
the module docstring); ``tied``: of the ``kernel`` ones, those trimmed by ``torch.topk``
because of a tie at the ``k``-th value."""

NAN32 = np.float32("nan")  # a threshold nothing passes (``|x| >= nan`` is false)


def _jit(fn: Callable[..., Any]) -> Any:
    """``numba.njit`` for a kernel: no GIL, no bounds checks, cached on disk; without the
    cache where no cache folder is writable (numba raises then)."""
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(fn)
    except RuntimeError:  # pragma: no cover - a read-only install without a writable home
        return numba.njit(nogil=True, boundscheck=False)(fn)


@intrinsic
def _trailing_zeros(typingctx, word):
    """Index of the lowest set bit of a non-zero uint64 (LLVM's ``cttz``: one instruction)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(i64, [i64, ir.IntType(1)])
        cttz = builder.module.declare_intrinsic("llvm.cttz", [i64], fnty)
        return builder.call(cttz, [args[0], ir.Constant(ir.IntType(1), 1)])

    return sig, codegen


@_jit
def _accumulate(acc, grad, thr, pos, mag, sample, step):  # pragma: no cover - compiled
    """``acc += grad; grad = 0``; the positions where ``|acc| >= thr`` (ascending) into
    ``pos`` and their ``|acc|`` into ``mag``; ``|acc|`` at every ``step``-th position into
    ``sample``. Returns how many pass (past ``pos``'s capacity too: then it overflowed).

    64 elements at a time: the vectorised inner loop sums, zeroes and sets bit ``t`` of a
    mask where element ``t`` passes; the set bits are then written out one by one (about
    2 % of them), and the sample's elements of the word, all while they are in L1. NaN
    never passes (the comparison is false), as in the torch scan."""
    n = acc.shape[0]
    cap = pos.shape[0]
    count = 0
    words = n // 64
    one = np.uint64(1)
    m = sample.shape[0]
    js = 0  # next sample element, at position js * step
    for w in range(words):
        s = w * 64
        mask = np.uint64(0)
        for t in range(64):
            v = acc[s + t] + grad[s + t]
            acc[s + t] = v
            grad[s + t] = 0.0
            mask |= np.uint64(abs(v) >= thr) << np.uint64(t)
        while mask:
            p = s + np.int64(_trailing_zeros(mask))
            if count < cap:
                pos[count] = p
                mag[count] = abs(acc[p])
            count += 1
            mask &= mask - one
        while js < m and js * step < s + 64:
            sample[js] = abs(acc[js * step])
            js += 1
    for i in range(words * 64, n):
        v = acc[i] + grad[i]
        acc[i] = v
        grad[i] = 0.0
        if abs(v) >= thr:
            if count < cap:
                pos[count] = i
                mag[count] = abs(v)
            count += 1
    while js < m:
        sample[js] = abs(acc[js * step])
        js += 1
    return count


@_jit
def _candidates(pos, mag, x, touched, lo, thr, out_pos, out_mag):  # pragma: no cover
    """The positions ``p`` of block ``x`` with ``|x[p]| >= thr``, once each, with their
    ``|x[p]|``, into ``out_pos`` and ``out_mag``; returns their count. They are found among
    the pass's candidates (``pos``, ascending, whose ``|x|`` is still ``mag`` unless
    touched), which come first, in their order, and the ``touched`` bucket positions (any
    order, repeats and other blocks' allowed; the block starts at ``lo``), whose ``|x|`` is
    read anew, after them. A bitmap over the block marks the touched positions. No branch
    on a value in the long loop: it always writes and moves the count where one passes."""
    n = x.shape[0]
    one = np.uint64(1)
    check = touched.shape[0] > 0
    bits = np.zeros((n + 63) // 64 if check else 0, np.uint64)
    for g in touched:
        q = g - lo
        if q >= 0 and q < n:
            bits[q >> 6] |= one << np.uint64(q & 63)
    count = 0
    for i in range(pos.shape[0]):
        p = pos[i]
        keep = mag[i] >= thr
        if check:  # a touched one is taken below, with its value now
            keep = keep and ((bits[p >> 6] >> np.uint64(p & 63)) & one) == 0
        out_pos[count] = p
        out_mag[count] = mag[i]
        count += keep
    for g in touched:
        q = g - lo
        if q >= 0 and q < n and (bits[q >> 6] >> np.uint64(q & 63)) & one:
            bits[q >> 6] &= ~(one << np.uint64(q & 63))  # once each
            v = abs(x[q])
            out_pos[count] = q
            out_mag[count] = v
            count += v >= thr
    return count


@_jit
def _smallest(work, t):  # pragma: no cover - compiled
    """The ``t``-th smallest of ``work`` (0-based; no NaN), found by quickselect (Hoare's
    partition around a median of three); ``work`` is reordered."""
    left, right = 0, work.shape[0] - 1
    while left < right:
        a, b, c = work[left], work[(left + right) >> 1], work[right]
        pivot = max(min(a, b), min(max(a, b), c))  # the median of the three
        i, j = left, right
        while i <= j:
            while work[i] < pivot:
                i += 1
            while work[j] > pivot:
                j -= 1
            if i <= j:
                work[i], work[j] = work[j], work[i]
                i += 1
                j -= 1
        if t <= j:  # [left, j] <= pivot <= [i, right], pivot between
            right = j
        elif t >= i:
            left = i
        else:
            break
    return work[t]


@_jit
def _kth_largest(values, rank):  # pragma: no cover - compiled
    """The ``rank``-th largest of ``values`` (``1 <= rank <= len``), or NaN where one is NaN:
    the value of ``torch.topk(values, rank).values.min()``, for which NaN is the largest."""
    for v in values:
        if v != v:
            return v
    return _smallest(values.copy(), values.shape[0] - rank)


@_jit
def _top_k(pos, mag, k, out):  # pragma: no cover - compiled
    """The positions of the ``k`` largest ``mag`` (``k <= len(mag)``, no NaN), in the order
    of ``pos``, into ``out[:k]`` (``out`` as long as ``pos``); False, with ``out`` undefined,
    when the ``k``-th largest value is tied with one left out (the set is then not unique):
    the ``k``-th largest by quickselect, then the values at or above it, exactly ``k``
    unless ties make the choice ambiguous."""
    n = mag.shape[0]
    kth = _smallest(mag.copy(), n - k)
    above = 0
    for i in range(n):
        above += mag[i] >= kth
    if above != k:
        return False
    count = 0
    for i in range(n):  # no branch on the value
        out[count] = pos[i]
        count += mag[i] >= kth
    return True


@_jit
def _add_average(out, idx, val, divisor):  # pragma: no cover - compiled
    """``out[idx[j]] += val[j]`` in order, then each listed position divided by ``divisor``
    once: the quotients of all are taken before any is stored, so a repeated position gets
    its one quotient each time (``PairSum.write``'s gather, divide, scatter)."""
    m = idx.shape[0]
    for j in range(m):
        out[idx[j]] += val[j]
    quotients = np.empty(m, np.float32)
    for j in range(m):
        quotients[j] = out[idx[j]] / divisor
    for j in range(m):
        out[idx[j]] = quotients[j]


@_jit
def _take(x, idx, seen):  # pragma: no cover - compiled
    """``seen = x[idx]``, then ``x[idx] += -seen`` position by position (``idx`` distinct)."""
    for j in range(idx.shape[0]):
        v = x[idx[j]]
        seen[j] = v
        x[idx[j]] = x[idx[j]] + -v


def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The float32 wire's ``round_to(x.index_select(0, idx))`` and ``x.index_add_(0, idx,
    -seen)`` (``x`` contiguous float32, ``idx`` distinct int64 positions) in one compiled
    loop: the values taken out of the residual, and what the residual keeps (``v - v``: 0,
    or NaN for a non-finite ``v``, as the torch ops give). About a tenth of their time: a
    gather and a scatter of 1 % of a bucket cost two torch kernels and a temporary each."""
    seen = torch.empty(idx.numel(), dtype=torch.float32)
    _take(x.numpy(), idx.numpy(), seen.numpy())
    return seen


def add_average(
    out: torch.Tensor, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], divisor: int
) -> None:
    """``exchange.PairSum.write``'s sparse average into a contiguous float32 ``out``: the
    pieces' values added piece by piece, in order, then the touched positions divided, the
    same sums and quotients as its ``index_add_``, ``index_select``, ``div_`` and
    ``index_copy_`` (about a third of their time: one compiled loop, no temporaries)."""
    live = [(i, v) for i, v in pieces if i.numel()]
    if not live:
        return
    idx = torch.cat([i.to(torch.int64) for i, _ in live])
    val = torch.cat([v.to(torch.float32) for _, v in live])
    _add_average(out.numpy(), idx.numpy(), val.numpy(), np.float32(divisor))


def _f32(value: torch.Tensor | float) -> np.float32:
    return np.float32(value.item() if isinstance(value, torch.Tensor) else value)


def _fallback(x: torch.Tensor, k: int, scratch: torch.Tensor | None) -> torch.Tensor:
    """The torch path of the sampled selection (``x`` read anew), counted."""
    COUNTS["fallback"] += 1
    return select._sampled_topk_grouped(x, k, scratch)


class BlockScan:
    """One block's share of the pass: where it starts, its pre-threshold, its candidates'
    block positions (ascending; None when the buffer overflowed) and ``|acc|`` there, the
    exact threshold's sample (``|acc|`` at every ``select.SAMPLE_STRIDE``-th position), and
    the bucket's touched positions (shared with :class:`Scan`). ``fresh``: nothing but
    touched positions changed since the pass and it was not selected yet."""

    __slots__ = ("lo", "threshold", "positions", "magnitudes", "sample", "touched", "fresh")

    def __init__(
        self,
        lo: int,
        threshold: np.float32,
        positions: torch.Tensor | None,
        magnitudes: torch.Tensor | None,
        sample: torch.Tensor,
        touched: list[torch.Tensor],
    ) -> None:
        self.lo = lo
        self.threshold = threshold
        self.positions = positions
        self.magnitudes = magnitudes
        self.sample = sample
        self.touched = touched
        self.fresh = True

    def topk_indices(
        self, x: torch.Tensor, k: int, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``select._sampled_topk`` of ``|x|`` (``x``: this block of ``acc`` now): the same
        positions (in the reference's order where a tie leaves the choice to its
        ``torch.topk``), from the reference's threshold on the pass's sample and
        candidates, corrected at the touched positions (see the module docstring)."""
        fresh, self.fresh = self.fresh, False  # the caller changes x next: once only
        if not fresh or self.positions is None or self.magnitudes is None:
            return _fallback(x, k, scratch)
        n = x.numel()
        touched = torch.cat(self.touched) if self.touched else torch.empty(0, dtype=torch.int64)
        if touched.numel():  # the sample's touched elements: their values now
            at = touched - self.lo
            step = select.SAMPLE_STRIDE
            at = at[(at >= 0) & (at < n) & (at % step == 0)]
            self.sample.index_copy_(0, at // step, x.index_select(0, at).abs_())
        rank = select.sample_rank(k, self.sample.numel(), n)
        thr = _f32(select._positive(float(_kth_largest(self.sample.numpy(), rank))))
        if not thr >= self.threshold:  # the sample changed more than the margin allows
            return _fallback(x, k, scratch)
        COUNTS["kernel"] += 1
        size = self.positions.numel() + touched.numel()
        cand = torch.empty(size, dtype=torch.int64)
        mags = torch.empty(size, dtype=torch.float32)
        count = _candidates(
            self.positions.numpy(),
            self.magnitudes.numpy(),
            x.numpy(),
            touched.numpy(),
            self.lo,
            thr,
            cand.numpy(),
            mags.numpy(),
        )
        cand, mags = cand[:count], mags[:count]
        if count >= k:  # the top k: one compiled selection where the set is unique
            top = torch.empty(count, dtype=torch.int64)
            if _top_k(cand.numpy(), mags.numpy(), k, top.numpy()):
                return top[:k]
            COUNTS["tied"] += 1
            if touched.numel():  # the reference's candidates are in ascending order
                cand, order = cand.sort()
                mags = mags.index_select(0, order)
        return select.trim_candidates(x, k, cand, scratch, mags)


class Scan:
    """The pass's result for a bucket: per block ``(lo, hi)`` a :class:`BlockScan`. The
    interface of ``prescan.Prescan`` (``peaks``, ``touch``, ``changed``), so the schemes and
    the driver use either."""

    def __init__(self, blocks: dict[tuple[int, int], BlockScan], touched: list[torch.Tensor]):
        self.blocks = blocks
        self.touched = touched

    def peaks(self, lo: int, hi: int) -> BlockScan | None:
        """Block ``[lo, hi)``'s candidates for ``select.topk_indices``, or None."""
        return self.blocks.get((lo, hi))

    def touch(self, idx: torch.Tensor) -> None:
        """Values of ``acc`` at positions ``idx`` changed (received pairs added): their
        values are read anew, and they may be candidates now."""
        if idx.numel():
            self.touched.append(idx.to(torch.int64).contiguous())

    def changed(self, lo: int, hi: int) -> None:
        """Values of ``acc[lo:hi]`` changed otherwise (an unused parameter's residual held
        out): the blocks it overlaps select on the torch path (rare; the same result)."""
        for (b0, b1), block in self.blocks.items():
            if b0 < hi and lo < b1:
                block.fresh = False


def pre_threshold(acc: torch.Tensor, grad: torch.Tensor, k: int) -> np.float32:
    """The pass's threshold for a block (``acc`` and ``grad`` before the sum): the strided
    sample of ``|acc + grad|`` at ``PRE_MARGIN * k`` expected passes, at least the least
    positive float32 (zeros never pass)."""
    step = pre_stride(acc.numel())
    sample = acc[::step].add(grad[::step]).abs_()
    n, m = acc.numel(), sample.numel()
    rank = min(m, max(1, math.ceil(PRE_MARGIN * k * m / n)))
    return _f32(select._positive(float(_kth_largest(sample.numpy(), rank))))


def accumulate(
    acc: torch.Tensor, grad: torch.Tensor, spans: Sequence[tuple[int, int]], density: float
) -> Scan:
    """``acc += grad`` and ``grad.zero_()`` (1-d contiguous float32 tensors of one size,
    ``grad`` spent afterwards) in one compiled pass, with the candidates of every block in
    ``spans`` (disjoint ``(lo, hi)``, each selecting about ``k_for(density, hi - lo)``
    elements) found on the way. The sums are the ones ``acc.add_(grad)`` gives."""
    blocks: dict[tuple[int, int], BlockScan] = {}
    touched: list[torch.Tensor] = []
    no_pos, no_val = np.empty(0, np.int64), np.empty(0, np.float32)
    step = select.SAMPLE_STRIDE
    done = 0

    def add_zero(lo: int, hi: int) -> None:
        _accumulate(acc[lo:hi].numpy(), grad[lo:hi].numpy(), NAN32, no_pos, no_val, no_val, 1)

    for lo, hi in sorted(spans):
        if lo < done or hi > acc.numel():
            raise ValueError(f"spans must be disjoint and inside {acc.numel()}: {sorted(spans)}")
        if done < lo:
            add_zero(done, lo)
        k = select.k_for(density, hi - lo)
        thr = pre_threshold(acc[lo:hi], grad[lo:hi], k)
        cap = 2 * math.ceil(PRE_MARGIN * k) + 1024
        pos = torch.empty(cap, dtype=torch.int64)
        mag = torch.empty(cap, dtype=torch.float32)
        sample = torch.empty(-(-(hi - lo) // step), dtype=torch.float32)
        count = _accumulate(
            acc[lo:hi].numpy(),
            grad[lo:hi].numpy(),
            thr,
            pos.numpy(),
            mag.numpy(),
            sample.numpy(),
            step,
        )
        if count > cap:  # overflowed: the torch path selects
            blocks[(lo, hi)] = BlockScan(lo, thr, None, None, sample, touched)
        else:
            blocks[(lo, hi)] = BlockScan(lo, thr, pos[:count], mag[:count], sample, touched)
        done = hi
    if done < acc.numel():
        add_zero(done, acc.numel())
    return Scan(blocks, touched)
