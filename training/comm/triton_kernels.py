"""Fused selection for the sparse hooks on a GPU (issue 19): Triton kernels, no sort.

Why: on an H100 the plain device path (``torch.topk`` over a whole bucket, GaussianK's chain
of ``count_nonzero`` passes and ``where`` steps, packing by separate ops) made spardl and
gaussiank add about 14 ms to a 26 ms ResNet-50 iteration (``benchmarks/results/gpu_logs/
comm_gpu_session9.md``), against well under a millisecond of memory traffic for what they
must read. Measured since (``benchmarks/comm/README.md``, issue 19): these kernels cut the
launches but are slower than ``torch.topk`` for spardl, and the iteration is host-bound, so
they stay off by default.

These kernels do the same selections in a few passes over the bucket and a handful of
launches, with nothing read on the host (fixed-capacity outputs and device-side counts, as
``select.capped_indices``).

The design is the CPU kernels' (``cpu_kernels.py``): a cheap first look at the magnitudes
gives a threshold, one fused pass does the error feedback, and an exact trim makes the
count exactly ``k``:

* **The bracket** (spardl's top-k, :data:`BRACKET`; since session 18). The keys of a
  stratified sample of each block (:func:`bracket_plan`) give a band ``[lo, hi]`` that holds
  the k-th largest key ``T`` with six-sigma odds; one pass over the block (``_band``)
  counts the keys above ``hi`` and copies the keys inside the band (about 1 % of the
  block at 1 % density) into a buffer, and sorting that small buffer gives ``T`` and the
  ties at it exactly. No histogram is taken. Where the sample misled or the band
  overflowed (many equal keys), nothing is decided on the host: that block's state stays
  open and the radix levels below select it (their launches return at once for the
  others). Why: run E's profile put 2.8 ms of the fused top-k's 3.25 ms in the radix
  levels' 2,048-bin histogram passes (``_scan``), against about 0.2 ms for the same
  passes without a histogram (GaussianK's).
* **Keys.** ``|x|``'s float32 bits read as an int32 (sign cleared) order like ``|x|``, with
  NaN above +inf (as ``torch.topk`` ranks it). The k-th largest key is found by a radix
  select of three levels: a histogram of bits 30..20 (2,048 bins: exponent and three
  mantissa bits), then of bits 19..9 among the keys of the bin where the k-th lies, then
  of bits 8..0. Each level is one read of the block, all blocks of a message in one launch
  (grid: programs x blocks); a per-block ``pick`` (one small program) finds the bin and the
  count still wanted. A level whose boundary bin is taken whole ends the search early and
  the later launches return at once.
* **Error feedback fused.** ``accumulate`` forms ``acc += grad`` (and zeroes the spent
  gradient, as ``prescan.accumulate`` does on the CPU) in the pass that takes GaussianK's
  moments, or, with the radix levels alone, the first level's histogram of every top-k
  block: the first look costs no pass of its own (the bracket's is a sample).
* **Exact trim and packing.** With the k-th key ``T`` known, a counting pass gives each
  program its number of keys above ``T`` and equal to ``T``; a cumulative sum over the
  programs (one ``torch.cumsum``) gives each its output offset, and the writing pass
  stores, in position order, every key above ``T`` and the first ties at ``T`` until
  exactly ``k`` are out: (position, wire value) pairs, the value already rounded to the
  codec's type (float32, float16 clamped to its range, or bfloat16 rounded to nearest
  even, as ``exchange.round_to``), and the residual updated in place (``x -= seen``), which
  the plain path does with a gather, a rounding and an ``index_add_``.
* **GaussianK** (``take_gaussiank``): the moments from the fused pass give the threshold;
  one pass counts ``|x| >= t`` for every threshold the refinement could visit (a tree of
  ``2^(refine + 1) - 1``, so ``refine <= MAX_REFINE``), and one small program walks the
  refinement on those counts. When the passing count fits the capacity (the usual case)
  every passing element is taken and the radix levels return at once, and so does the
  count pass: each program of the counting pass kept its own counts (it reads what a
  program of the write does), and the walk hands the write the chosen threshold's;
  otherwise the capacity's largest are taken exactly.

Reads of a bucket after the error-feedback pass: spardl's block, two when the bracket
holds (band, write: the band pass counts for the write, ``_tally``; four with the radix
levels: two levels, count, write); GaussianK, two in the usual case (threshold counts,
write: the threshold counting pass counts for the write at every candidate threshold, and
the walk hands over the chosen one's). About fifteen launches a selection besides the
bracket's two sorts, none of them waiting on the host.

Ties: the selected set is the ``k`` largest ``|x|``; among elements equal to the k-th
largest, those at the lowest positions. ``torch.topk`` (the plain path) takes an
unspecified subset of such ties, so the two paths select the same set whenever the k-th
largest magnitude is not tied.

Triton is imported only when a kernel is first needed (``_kernels``): with the flag off, or
without CUDA, nothing imports it. Under Triton's interpreter (``TRITON_INTERPRET=1``) the
same kernels run on CPU tensors, which is how the tests check them without a GPU
(``applies``); a process runs Triton in one mode, fixed when it first imports
``triton.language``. ``compile_variants`` builds every kernel for an sm_90 target without a
GPU. The tile sizes (``TILE``, ``TILES``, ``COUNT_TILE``) change no result: tests and the
benchmark's dry run set them for the interpreter's speed.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from zoopick.training.comm import select

TILE = 1024
"""Elements a program handles at once."""

TILES = 4
"""Tiles per program (a program covers ``TILE * TILES`` elements of a block)."""

BINS = 2048
"""Width of a histogram row (the third level uses its first 512 bins)."""

LEVELS = (2048, 2048, 512)
"""Bins of the radix levels: key bits 30..20, 19..9 and 8..0."""

KEY_MAX = 0x7FFFFFFF
INF_KEY = 0x7F800000  # the key of +inf; NaN keys lie above it

BRACKET = True
"""Top-k: find the k-th largest key from a sample's bracket and the few keys inside it
(:func:`_bracket`), the radix levels over the whole block only where the bracket missed.
False: the radix levels always (the design measured in runs D and E)."""

SAMPLE = 32768
"""Keys sampled per block for the bracket (all of a shorter block). About
``(12 n sqrt(k / n)) ** (2 / 3)`` minimises the keys sorted (sample plus band); 32k suits
DDP's 25 MB buckets at densities near 1 %."""

MARGIN = 6.0
"""Half-width of the bracket in binomial standard deviations of the sample's count above
the k-th largest key: a miss (the fallback) is a six-sigma event for a sample that
represents the block."""

TIE_STEP = 1024
"""Keys tied at ``T`` that ``_settle`` counts at once (more ties take more steps)."""

MAX_REFINE = 4
"""GaussianK refinements the fused path follows (the counts of its ``2^(r+1) - 1``
candidate thresholds are taken in one pass); more falls back to the plain path."""

NODES = 32  # candidate thresholds, padded to a power of two
COUNT_TILE = 256  # elements per step of the threshold counting (NODES counters each)
STATE = 5  # per block: prefix, still wanted (ties once done), done, T, count taken
COUNTED = -1
"""The prefix of a block whose per-program counts for the write are placed already (by the
bracket's band pass and ``_tally``, or GaussianK's walk): the count pass skips it."""
VALUE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
TINY = select.TINY


@functools.cache
def available() -> bool:
    """Whether triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def applies(x: torch.Tensor) -> bool:
    """Whether a hook selects from ``x`` with these kernels: ``select.cuda_triton()`` on, off
    the CPU shortcuts, and ``x`` on CUDA, or on the CPU under the interpreter (tests)."""
    if not select.cuda_triton() or select.cpu_shortcut(x) or x.dtype != torch.float32:
        return False
    if x.device.type == "cuda" or (x.device.type == "cpu" and interpreting()):
        return available()
    return False


@dataclass(frozen=True)
class Spans:
    """Blocks ``[start, start + length)`` of a flat tensor, on the device (built once per
    layout: the copies from the host are made when the layout is first seen)."""

    starts: torch.Tensor  # int64
    lengths: torch.Tensor  # int64
    bounds: torch.Tensor  # int32 (lowest, highest) key taken per block
    sizes: tuple[int, ...]  # the lengths on the host

    @property
    def longest(self) -> int:
        return max(self.sizes)

    @property
    def count(self) -> int:
        return len(self.sizes)

    def programs(self) -> int:
        """Programs per block (grid axis 0)."""
        return max(1, math.ceil(self.longest / (TILE * TILES)))


@functools.lru_cache(maxsize=256)
def spans(
    starts: tuple[int, ...], lengths: tuple[int, ...], device: torch.device, keyed: tuple[bool, ...]
) -> Spans:
    """The :class:`Spans` of blocks; ``keyed[i]`` false gives block i no eligible key (a
    histogram of nothing: the gaps of :func:`accumulate`)."""
    bounds = [(0, KEY_MAX) if on else (1, 0) for on in keyed]
    return Spans(
        torch.tensor(starts, dtype=torch.int64, device=device),
        torch.tensor(lengths, dtype=torch.int64, device=device),
        torch.tensor(bounds, dtype=torch.int32, device=device),
        lengths,
    )


def blocks(starts: Sequence[int], lengths: Sequence[int], device: torch.device) -> Spans:
    """:class:`Spans` of blocks whose every element may be selected (the top-k of each)."""
    return _hold(spans(tuple(starts), tuple(lengths), device, (True,) * len(starts)))


_held = threading.local()


@contextmanager
def holding() -> Iterator[list[Any]]:
    """Collect the cached device tables (:class:`Spans`, :class:`BracketPlan`) that the
    kernels launched inside read. A CUDA graph captured inside reads them at every replay,
    by address, while their caches are bounded (least recently used first out, and a
    replay uses no cache): the graph's owner keeps what this yields alive."""
    outer = getattr(_held, "tables", None)
    tables: list[Any] = []
    _held.tables = tables
    try:
        yield tables
    finally:
        _held.tables = outer


def _hold(table: Any) -> Any:
    tables = getattr(_held, "tables", None)
    if tables is not None:
        tables.append(table)
    return table


class Scan:
    """What the fused error-feedback pass saw: per span ``(lo, hi)`` the first radix level's
    histogram of ``acc[lo:hi]``, and the moments of the whole bucket (per program: count,
    mean, sum of squared deviations). Each histogram is used once (the selection changes
    its block); :meth:`touch` (values changed elsewhere, e.g. received pairs) drops all."""

    def __init__(self, hists: dict[tuple[int, int], torch.Tensor], moments: torch.Tensor | None):
        self.hists = hists
        self.moments = moments

    def histogram(self, lo: int, hi: int) -> torch.Tensor | None:
        return self.hists.pop((lo, hi), None)

    def touch(self, idx: torch.Tensor | None = None) -> None:
        self.hists.clear()
        self.moments = None

    def changed(self, lo: int, hi: int) -> None:
        """``acc[lo:hi]`` changed after the pass (a held-out parameter): drop what it saw."""
        self.touch()

    def peaks(self, lo: int, hi: int) -> None:
        """No column maxima (those serve the CPU's grouped scan): a hook that is not wired
        to these kernels (``topk``) selects on its plain device path."""
        return None


def accumulate(
    acc: torch.Tensor, grad: torch.Tensor, span_list: Sequence[tuple[int, int]], keep: bool = True
) -> Scan:
    """``acc += grad`` and ``grad.zero_()`` (1-d float32 of one size) in one pass that also
    takes the first radix level of every span in ``span_list`` (disjoint ``(lo, hi)``: the
    top-k blocks; not with :data:`BRACKET`, which needs none), or without spans the
    bucket's moments (GaussianK's threshold).
    ``keep=False``: the caller will change ``acc`` before selecting (held-out parameters),
    so neither is kept."""
    n = acc.numel()
    cuts: list[tuple[int, int, bool]] = []
    done = 0
    for lo, hi in sorted(span_list):
        if lo < done or hi > n:
            raise ValueError(f"spans must be disjoint and inside {n}: {sorted(span_list)}")
        if lo > done:
            cuts.append((done, lo - done, False))
        cuts.append((lo, hi - lo, keep))
        done = hi
    if done < n or not cuts:
        cuts.append((done, n - done, False))
    sp = _hold(
        spans(
            tuple(c[0] for c in cuts),
            tuple(c[1] for c in cuts),
            acc.device,
            tuple(c[2] for c in cuts),
        )
    )
    level = 1 if keep and span_list and not BRACKET else 0  # the bracket needs no histogram
    with_moments = keep and not span_list
    hist = torch.zeros(sp.count if level else 1, BINS, dtype=torch.int32, device=acc.device)
    parts = sp.count * sp.programs() if with_moments else 1
    moments = torch.empty(parts, 3, dtype=torch.float32, device=acc.device)
    _kernels().scan[(sp.programs(), sp.count)](
        acc, grad, sp.starts, sp.lengths, sp.bounds, sp.starts, hist, moments, sp.programs(),
        LEVEL=level, ACCUMULATE=True, MOMENTS=with_moments, NBINS=BINS, TILE=TILE, TILES=TILES,
    )  # fmt: skip
    rows = {(s, s + length): hist[i] for i, (s, length, on) in enumerate(cuts) if on and level}
    return Scan(rows, moments if with_moments else None)


def take_topk(
    x: torch.Tensor,
    where: Spans,
    k: int,
    value_dtype: torch.dtype = torch.float32,
    hist1: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest ``|x|`` of every block, taken out of ``x``: ``(positions, payload)``,
    each ``(blocks, k)``; positions absolute and ascending per block, payload the values
    rounded to ``value_dtype``, and ``x`` there reduced by what the payload carries (the
    residual of error feedback). ``k`` must not exceed the shortest block. ``hist1``: the
    first level's histogram of the only block, from :func:`accumulate`."""
    if hist1 is not None and where.count != 1:
        raise ValueError("a ready first-level histogram serves a single block")
    if k == 0:
        empty = torch.empty(where.count, 0, device=x.device)
        return empty.long(), empty.to(value_dtype)
    state = torch.zeros(where.count, STATE, dtype=torch.int64, device=x.device)
    counts = None
    if BRACKET and hist1 is None:
        counts, _ = _bracket(x, where, k, state)
    positions, payload = _take(x, where, where.bounds, state, k, value_dtype, hist1, None, counts)
    return positions, payload


@dataclass(frozen=True)
class BracketPlan:
    """Per block, where the bracket's sample is read and which of its ranks bound the band
    (built on the host once per block lengths and ``k``; see :func:`_bracket`)."""

    positions: torch.Tensor  # (blocks, S) int32, from the block's start; past ``sampled`` 0
    sampled: torch.Tensor  # (blocks,) int32: keys sampled (all of a block shorter than S)
    upper: torch.Tensor  # (blocks,) int32: rank (descending) of the band's top; -1: KEY_MAX
    lower: torch.Tensor  # (blocks,) int32: rank of the band's bottom; -1: key 0
    capacity: int  # band keys kept per block

    @property
    def width(self) -> int:
        return self.positions.shape[1]


@functools.lru_cache(maxsize=64)
def bracket_plan(lengths: tuple[int, ...], k: int, device: torch.device) -> BracketPlan:
    """The :class:`BracketPlan` of blocks of ``lengths`` for the ``k`` largest (positions
    from each block's start, so layouts of the same block lengths share one).

    The sample is stratified (one position drawn uniformly in each of ``s`` equal strata of
    the block, a fixed seed): every part of a bucket (every layer) is represented in
    proportion, and no period of the layout can alias with it as a fixed stride could. The
    count of sampled keys at or above the k-th largest ``T`` is a sum of independent
    Bernoullis with mean about ``c = k s / n`` and a variance at most the binomial's
    (stratification only narrows it), whatever the values, so the sample's keys at ranks
    ``c - m`` and ``c + m`` (``m``: :data:`MARGIN` standard deviations) bracket ``T`` unless
    ties blur the ranks; the band between them holds about ``2 m n / s`` keys, and twice
    that (and 64) is kept."""
    gen = torch.Generator().manual_seed(0x5A17)
    width = min(SAMPLE, max(lengths))
    rows, sampled, upper, lower, caps = [], [], [], [], []
    for n in lengths:
        s = min(SAMPLE, n)
        if s == n:
            pos = torch.arange(n, dtype=torch.int64)
        else:
            strata = torch.arange(s, dtype=torch.float64) + torch.rand(s, generator=gen).double()
            pos = (strata * (n / s)).long().clamp_(max=n - 1)
        rows.append(torch.cat([pos, torch.zeros(width - s, dtype=torch.int64)]).int())
        sampled.append(s)
        c = k * s / n
        m = MARGIN * math.sqrt(c * (1.0 - k / n)) + 1.0
        hi_rank = math.floor(c - m) - 1  # at least hi_rank + 1 sampled keys >= T: top >= T
        lo_rank = math.ceil(c + m)  # at most lo_rank sampled keys > T: bottom <= T
        upper.append(max(hi_rank, -1))
        lower.append(lo_rank if lo_rank < s else -1)
        band = (min(lo_rank, s) - max(hi_rank, 0) + 1) * n / s
        caps.append(min(n, math.ceil(2.0 * band) + 64))
    return BracketPlan(
        torch.stack(rows).to(device),
        torch.tensor(sampled, dtype=torch.int32, device=device),
        torch.tensor(upper, dtype=torch.int32, device=device),
        torch.tensor(lower, dtype=torch.int32, device=device),
        max(caps),
    )


def _bracket(
    x: torch.Tensor, where: Spans, k: int, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Find every block's k-th largest key ``T`` without a pass per radix level: the keys of
    a sample (:func:`bracket_plan`, ``_sample``, one sort) give a band ``[lo, hi]``
    (``_bounds``) that holds ``T`` unless the sample misled; one pass over the block
    (``_band``) counts the keys above ``hi`` and copies the band's keys (about 1 % of the
    block at 1 % density) into a buffer; sorting that buffer gives ``T`` and the ties at
    it to take (``_settle``). A block whose band missed ``T`` (fewer than ``k`` keys at or
    above ``lo``, or ``k`` above ``hi``) or overflowed the buffer (many keys equal, say) is
    left ``state`` zeros, and the radix levels that follow in :func:`_take` select it as
    before; the others they skip. Nothing is read on the host; seven launches besides the
    two sorts.

    The band pass also leaves each program's count of keys above ``hi``, and ``_tally``
    adds the band's keys above ``T`` and at ``T`` by the program that read them: the
    per-program counts that place the pairs (:func:`_take`'s ``counts``), so for a
    bracketed block the count pass of ``_emit`` returns at once and the block is read
    twice after error feedback (band, write; the sample is a gather).

    Writes ``state[b]`` (prefix COUNTED, ties, done, T, taken) of every bracketed
    block; returns those counts, ``(blocks, 2, programs)`` int64 (the other blocks' are
    left to the count pass), and the band's sizes, ``(2, blocks)`` int32: keys above it,
    keys in it (benchmarks)."""
    plan = _hold(bracket_plan(where.sizes, k, x.device))
    kern, B, cap, dev = _kernels(), where.count, plan.capacity, x.device
    sample = torch.empty(B, plan.width, dtype=torch.int32, device=dev)
    kern.sample[(math.ceil(plan.width / TILE), B)](
        x, where.starts, plan.positions, plan.sampled, sample, plan.width, BLOCK=TILE
    )
    ranked = torch.sort(sample, dim=1, descending=True).values
    band = torch.empty(B, 2, dtype=torch.int32, device=dev)
    sizes = torch.empty(2, B, dtype=torch.int32, device=dev)  # above hi, in the band
    kern.bounds[(B,)](ranked, plan.width, plan.upper, plan.lower, band, sizes)
    held = torch.full((B, cap), -1, dtype=torch.int32, device=dev)
    owner = torch.empty(B, cap, dtype=torch.int32, device=dev)  # the program that read it
    counts = torch.zeros(B, 2, where.programs(), dtype=torch.int64, device=dev)
    kern.band[(where.programs(), B)](
        x, where.starts, where.lengths, band, sizes[0], sizes[1], held, owner, counts, cap,
        TILE=TILE, TILES=TILES,
    )  # fmt: skip
    ranked = torch.sort(held, dim=1, descending=True).values
    kern.settle[(B,)](ranked, cap, sizes, state, k, BLOCK=TIE_STEP)
    kern.tally[(math.ceil(cap / TIE_STEP), B)](
        held, owner, sizes, state, counts, cap, where.programs(), BLOCK=TIE_STEP
    )
    return counts, sizes


def take_gaussiank(
    x: torch.Tensor,
    k: int,
    refine: int,
    capacity: int,
    value_dtype: torch.dtype = torch.float32,
    moments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GaussianK's selection of ``x`` (``select.gaussian_threshold`` then
    ``select.capped_indices`` with ``capacity``), taken out of ``x``: ``(positions[cap],
    valid[cap], payload[cap], stats)``. The valid entries come first, in position order;
    padding is position 0 with value 0. ``stats`` (float32): the threshold, the count that
    passes it, the mean and the std. ``moments``: :attr:`Scan.moments` of ``x`` when the
    fused pass has them."""
    if not 0 <= refine <= MAX_REFINE:
        raise ValueError(f"refine={refine}: the fused path follows at most {MAX_REFINE}")
    n = x.numel()
    capacity = min(capacity, n)  # as capped_indices
    kern = _kernels()
    whole = blocks((0,), (n,), x.device)
    if moments is None:
        moments = torch.empty(whole.programs(), 3, dtype=torch.float32, device=x.device)
        kern.scan[(whole.programs(), 1)](
            x, x, whole.starts, whole.lengths, whole.bounds, whole.starts, whole.bounds, moments,
            whole.programs(), LEVEL=0, ACCUMULATE=False, MOMENTS=True, NBINS=BINS, TILE=TILE,
            TILES=TILES,
        )  # fmt: skip
    stats = torch.empty(NODES + 4, dtype=torch.float32, device=x.device)
    z = select.normal_quantile(1.0 - min(1.0, k / n) / 2.0)
    kern.thresholds[(1,)](moments, moments.shape[0], stats, z, NODES=NODES, PART=1024)
    counts = torch.zeros(NODES, dtype=torch.int32, device=x.device)
    nprog = whole.programs()
    per_program = torch.empty(nprog, NODES, dtype=torch.int32, device=x.device)
    step, steps = count_steps()
    kern.count_passing[(nprog,)](
        x, n, stats, counts, per_program, NODES=NODES, TILE=step, TILES=steps
    )  # fmt: skip
    bounds = torch.empty(1, 2, dtype=torch.int32, device=x.device)
    state = torch.empty(1, STATE, dtype=torch.int64, device=x.device)
    placed = torch.empty(1, 2, nprog, dtype=torch.int64, device=x.device)
    kern.walk[(1,)](
        counts, stats, bounds, state, per_program, placed, nprog, 2 * k / 3, 4 * k / 3,
        capacity, REFINE=refine, NODES=NODES, PART=1024,
    )  # fmt: skip
    valid = torch.empty(1, capacity, dtype=torch.bool, device=x.device)
    positions, payload = _take(x, whole, bounds, state, capacity, value_dtype, None, valid, placed)
    return positions[0], valid[0], payload[0], stats[NODES:]


def count_steps() -> tuple[int, int]:
    """GaussianK's threshold counting: elements a step (``COUNT_TILE`` or fewer, a power
    of two) and steps a program, so that a program reads what a program of the other
    passes reads (``TILE * TILES`` elements): its per-threshold counts are then the count
    pass's, for whichever threshold the walk chooses."""
    span = TILE * TILES
    step = math.gcd(COUNT_TILE, span)
    return step, span // step


LEVEL_WAVES = 4
"""Programs per streaming multiprocessor of a radix level's pass (``level_programs``)."""


def level_programs(where: Spans, device: torch.device) -> int:
    """Programs a block of a radix level's pass: a few waves of the GPU's multiprocessors
    rather than one a chunk. Each adds its histogram to the block's with 2,048 atomics,
    and in the usual case (the bracket or GaussianK's walk decided) the pass only checks
    that its block is done and returns: fewer, longer programs make both cheaper. Two
    under the interpreter, so that the tests run programs of several chunks."""
    units = _multiprocessors(device) * LEVEL_WAVES if device.type == "cuda" else 2
    return max(1, min(where.programs(), units))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _take(
    x: torch.Tensor,
    where: Spans,
    bounds: torch.Tensor,
    state: torch.Tensor,
    k: int,
    value_dtype: torch.dtype,
    hist1: torch.Tensor | None,
    valid: torch.Tensor | None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The radix levels, the count and the write (see the module docstring). ``state``:
    zeros, or already ``done`` (GaussianK's walk found that everything passing fits, or
    the bracket found ``T``); ``valid``: pad the outputs beyond the count taken and mark
    the valid slots; ``counts``: the per-program counts of the bracketed blocks
    (:func:`_bracket`), which the count pass leaves as they are."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("the fused selection reads a contiguous float32 tensor")
    if where.longest >= 2**31:
        raise ValueError("the fused selection counts in int32: blocks under 2^31 elements")
    kern = _kernels()
    B, dev = where.count, x.device
    grid = (where.programs(), B)
    hist = torch.zeros(3 if hist1 is None else 2, B, BINS, dtype=torch.int32, device=dev)
    rows = list(hist) if hist1 is None else [hist1.view(1, BINS), *hist]
    positions = torch.empty(B, k, dtype=torch.int64, device=dev)
    payload = torch.empty(B, k, dtype=value_dtype, device=dev)
    pay = payload.view(torch.int16) if value_dtype == torch.bfloat16 else payload
    pad = valid is not None
    for level, nbins in enumerate(LEVELS, start=1):
        if level > 1 or hist1 is None:
            kern.scan[(level_programs(where, dev), B)](
                x, x, where.starts, where.lengths, bounds, state, rows[level - 1], x, grid[0],
                LEVEL=level, ACCUMULATE=False, MOMENTS=False, NBINS=nbins, TILE=TILE, TILES=TILES,
            )  # fmt: skip
        kern.pick[(B,)](rows[level - 1], state, bounds, k, LEVEL=level, NBINS=nbins)
    # (blocks, 2, programs): the running sums run along the innermost dimension, which torch
    # scans in parallel; along a middle one it scans with a thread per column, about 150 us
    # a bucket on an H200 (issue 19, run D)
    if counts is None:
        counts = torch.empty(B, 2, grid[0], dtype=torch.int64, device=dev)
    kind = VALUE_KINDS[value_dtype]
    kern.emit[grid](
        x, where.starts, where.lengths, bounds, state, counts, positions, x, positions, k,
        WRITE=False, VALUE=0, PAD=False, TILE=TILE, TILES=TILES,
    )  # fmt: skip
    ends = torch.cumsum(counts, 2)
    kern.emit[grid](
        x, where.starts, where.lengths, bounds, state, ends, positions, pay,
        valid if pad else positions, k,
        WRITE=True, VALUE=kind, PAD=pad, TILE=TILE, TILES=TILES,
    )  # fmt: skip
    return positions, payload


VARIANTS: dict[str, tuple[str, list[dict[str, Any]]]] = {
    "scan": (
        "*fp32 *fp32 *i64 *i64 *i32 *i64 *i32 *fp32 i32",
        [dict(LEVEL=lv, ACCUMULATE=acc, MOMENTS=mom, NBINS=nb)
         for lv, acc, mom, nb in ((0, True, True, BINS), (0, True, False, BINS),
                                  (1, True, False, BINS), (0, False, True, BINS),
                                  (1, False, False, BINS), (2, False, False, BINS),
                                  (3, False, False, 512))],
    ),
    "pick": ("*i32 *i64 *i32 i32", [dict(LEVEL=lv, NBINS=nb) for lv, nb in enumerate(LEVELS, 1)]),
    "emit": (
        "*fp32 *i64 *i64 *i32 *i64 *i64 *i64 {value} {valid} i32",
        [dict(WRITE=w, VALUE=v, PAD=pad)
         for w, v, pad in ((False, 0, False), (True, 0, False), (True, 0, True),
                           (True, 1, True), (True, 2, False), (True, 1, False))],
    ),
    "sample": ("*fp32 *i64 *i32 *i32 *i32 i32", [dict(BLOCK=TILE)]),
    "bounds": ("*i32 i32 *i32 *i32 *i32 *i32", [{}]),
    "band": ("*fp32 *i64 *i64 *i32 *i32 *i32 *i32 *i32 *i64 i32", [{}]),
    "settle": ("*i32 i32 *i32 *i64 i32", [dict(BLOCK=TIE_STEP)]),
    "tally": ("*i32 *i32 *i32 *i64 *i64 i32 i32", [dict(BLOCK=TIE_STEP)]),
    "thresholds": ("*fp32 i32 *fp32 fp32", [dict(NODES=NODES, PART=1024)]),
    "count_passing": ("*fp32 i32 *fp32 *i32 *i32", [dict(NODES=NODES)]),
    "walk": (
        "*i32 *fp32 *i32 *i64 *i32 *i64 i32 fp32 fp32 i32",
        [dict(REFINE=r, NODES=NODES, PART=1024) for r in range(MAX_REFINE + 1)],
    ),
}  # fmt: skip
"""Argument types and constexpr variants of every kernel the hooks launch (tiles aside;
unused pointer arguments get a tensor of the type listed here)."""


def compile_variants(arch: int = 90) -> dict[str, int]:
    """Compile every variant in :data:`VARIANTS` ahead of time for a CUDA target (sm_90: an
    H100) and return the cubin size of each: what shows without a GPU that the kernels
    build for one (compiled Triton is stricter than the interpreter). Needs a process that
    has not run the interpreter: triton's own library is jitted in one mode per process."""
    if interpreting():
        raise RuntimeError("compile_variants needs TRITON_INTERPRET unset")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    kern = _kernels()
    target = GPUTarget("cuda", arch, 32)
    wire = {0: "*fp32", 1: "*fp16", 2: "*i16"}
    sizes: dict[str, int] = {}
    for name, (types, variants) in VARIANTS.items():
        fn = getattr(kern, name)
        for variant in variants:
            arg_types = types.format(
                value=wire.get(variant.get("VALUE", 0)),
                valid="*i1" if variant.get("PAD") else "*i64",
            ).split()
            names = [p.name for p in fn.params if not p.is_constexpr]
            constants = dict(variant)
            if any(p.name == "TILE" for p in fn.params):
                tiles = count_steps() if name == "count_passing" else (TILE, TILES)
                constants |= dict(zip(("TILE", "TILES"), tiles, strict=True))
            signature = dict(zip(names, arg_types, strict=True)) | dict.fromkeys(
                constants, "constexpr"
            )
            out = compile(ASTSource(fn, signature, constants), target=target)
            sizes[f"{name}{sorted(variant.items())}"] = len(out.asm["cubin"])
    return sizes


@functools.cache
def _kernels() -> SimpleNamespace:
    """The jitted kernels, built on first use: the only place triton is imported. Triton
    runs in one mode per process (``TRITON_INTERPRET=1``: the interpreter), fixed when
    ``triton.language`` is first imported, whose own library (``tl.sum`` and the like) is
    jitted then. The kernels below are plain functions until here; the names they read
    from this module (``tl`` and the constants) are set here, as constexpr, which compiled
    kernels require of globals."""
    global tl, _S, _W, _INF, _LEAST, _COUNTED
    import triton
    import triton.language

    tl = triton.language
    _S, _W = tl.constexpr(STATE), tl.constexpr(BINS)
    _INF, _LEAST = tl.constexpr(INF_KEY), tl.constexpr(TINY)
    _COUNTED = tl.constexpr(COUNTED)
    jit = triton.jit
    return SimpleNamespace(
        scan=jit(_scan), pick=jit(_pick), emit=jit(_emit), sample=jit(_sample),
        bounds=jit(_bounds), band=jit(_band), settle=jit(_settle), tally=jit(_tally),
        thresholds=jit(_thresholds),
        count_passing=jit(_count_passing), walk=jit(_walk),
    )  # fmt: skip


# -- the kernels (plain functions until ``_kernels`` jits them) --------------------------------
tl: Any = None  # triton.language, set by _kernels
_S = _W = _INF = _LEAST = _COUNTED = None  # constexpr constants, set by _kernels


def _scan(
    x_ptr, grad_ptr, starts_ptr, lengths_ptr, bounds_ptr, state_ptr, hist_ptr, moments_ptr,
    chunks, LEVEL: tl.constexpr, ACCUMULATE: tl.constexpr, MOMENTS: tl.constexpr,
    NBINS: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """One pass over every block: with ACCUMULATE ``x += grad, grad = 0``; with LEVEL
    1..3 that radix level's histogram of the eligible keys (levels 2 and 3: those under
    the block's prefix); with MOMENTS the count, mean and squared deviations of the
    program's elements. A block is ``chunks`` runs of ``TILE * TILES`` elements; a
    program takes every ``num_programs``-th from its own (one each when the grid has one
    program a chunk, as the first pass's; fewer programs for the radix levels, whose
    histograms do not care which program saw a key: :func:`level_programs`). A
    selection's levels do nothing once its block is done."""
    p = tl.program_id(0)
    b = tl.program_id(1)
    start = tl.load(starts_ptr + b)
    length = tl.load(lengths_ptr + b)
    lo = tl.load(bounds_ptr + 2 * b)
    hi = tl.load(bounds_ptr + 2 * b + 1)
    bins = tl.arange(0, NBINS)
    hist = tl.zeros([NBINS], dtype=tl.int32)
    cnt = tl.zeros([], dtype=tl.float32)
    mean = tl.zeros([], dtype=tl.float32)
    m2 = tl.zeros([], dtype=tl.float32)
    if ACCUMULATE or LEVEL == 0:
        prefix = 0
        active = 1
    else:
        prefix = tl.load(state_ptr + _S * b).to(tl.int32)
        active = tl.load(state_ptr + _S * b + 2) == 0
    if active:
        for c in range(p, chunks, tl.num_programs(0)):
            for t in range(TILES):
                offs = (c * TILES + t) * TILE + tl.arange(0, TILE)
                m = offs < length
                v = tl.load(x_ptr + start + offs, mask=m, other=0.0)
                if ACCUMULATE:
                    g = tl.load(grad_ptr + start + offs, mask=m, other=0.0)
                    v = v + g
                    tl.store(x_ptr + start + offs, v, mask=m)
                    tl.store(grad_ptr + start + offs, tl.zeros_like(g), mask=m)
                if MOMENTS:
                    c_t = tl.sum(m.to(tl.float32))
                    mean_t = tl.sum(tl.where(m, v, 0.0)) / tl.maximum(c_t, 1.0)
                    d = tl.where(m, v - mean_t, 0.0)
                    tot = cnt + c_t
                    delta = mean_t - mean
                    w = c_t / tl.maximum(tot, 1.0)
                    has = c_t > 0
                    m2 = tl.where(has, m2 + tl.sum(d * d) + delta * delta * cnt * w, m2)
                    mean = tl.where(has, mean + delta * w, mean)
                    cnt = tot
                if LEVEL >= 1:
                    key = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
                    ok = m & (key >= lo) & (key <= hi)
                    if LEVEL == 1:
                        digit = key >> 20
                    elif LEVEL == 2:
                        ok = ok & ((key >> 20) == prefix)
                        digit = (key >> 9) & 2047
                    else:
                        ok = ok & ((key >> 9) == prefix)
                        digit = key & 511
                    got = tl.histogram(tl.where(ok, digit, 0), NBINS)
                    miss = TILE - tl.sum(ok.to(tl.int32))
                    hist += got - tl.where(bins == 0, miss, 0)
    if LEVEL >= 1:
        tl.atomic_add(hist_ptr + b * _W + bins, hist, mask=hist > 0, sem="relaxed")
    if MOMENTS:
        q = b * tl.num_programs(0) + p
        tl.store(moments_ptr + 3 * q, cnt)
        tl.store(moments_ptr + 3 * q + 1, mean)
        tl.store(moments_ptr + 3 * q + 2, m2)


def _pick(
    hist_ptr, state_ptr, bounds_ptr, k, LEVEL: tl.constexpr, NBINS: tl.constexpr,
):  # fmt: skip
    """Per block: the bin of this level where the k-th largest key lies and the keys still
    wanted below the bins above it; the search is over when that bin is taken whole (``T``
    just below its keys, no ties) or at the last level (``T`` the k-th key, and the count
    still wanted is the ties at ``T`` to take). The first level also records the count
    taken, ``min(k, eligible keys)``."""
    b = tl.program_id(0)
    bins = tl.arange(0, NBINS)
    h = tl.load(hist_ptr + b * _W + bins)
    total = tl.sum(h)
    base = state_ptr + _S * b
    fresh = tl.load(base + 2) == 0
    prefix = tl.load(base).to(tl.int32)
    if LEVEL == 1:
        need = tl.minimum(total, k)
        floor = tl.load(bounds_ptr + 2 * b)
        tl.store(base + 4, need.to(tl.int64), mask=fresh)
    elif LEVEL == 2:
        need = tl.load(base + 1).to(tl.int32)
        floor = prefix << 20
    else:
        need = tl.load(base + 1).to(tl.int32)
        floor = prefix << 9
    suffix = tl.cumsum(h, 0, reverse=True)
    digit = tl.sum((suffix >= need).to(tl.int32)) - 1
    above = tl.sum(tl.where(bins > digit, h, 0))
    if LEVEL == 1:
        nxt = digit
    elif LEVEL == 2:
        nxt = (prefix << 11) | digit
    else:
        nxt = (prefix << 9) | digit
    whole = need == total
    last = whole | (LEVEL == 3)
    tl.store(base, nxt.to(tl.int64), mask=fresh)
    tl.store(base + 1, tl.where(whole, 0, need - above).to(tl.int64), mask=fresh)
    tl.store(base + 2, last.to(tl.int64), mask=fresh)
    tl.store(base + 3, tl.where(whole, floor - 1, nxt).to(tl.int64), mask=fresh)


def _emit(
    x_ptr, starts_ptr, lengths_ptr, bounds_ptr, state_ptr, counts_ptr, pos_ptr, val_ptr,
    valid_ptr, k, WRITE: tl.constexpr, VALUE: tl.constexpr, PAD: tl.constexpr,
    TILE: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """Counting pass (WRITE false): per program the eligible keys above ``T`` and equal
    to it. Writing pass (``counts_ptr``: their running sums over the programs): every
    key above ``T`` and the first ``ties`` keys at ``T`` in position order, as
    (position, wire value) pairs, and ``x -= seen`` there; with PAD the slots past the
    count taken become (0, 0) and ``valid`` marks the others (the programs share the
    slots in strides)."""
    p = tl.program_id(0)
    b = tl.program_id(1)
    start = tl.load(starts_ptr + b)
    length = tl.load(lengths_ptr + b)
    lo = tl.load(bounds_ptr + 2 * b)
    hi = tl.load(bounds_ptr + 2 * b + 1)
    # counts, slots and keys in int32 (a block is shorter than 2^31: ``_take``), which
    # halves the work of the running sums against int64; T is at least -1
    ties = tl.load(state_ptr + _S * b + 1).to(tl.int32)
    t_key = tl.load(state_ptr + _S * b + 3).to(tl.int32)
    nprog = tl.num_programs(0)
    row = 2 * b * nprog  # counts[b]: (2, programs), the programs innermost
    if WRITE:
        first = p > 0
        base_gt = tl.load(counts_ptr + row + p - 1, mask=first, other=0).to(tl.int32)
        base_eq = tl.load(counts_ptr + row + nprog + p - 1, mask=first, other=0).to(tl.int32)
        limit = length
    else:  # a block counted already (COUNTED: ``_tally`` or the walk placed them): no read
        base_gt = tl.zeros([], dtype=tl.int32)
        base_eq = tl.zeros([], dtype=tl.int32)
        todo = tl.load(state_ptr + _S * b) != _COUNTED
        limit = tl.where(todo, length, 0)
    for t in range(TILES):
        offs = (p * TILES + t) * TILE + tl.arange(0, TILE)
        m = offs < limit
        v = tl.load(x_ptr + start + offs, mask=m, other=0.0)
        key = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        ok = m & (key >= lo) & (key <= hi)
        gt = ok & (key > t_key)
        eq = ok & (key == t_key)
        gi = gt.to(tl.int32)
        ei = eq.to(tl.int32)
        if WRITE:
            eq_before = base_eq + tl.cumsum(ei, 0) - ei
            take = gt | (eq & (eq_before < ties))
            slot = base_gt + tl.cumsum(gi, 0) - gi + tl.minimum(eq_before, ties)
            out = b.to(tl.int64) * k + slot
            tl.store(pos_ptr + out, start + offs, mask=take)
            if VALUE == 0:
                seen = v
                tl.store(val_ptr + out, v, mask=take)
            elif VALUE == 1:
                wire = tl.clamp(v, -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL)
                wire = wire.to(tl.float16)
                seen = wire.to(tl.float32)
                tl.store(val_ptr + out, wire, mask=take)
            else:  # bfloat16, rounded to nearest even on the bits (as torch rounds)
                bits = v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
                up = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                top = tl.where(v != v, (bits >> 16) | 0x40, up) & 0xFFFF  # NaN stays quiet
                seen = (top << 16).to(tl.int32).to(tl.float32, bitcast=True)
                tl.store(val_ptr + out, top.to(tl.int16), mask=take)
            tl.store(x_ptr + start + offs, v - seen, mask=take)
        base_gt += tl.sum(gi)
        base_eq += tl.sum(ei)
    if not WRITE:
        tl.store(counts_ptr + row + p, base_gt.to(tl.int64), mask=todo)
        tl.store(counts_ptr + row + nprog + p, base_eq.to(tl.int64), mask=todo)
    if PAD:
        taken = tl.load(state_ptr + _S * b + 4)
        for c0 in range(p * TILE, k, tl.num_programs(0) * TILE):
            slot = c0 + tl.arange(0, TILE)
            inside = slot < k
            tl.store(valid_ptr + b * k + slot, slot < taken, mask=inside)
            empty = inside & (slot >= taken)
            tl.store(pos_ptr + b * k + slot, tl.zeros([TILE], dtype=tl.int64), mask=empty)
            zero = tl.zeros([TILE], dtype=val_ptr.dtype.element_ty)
            tl.store(val_ptr + b * k + slot, zero, mask=empty)


def _sample(x_ptr, starts_ptr, pos_ptr, sampled_ptr, out_ptr, width, BLOCK: tl.constexpr):
    """The bracket's sample: ``|x|``'s keys at the plan's positions, -1 past the block's
    sampled count (sorted last)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(1)
    inside = j < width
    have = j < tl.load(sampled_ptr + b)
    pos = tl.load(starts_ptr + b) + tl.load(pos_ptr + b * width + j, mask=have, other=0)
    v = tl.load(x_ptr + pos, mask=have, other=0.0)
    key = tl.where(have, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)
    tl.store(out_ptr + b * width + j, key, mask=inside)


def _bounds(ranked_ptr, width, upper_ptr, lower_ptr, band_ptr, counts_ptr):
    """Per block the band ``[lo, hi]`` from the sorted sample (rank -1: open, ``hi`` the
    largest key or ``lo`` zero), and its counts zeroed for ``_band``."""
    b = tl.program_id(0)
    nblocks = tl.num_programs(0)
    upper = tl.load(upper_ptr + b)
    lower = tl.load(lower_ptr + b)
    hi = tl.load(ranked_ptr + b * width + tl.maximum(upper, 0))
    lo = tl.load(ranked_ptr + b * width + tl.maximum(lower, 0))
    tl.store(band_ptr + 2 * b, tl.where(lower < 0, 0, lo))
    tl.store(band_ptr + 2 * b + 1, tl.where(upper < 0, 0x7FFFFFFF, hi))
    tl.store(counts_ptr + b, tl.zeros([], dtype=tl.int32))
    tl.store(counts_ptr + nblocks + b, tl.zeros([], dtype=tl.int32))


def _settle(ranked_ptr, cap, counts_ptr, state_ptr, k, BLOCK: tl.constexpr):
    """Per block, from the band's keys sorted (descending): when the band holds ``T`` and
    did not overflow, ``T`` is its ``need``-th key (``need``: ``k`` less the keys above the
    band) and the ties to take are the keys equal to it up to there, counted backwards a
    ``BLOCK`` at a time (one step unless that many are tied); the block's state is then
    done, its prefix COUNTED. Otherwise the state is left as it is (zeros: the
    radix levels select the block)."""
    b = tl.program_id(0)
    nblocks = tl.num_programs(0)
    above = tl.load(counts_ptr + b)
    inside = tl.load(counts_ptr + nblocks + b)
    need = k - above
    ok = (need >= 1) & (need <= inside) & (inside <= cap)
    at = tl.minimum(tl.maximum(need - 1, 0), cap - 1)
    row = ranked_ptr + b * cap
    t = tl.load(row + at)
    ties = tl.zeros([], dtype=tl.int32)
    end = at
    more = ok
    while more:
        idx = end - tl.arange(0, BLOCK)
        have = idx >= 0
        tied = tl.sum((have & (tl.load(row + idx, mask=have, other=0) == t)).to(tl.int32))
        ties += tied
        more = (tied == BLOCK) & (end >= BLOCK)
        end -= BLOCK
    base = state_ptr + _S * b
    tl.store(base, tl.full([], _COUNTED, tl.int64), mask=ok)  # ``_tally`` counts for it
    tl.store(base + 1, ties.to(tl.int64), mask=ok)
    tl.store(base + 2, tl.full([], 1, tl.int64), mask=ok)
    tl.store(base + 3, t.to(tl.int64), mask=ok)
    tl.store(base + 4, tl.full([], 1, tl.int64) * k, mask=ok)


def _band(
    x_ptr, starts_ptr, lengths_ptr, band_ptr, above_ptr, inside_ptr, held_ptr, owner_ptr,
    counts_ptr, cap, TILE: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """One read of every block: count the keys above the band's top (``above``, and per
    program in ``counts[b, 0, p]``) and copy the keys inside ``[lo, hi]`` into the
    block's row of ``held``, the program's number into ``owner`` (``cap`` wide; the
    count in ``inside`` goes on past ``cap`` so that an overflow shows). Slots are taken
    with one atomic per tile, so the band's order in ``held`` is arbitrary: it is sorted
    next."""
    p = tl.program_id(0)
    b = tl.program_id(1)
    start = tl.load(starts_ptr + b)
    length = tl.load(lengths_ptr + b)
    lo = tl.load(band_ptr + 2 * b)
    hi = tl.load(band_ptr + 2 * b + 1)
    above = tl.zeros([], dtype=tl.int32)
    for t in range(TILES):
        offs = (p * TILES + t) * TILE + tl.arange(0, TILE)
        m = offs < length
        v = tl.load(x_ptr + start + offs, mask=m, other=0.0)
        key = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        above += tl.sum((m & (key > hi)).to(tl.int32))
        inb = m & (key >= lo) & (key <= hi)
        ii = inb.to(tl.int32)
        n_in = tl.sum(ii)
        if n_in > 0:
            first = tl.atomic_add(inside_ptr + b, n_in, sem="relaxed")
            slot = first + tl.cumsum(ii, 0) - ii
            kept = inb & (slot < cap)
            tl.store(held_ptr + b * cap + slot, key, mask=kept)
            tl.store(owner_ptr + b * cap + slot, tl.zeros_like(slot) + p, mask=kept)
    tl.atomic_add(above_ptr + b, above, sem="relaxed")
    tl.store(counts_ptr + 2 * b * tl.num_programs(0) + p, above.to(tl.int64))


def _tally(
    held_ptr, owner_ptr, sizes_ptr, state_ptr, counts_ptr, cap, nprog, BLOCK: tl.constexpr
):  # fmt: skip
    """For a bracketed block: add each band key above ``T`` and at ``T`` to the count of
    the program that read it (``counts[b, 0 | 1, owner]``, ``nprog`` programs a block),
    completing what the band pass counted above the band: the per-program counts the
    writing pass places pairs by."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(1)
    nblocks = tl.num_programs(1)
    bracketed = tl.load(state_ptr + _S * b) == _COUNTED
    t = tl.load(state_ptr + _S * b + 3).to(tl.int32)
    m = j < tl.where(bracketed, tl.minimum(tl.load(sizes_ptr + nblocks + b), cap), 0)
    key = tl.load(held_ptr + b * cap + j, mask=m, other=-1)
    owner = tl.load(owner_ptr + b * cap + j, mask=m, other=0)
    row = counts_ptr + 2 * b * nprog
    one = tl.full([BLOCK], 1, tl.int64)
    tl.atomic_add(row + owner, one, mask=m & (key > t), sem="relaxed")
    tl.atomic_add(row + nprog + owner, one, mask=m & (key == t), sem="relaxed")


def _thresholds(moments_ptr, parts, out_ptr, z, NODES: tl.constexpr, PART: tl.constexpr):
    """GaussianK: the mean and std of the bucket from the per-program moments (combined
    in float64), ``thr = max(|mean| + std * z, TINY)`` in float32 as the plain path
    computes it, and every threshold the refinement can reach: node ``i`` of a binary
    tree (children ``2i + 1``: x0.5, ``2i + 2``: x1.5), multiplied in the plain path's
    order. ``out``: the NODES thresholds, then (``walk``) the chosen one and its count,
    then the mean and the std."""
    n = tl.zeros([], dtype=tl.float64)
    s = tl.zeros([], dtype=tl.float64)
    for c0 in range(0, parts, PART):
        i = c0 + tl.arange(0, PART)
        m = i < parts
        c = tl.load(moments_ptr + 3 * i, mask=m, other=0.0).to(tl.float64)
        mu = tl.load(moments_ptr + 3 * i + 1, mask=m, other=0.0).to(tl.float64)
        n += tl.sum(c)
        s += tl.sum(tl.where(c > 0, c * mu, 0.0))
    mean = s / n
    m2 = tl.zeros([], dtype=tl.float64)
    for c0 in range(0, parts, PART):
        i = c0 + tl.arange(0, PART)
        m = i < parts
        c = tl.load(moments_ptr + 3 * i, mask=m, other=0.0).to(tl.float64)
        mu = tl.load(moments_ptr + 3 * i + 1, mask=m, other=0.0).to(tl.float64)
        dev = tl.load(moments_ptr + 3 * i + 2, mask=m, other=0.0).to(tl.float64)
        d = mu - mean
        m2 += tl.sum(tl.where(c > 0, dev + c * d * d, 0.0))
    mean32 = mean.to(tl.float32)
    std32 = tl.sqrt(m2 / (n - 1.0)).to(tl.float32)
    least = tl.full([], _LEAST, tl.float32)
    thr = tl.maximum(tl.abs(mean32) + std32 * z, least, propagate_nan=tl.PropagateNan.ALL)
    node = tl.arange(0, NODES)
    path = node + 1  # the binary digits after its leading one: 0 = x0.5, 1 = x1.5
    depth = tl.zeros([NODES], dtype=tl.int32)
    for j in tl.static_range(1, 6):
        depth += (path >= (1 << j)).to(tl.int32)
    vals = tl.zeros([NODES], dtype=tl.float32) + thr
    for step in tl.static_range(0, 5):
        bit = (path >> tl.maximum(depth - 1 - step, 0)) & 1
        factor = tl.where(bit == 1, 1.5, 0.5)
        vals = tl.where(step < depth, vals * factor, vals)
    tl.store(out_ptr + node, vals)
    tl.store(out_ptr + NODES + 2, mean32)
    tl.store(out_ptr + NODES + 3, std32)


def _count_passing(
    x_ptr, n, thr_ptr, counts_ptr, per_ptr, NODES: tl.constexpr, TILE: tl.constexpr,
    TILES: tl.constexpr,
):  # fmt: skip
    """``counts[j] += #{|x| >= thr[j]}`` for every candidate threshold, one read; each
    program's own counts go to ``per[p]`` (a program reads what ``_emit``'s does:
    :func:`count_steps`)."""
    p = tl.program_id(0)
    nodes = tl.arange(0, NODES)
    thr = tl.load(thr_ptr + nodes)
    got = tl.zeros([NODES], dtype=tl.int32)
    for t in range(TILES):
        offs = (p * TILES + t) * TILE + tl.arange(0, TILE)
        m = offs < n
        mag = tl.abs(tl.load(x_ptr + offs, mask=m, other=0.0))
        hit = (mag[:, None] >= thr[None, :]) & m[:, None]
        got += tl.sum(hit.to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + nodes, got, sem="relaxed")
    tl.store(per_ptr + p * NODES + nodes, got)


def _walk(
    counts_ptr, out_ptr, bounds_ptr, state_ptr, per_ptr, placed_ptr, nprog, low, high, cap,
    REFINE: tl.constexpr, NODES: tl.constexpr, PART: tl.constexpr,
):  # fmt: skip
    """GaussianK's refinement on the counts: from the root, halve while fewer than
    ``low`` pass, x1.5 while more than ``high`` pass (counts compared as float32, as
    the plain path's ``count < 2 * k / 3``). Sets the block's eligible keys
    (``|x| >= max(thr, TINY)``, NaN never) and, when all of them fit ``cap``, a done
    search that takes them all, counted already: each program's count at the chosen
    threshold goes to ``placed`` (``_emit``'s counts, ``nprog`` programs) and the prefix
    is COUNTED, so the count pass reads nothing."""
    ids = tl.arange(0, NODES)
    counts = tl.load(counts_ptr + ids)
    thr_all = tl.load(out_ptr + ids)
    node = tl.zeros([], dtype=tl.int32)
    for _ in tl.static_range(0, REFINE):
        c = tl.sum(tl.where(ids == node, counts, 0)).to(tl.float32)
        node = tl.where(c < low, 2 * node + 1, tl.where(c > high, 2 * node + 2, node))
    thr = tl.sum(tl.where(ids == node, thr_all, 0.0))
    passing = tl.sum(tl.where(ids == node, counts, 0))
    floor = tl.maximum(thr, tl.full([], _LEAST, tl.float32), propagate_nan=tl.PropagateNan.ALL)
    lo = floor.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.store(bounds_ptr, lo)
    tl.store(bounds_ptr + 1, tl.zeros([], dtype=tl.int32) + _INF)
    # |x| >= thr counts exactly the eligible keys unless thr was raised to TINY
    fits = (thr == floor) & (passing <= cap)
    upto = tl.where(fits, nprog, 0)  # the programs whose counts are placed
    for c0 in range(0, nprog, PART):
        q = c0 + tl.arange(0, PART)
        mine = q < upto
        got = tl.load(per_ptr + q * NODES + node, mask=mine, other=0)
        tl.store(placed_ptr + q, got.to(tl.int64), mask=mine)
        tl.store(placed_ptr + nprog + q, tl.zeros([PART], dtype=tl.int64), mask=mine)
    tl.store(state_ptr, tl.where(fits, _COUNTED, 0).to(tl.int64))
    tl.store(state_ptr + 1, tl.where(fits, passing, 0).to(tl.int64))
    tl.store(state_ptr + 2, fits.to(tl.int64))
    tl.store(state_ptr + 3, (lo - 1).to(tl.int64))
    tl.store(state_ptr + 4, tl.where(fits, passing, 0).to(tl.int64))
    tl.store(out_ptr + NODES, thr)
    tl.store(out_ptr + NODES + 1, passing.to(tl.float32))
