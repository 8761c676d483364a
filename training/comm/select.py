"""Selection primitives shared by the sparse hooks (all return int64 positions).

Every selector treats ``k >= numel`` as "everything", so density 1.0 degenerates to a dense
exchange and reproduces the dense average exactly.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch


def k_for(density: float, numel: int) -> int:
    """Number of elements to keep: ``ceil(density * numel)``, at least 1 when numel > 0.

    The product is rounded to 9 digits first so 0.07 * 100 gives 7, not 8."""
    if numel <= 0:
        return 0
    return max(1, min(numel, math.ceil(round(density * numel, 9))))


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest ``|x|`` (exact, unordered)."""
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=x.device)
    return torch.topk(x.abs(), k, sorted=False).indices


def threshold_indices(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Positions with ``|x| >= threshold`` and ``x != 0`` (zeros are never worth sending)."""
    mag = x.abs()
    return torch.nonzero((mag >= threshold) & (mag > 0), as_tuple=False).flatten()


def normal_quantile(p: float) -> float:
    """Inverse CDF of the standard normal."""
    return NormalDist().inv_cdf(p)


def gaussian_threshold(x: torch.Tensor, k: int, refine: int = 3) -> tuple[float, int]:
    """GaussianK threshold (Shi et al. 2019) and the number of elements that pass it.

    Models ``x`` as normal with its sample mean and std and takes the two-sided threshold
    ``|mean| + std * z(1 - rho / 2)`` that a fraction ``rho = k / n`` of ``|x|`` exceeds. The
    estimate is refined up to ``refine`` times: halved when fewer than 2k/3 pass, times 1.5
    when more than 4k/3 pass."""
    n = x.numel()
    rho = min(1.0, k / n)
    if rho >= 1.0:
        return 0.0, n
    mean = float(x.mean())
    std = float(x.std()) if n > 1 else 0.0
    thr = abs(mean) + std * normal_quantile(1.0 - rho / 2.0)
    mag = x.abs()
    count = int(((mag >= thr) & (mag > 0)).sum())
    for _ in range(refine):
        if count < 2 * k / 3:
            thr *= 0.5
        elif count > 4 * k / 3:
            thr *= 1.5
        else:
            break
        count = int(((mag >= thr) & (mag > 0)).sum())
    return thr, count


def gaussiank_indices(x: torch.Tensor, k: int, refine: int = 3) -> torch.Tensor:
    """Positions selected by the GaussianK threshold (variable count, about ``k``)."""
    if k >= x.numel():
        return torch.arange(x.numel(), device=x.device)
    thr, _ = gaussian_threshold(x, k, refine)
    return threshold_indices(x, thr)


def even_bounds(numel: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries cutting ``numel`` elements into near-equal contiguous parts."""
    return [j * numel // parts for j in range(parts + 1)]
