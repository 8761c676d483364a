"""Selection primitives shared by the sparse hooks (all return int64 positions).

Every selector treats ``k >= numel`` as "everything", so density 1.0 degenerates to a dense
exchange and reproduces the dense average exactly.

No host syncs: what a hook calls in its steady state keeps counts and thresholds on the
device and returns fixed-size results (``capped_indices``: a capacity and a validity mask
instead of a data-dependent length). The exceptions are CPU-only shortcuts that read a count
on the host, which costs nothing on a CPU and would stall an accelerator; they run only for
CPU tensors while ``CPU_SHORTCUTS`` is true (tests switch it off to check the device path).

On the CPU the sampled threshold's candidates are found by a grouped scan
(``grouped_positions``, while ``CPU_GROUPED`` is true): two streaming reductions give the
largest ``|x|`` of each group of ``GROUP_ROWS`` elements, and only the groups that reach the
threshold are looked at element by element. It returns the positions of the plain
``sparse_positions(|x| >= threshold)`` in their order, so the selection is bit-identical;
``CPU_GROUPED = False`` keeps the plain scan (the reference, issue 19's "before").

Faster still, while ``CPU_KERNEL`` is true and numba can be imported (``cpu_kernels``): the
driver's one compiled pass forms ``acc``, zeroes the gradient and lists each block's
candidates above a sampled pre-threshold, and the selection filters that list by the exact
threshold; the same positions in the same order again (``cpu_kernels``'s docstring).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zoopick.training.comm.cpu_kernels import BlockScan


def k_for(density: float, numel: int) -> int:
    """Number of elements to keep: ``ceil(density * numel)``, at least 1 when numel > 0.

    The product is rounded to 9 digits first so 0.07 * 100 gives 7, not 8."""
    if numel <= 0:
        return 0
    return max(1, min(numel, math.ceil(round(density * numel, 9))))


CPU_SHORTCUTS = True
"""Allow the CPU-only selection shortcuts (host reads of counts); see the module doc."""

CPU_GROUPED = True
"""Find the sampled threshold's candidates by the grouped scan (``grouped_positions``)
instead of ``|x|``, a full-size mask and ``sparse_positions``; same result."""

GROUP_ROWS = 8
"""Elements per group of the grouped scan: group ``c`` of a 1-d tensor viewed as
``GROUP_ROWS`` rows is its column ``c``. Eight balanced the two stages on ResNet-18's
gradient at 1 % (about a tenth of the groups reach the threshold)."""

CPU_KERNEL = True
"""Run the CPU's sampled selection on the compiled single pass (``cpu_kernels``) where numba
can be imported; same result as the grouped and the plain scan."""

CUDA_TRITON = False
"""Select on CUDA with the fused Triton kernels (``triton_kernels``: spardl's top-k and
GaussianK, error feedback and wire rounding fused, no sort) instead of ``torch.topk`` and
``capped_indices``. Off until measured on a GPU (issue 19). Process-wide: a fine-tune sets it
from its config (``FinetuneConfig.comm_triton``: the deployment's ``ZOOPICK_COMM_TRITON``,
``zoopick train --comm-triton``) before its hook is built; tests and benchmarks set it
directly. The library reads no environment variable for it. The same result, ties aside
(``triton_kernels``'s docstring). Under Triton's interpreter (``TRITON_INTERPRET=1``) they run
on CPU tensors with ``CPU_SHORTCUTS`` off: how the tests check them without a GPU."""


def cuda_triton() -> bool:
    """:data:`CUDA_TRITON`, the one place the hooks read it."""
    return CUDA_TRITON


SAMPLED_MIN_NUMEL = 1 << 16  # below this, torch.topk is cheap enough
SAMPLE_STRIDE = 97
SAMPLE_MARGIN = 1.3


def topk_indices(
    x: torch.Tensor,
    k: int,
    scratch: torch.Tensor | None = None,
    peaks: torch.Tensor | BlockScan | None = None,
) -> torch.Tensor:
    """Positions of the ``k`` largest ``|x|`` (exact, unordered).

    On the CPU, for large inputs and ``k`` at most an eighth of them, a sampled threshold
    with an exact trim (``sampled_topk_indices``) replaces ``torch.topk``, which costs about
    6x more on one core (163 vs 25 ms for 7.2M elements, k = 1 %). On a GPU ``torch.topk``.
    ``scratch`` (float32, ``x.numel()`` elements, e.g. ``HookState.scratch``) receives
    ``|x|`` instead of a fresh temporary. ``peaks``: the column maxima of ``|x|`` for the
    grouped scan when they are known already (``prescan.Prescan``; never too low), or the
    block's candidates from the compiled pass (``cpu_kernels.BlockScan``)."""
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=x.device)
    sampled = cpu_shortcut(x) and n >= SAMPLED_MIN_NUMEL and 8 * k <= n
    if sampled and peaks is not None and not isinstance(peaks, torch.Tensor):
        return peaks.topk_indices(x, k, scratch)  # the compiled pass's candidates
    if sampled and CPU_GROUPED:
        return _sampled_topk_grouped(x, k, scratch, peaks)
    mag = x.abs() if scratch is None else torch.abs(x, out=scratch)
    if sampled:
        return _sampled_topk(mag, k)
    return torch.topk(mag, k, sorted=False).indices


TINY = torch.finfo(torch.float32).tiny * torch.finfo(torch.float32).eps  # least subnormal


def _positive(threshold: torch.Tensor | float) -> torch.Tensor | float:
    """``threshold`` raised to the least positive float32, so ``|x| >= threshold`` also means
    ``x != 0`` (one comparison pass instead of two and an ``&``)."""
    if isinstance(threshold, torch.Tensor):
        return threshold.clamp_min(TINY)
    return max(threshold, TINY)


def cpu_shortcut(x: torch.Tensor) -> bool:
    """Whether the CPU-only shortcuts apply to ``x`` (see the module docstring)."""
    return CPU_SHORTCUTS and x.device.type == "cpu"


def cpu_kernels(x: torch.Tensor) -> ModuleType | None:
    """The compiled kernels (``cpu_kernels``) when they apply to ``x`` (a CPU tensor, the
    shortcuts and ``CPU_KERNEL`` on) and numba can be imported; else None: the torch path."""
    if not (CPU_KERNEL and cpu_shortcut(x)):
        return None
    return _load_cpu_kernels()


@functools.cache
def _load_cpu_kernels() -> ModuleType | None:
    """Import ``cpu_kernels`` (and numba) on first use; on failure warn once and keep to the
    torch path, which gives the same result."""
    try:
        from zoopick.training.comm import cpu_kernels
    except (ImportError, OSError, RuntimeError) as exc:
        warnings.warn(
            f"zoopick: the compiled CPU selection is off ({exc!r}); the torch path runs",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return cpu_kernels


def sampled_topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-``k`` of ``|x|`` by a threshold from a strided sample, then an exact trim.

    The sample (every 97th element) gives a threshold expected to pass about 1.3 k elements;
    the candidates above it are gathered and the exact top-``k`` is taken among them. When
    fewer than ``k`` pass (an unlucky sample), it falls back to ``torch.topk`` on everything,
    so the count and the set are always exact (up to ties). Needs one host sync (the
    candidate count): a CPU path. On a mostly-zero input (the sample's threshold is 0) the
    candidates are the non-zeros."""
    if CPU_GROUPED and x.dim() == 1 and x.is_floating_point():
        return _sampled_topk_grouped(x, k)
    return _sampled_topk(x.abs(), k)


def sparse_positions(mask: torch.Tensor) -> torch.Tensor:
    """``torch.nonzero(mask).flatten()`` for a 1-d bool mask with few ``True`` (a CPU path).

    torch's CPU ``nonzero`` reads every byte twice (a count, then the fill): 9 ms for 11.7M
    elements on one core, the largest single cost of a sparse hook. Here the mask is read as
    int64 words of 8 positions, ``nonzero`` runs over the words, and only the words holding a
    ``True`` are expanded (6 ms, the same positions in the same order). A mask with ``True``
    in more than half of its words gains nothing and takes ``torch.nonzero`` itself."""
    n = mask.numel()
    body = n - n % 8
    if body == 0 or not mask.is_contiguous() or mask.data_ptr() % 8:
        return torch.nonzero(mask).flatten()
    words = torch.nonzero(mask[:body].view(torch.int64)).flatten()
    if 2 * words.numel() > body // 8:
        return torch.nonzero(mask).flatten()
    hit = torch.nonzero(mask[:body].view(-1, 8)[words])
    pos = words[hit[:, 0]] * 8 + hit[:, 1]
    if body < n:
        pos = torch.cat([pos, torch.nonzero(mask[body:]).flatten() + body])
    return pos


def _sampled_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`sampled_topk_indices` given the magnitudes."""
    sample = mag[::SAMPLE_STRIDE]
    m = sample.numel()
    rank = min(m, max(1, math.ceil(SAMPLE_MARGIN * k * m / mag.numel())))
    thr = torch.topk(sample, rank, sorted=False).values.min()
    # a mostly-zero input (threshold 0): only its non-zeros are candidates
    cand = sparse_positions(mag > 0 if thr <= 0 else mag >= thr)
    if cand.numel() < k:
        return torch.topk(mag, k, sorted=False).indices
    return cand[torch.topk(mag[cand], k, sorted=False).indices]


def _sample_threshold(mag_sample: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The threshold a strided sample of ``|x|`` (every ``SAMPLE_STRIDE``-th of ``n``
    elements) expects to pass about ``SAMPLE_MARGIN * k`` elements (0-d tensor)."""
    rank = sample_rank(k, mag_sample.numel(), n)
    return torch.topk(mag_sample, rank, sorted=False).values.min()


def sample_rank(k: int, m: int, n: int) -> int:
    """Which largest of a sample of ``m`` of ``n`` elements is the sampled threshold: the
    one expected to pass about ``SAMPLE_MARGIN * k`` of the ``n``."""
    return min(m, max(1, math.ceil(SAMPLE_MARGIN * k * m / n)))


def grouped_positions(
    x: torch.Tensor, threshold: torch.Tensor | float, peaks: torch.Tensor | None = None
) -> torch.Tensor:
    """``sparse_positions(x.abs() >= threshold)`` for a 1-d float tensor and a threshold
    above zero, without a full-size ``|x|`` or mask (a CPU path; the same positions in the
    same order).

    On one core the plain scan costs about 2.5 ns an element (``abs``, a bool ``ge`` torch
    does not vectorise, ``nonzero``) against 0.2 for a streaming reduction. So ``x`` is
    viewed as ``GROUP_ROWS`` rows and column ``c`` is a group: ``amax`` and ``amin`` over the
    rows (two streaming passes) give each group's largest ``|x|``; only the groups that reach
    ``threshold`` (about a tenth at 1 %, fewer where large values cluster) are gathered and
    compared element by element. ``nonzero`` over the gathered rows lists (row, group)
    pairs row-major, which is ascending position order. A group holding a NaN is scanned
    (its maximum is NaN), and NaN itself never passes, as in the plain scan.

    ``peaks``: those column maxima, computed already (``prescan.accumulate``); a maximum
    above the true one (stale, or infinity for a touched column) only adds a column to
    look at, so the positions are the same."""
    n = x.numel()
    rows = GROUP_ROWS
    cols = n // rows
    body = rows * cols
    parts: list[torch.Tensor] = []
    if cols:
        grid = x[:body].view(rows, cols)
        if peaks is None:
            top = torch.amax(grid, 0)
            peaks = torch.maximum(top, torch.amin(grid, 0).neg_(), out=top)
        elif peaks.numel() != cols:
            raise ValueError(f"peaks: {peaks.numel()} column maxima for {cols} columns")
        groups = torch.nonzero(torch.lt(peaks, threshold).logical_not_()).flatten()
        hit = torch.nonzero(grid.index_select(1, groups).abs_() >= threshold)
        parts.append(hit[:, 0] * cols + groups.index_select(0, hit[:, 1]))
    if body < n:
        parts.append(torch.nonzero(x[body:].abs() >= threshold).flatten() + body)
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=x.device)


def _sampled_topk_grouped(
    x: torch.Tensor,
    k: int,
    scratch: torch.Tensor | None = None,
    peaks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`_sampled_topk` of ``|x|`` with the grouped scan: the same sample, threshold,
    candidates (in the same order) and trim, so the same positions; ``|x|`` is formed only
    for the candidates (``scratch`` receives it in the fallback). ``peaks``: see
    :func:`grouped_positions`."""
    thr = _sample_threshold(x[::SAMPLE_STRIDE].abs(), k, x.numel())
    # a mostly-zero input (threshold 0): |x| >= the least subnormal means x != 0
    return trim_candidates(x, k, grouped_positions(x, _positive(thr), peaks), scratch)


def trim_candidates(
    x: torch.Tensor,
    k: int,
    cand: torch.Tensor,
    scratch: torch.Tensor | None = None,
    mags: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sampled selection's last step: the exact top-``k`` of ``|x|`` among the candidate
    positions ``cand`` (ascending, those with ``|x| >= threshold``), or ``torch.topk`` on all
    of ``|x|`` when fewer than ``k`` passed (``scratch`` receives ``|x|`` then). ``mags``:
    ``|x[cand]|`` when the caller has it."""
    if cand.numel() < k:
        mag = x.abs() if scratch is None else torch.abs(x, out=scratch)
        return torch.topk(mag, k, sorted=False).indices
    if mags is None:
        mags = x.index_select(0, cand).abs_()
    return cand.index_select(0, torch.topk(mags, k, sorted=False).indices)


@dataclass(frozen=True)
class Blocks:
    """Blocks ``x[starts[r] : starts[r] + lengths[r]]`` of a flat tensor, for
    :func:`block_topk_indices`. Build it once per layout and device and keep it: its device
    tensors are copies from the host."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    starts_dev: torch.Tensor
    long_dev: torch.Tensor  # blocks one longer than the shortest

    @classmethod
    def of(cls, starts: Sequence[int], lengths: Sequence[int], device: torch.device) -> Blocks:
        if len(starts) != len(lengths) or not starts:
            raise ValueError("need one length per start, and at least one block")
        if max(lengths) - min(lengths) > 1:
            raise ValueError(f"block lengths differ by more than one: {sorted(set(lengths))}")
        short = min(lengths)
        return cls(
            tuple(starts),
            tuple(lengths),
            torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor([n > short for n in lengths], device=device),
        )


def block_topk_indices(x: torch.Tensor, blocks: Blocks, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest ``|x|`` in each block: ``(len(blocks.starts), k)`` int64.

    The blocks are copied into the rows of one matrix (their common length, plus a column of
    last elements where a block is one longer, padded with -1 elsewhere so padding is never
    chosen) and one ``torch.topk`` runs over every row. On an accelerator that is a handful
    of kernels for a whole message instead of a chain per block, each too small to fill the
    device. ``k`` must not exceed the shortest block. No host sync."""
    short = min(blocks.lengths)
    if k > short:
        raise ValueError(f"k={k} exceeds the shortest block ({short})")
    body = torch.stack([x[s : s + short] for s in blocks.starts])
    if max(blocks.lengths) > short:
        last = x.index_select(0, (blocks.starts_dev + short).clamp_max(x.numel() - 1))
        mag = torch.cat([body, last[:, None]], 1).abs_()
        mag[:, short] = torch.where(blocks.long_dev, mag[:, short], -1.0)
    else:
        mag = body.abs_()
    return blocks.starts_dev[:, None] + torch.topk(mag, k, dim=1, sorted=False).indices


def threshold_indices(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Positions with ``|x| >= threshold`` and ``x != 0`` (zeros are never worth sending).
    A data-dependent length: for tests and references, not for a hook's steady state."""
    mag = x.abs()
    return torch.nonzero((mag >= threshold) & (mag > 0), as_tuple=False).flatten()


def capped_indices(
    x: torch.Tensor, threshold: torch.Tensor | float, cap: int, mag: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed-capacity threshold selection: ``(positions[cap], valid[cap], passing)``.

    The valid entries are the positions with ``|x| >= threshold`` and ``x != 0`` (all of
    them when at most ``cap`` pass, else the ``cap`` largest); the others are padding at
    position 0. ``passing`` (a 0-d int64 tensor) counts all positions that pass, capped or
    not. Nothing is read on the host: on the device path one ``topk`` of ``cap`` over the
    masked magnitudes; the CPU shortcut gathers the candidates first (cheaper, a host
    read of their count). ``mag``: ``|x|`` when the caller has it already."""
    mag = x.abs() if mag is None else mag
    mask = mag >= _positive(threshold)
    passing = torch.count_nonzero(mask)
    cap = min(cap, x.numel())
    if cpu_shortcut(x):
        cand = sparse_positions(mask)
        if cand.numel() > cap:
            cand = cand[torch.topk(mag[cand], cap, sorted=False).indices]
        pad = cap - cand.numel()
        valid = torch.arange(cap, device=x.device) < cand.numel()
        return torch.cat([cand, cand.new_zeros(pad)]), valid, passing
    vals, idx = torch.topk(torch.where(mask, mag, torch.zeros_like(mag)), cap, sorted=False)
    valid = vals > 0
    return torch.where(valid, idx, torch.zeros_like(idx)), valid, passing


def normal_quantile(p: float) -> float:
    """Inverse CDF of the standard normal."""
    return NormalDist().inv_cdf(p)


def gaussian_threshold(
    x: torch.Tensor, k: int, refine: int = 3, mag: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """GaussianK threshold (Shi et al. 2019) and the number of elements that pass it, as
    0-d tensors (no host read).

    Models ``x`` as normal with its sample mean and std and takes the two-sided threshold
    ``|mean| + std * z(1 - rho / 2)`` that a fraction ``rho = k / n`` of ``|x|`` exceeds. The
    estimate is refined up to ``refine`` times: halved when fewer than 2k/3 pass, times 1.5
    when more than 4k/3 pass, and left alone once the count is inside that band. The steps
    are taken on the device with ``where`` (no branch on the count), so every refinement
    costs a pass; the CPU shortcut stops early instead. ``mag``: ``|x|`` when the caller has
    it already (e.g. in a reused buffer)."""
    n = x.numel()
    rho = min(1.0, k / n)
    if rho >= 1.0:
        return x.new_zeros(()), torch.full((), n, device=x.device)
    mean = x.mean()
    std = x.std() if n > 1 else torch.zeros_like(mean)
    thr = _positive(mean.abs() + std * normal_quantile(1.0 - rho / 2.0))
    mag = x.abs() if mag is None else mag
    count = torch.count_nonzero(mag >= thr)
    one = torch.ones_like(thr)
    for _ in range(refine):
        low, high = count < 2 * k / 3, count > 4 * k / 3
        if cpu_shortcut(x) and not bool(low | high):
            break
        thr = thr * torch.where(low, 0.5 * one, torch.where(high, 1.5 * one, one))
        count = torch.count_nonzero(mag >= thr)
    return thr, count


def gaussiank_capacity(k: int) -> int:
    """Pairs a GaussianK payload holds: ``ceil(4k / 3)``, the top of the refinement band,
    so a converged threshold is never trimmed."""
    return math.ceil(4 * k / 3)


def gaussiank_indices(x: torch.Tensor, k: int, refine: int = 3) -> torch.Tensor:
    """Positions selected by the GaussianK threshold (variable count, about ``k``; for
    references: the hook uses ``capped_indices`` with ``gaussiank_capacity``)."""
    if k >= x.numel():
        return torch.arange(x.numel(), device=x.device)
    thr, _ = gaussian_threshold(x, k, refine)
    return threshold_indices(x, thr)


def even_bounds(numel: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries cutting ``numel`` elements into near-equal contiguous parts."""
    return [j * numel // parts for j in range(parts + 1)]
