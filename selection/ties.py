"""Ties between scores: which models a metric cannot tell apart.

Plain Python (no numpy), so the API can rank a job's stored scores on every poll without
importing the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def tie_groups(values: Sequence[float], *, rel_tol: float = 1e-9) -> list[list[int]]:
    """Indices grouped by value, highest first; values equal within ``rel_tol`` share a group.

    Equality is judged against the group's first value, so a slow drift never chains distinct
    values into one group.
    """
    order = sorted(range(len(values)), key=lambda i: -values[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and math.isclose(
            values[i], values[groups[-1][0]], rel_tol=rel_tol, abs_tol=1e-12
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
