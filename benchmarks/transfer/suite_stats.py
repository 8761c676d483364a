"""The transfer suite's arithmetic, kept apart from the runs so it can be checked on a
hand-made table: rank ensembles, the pre-registered rule that picks the default ``select_by``
(``PREREGISTRATION.md``), leave-one-zoo-out, and the bootstrap interval over targets.

A *table* maps a candidate (a metric, a metric variant or an ensemble) to its weighted tau in
every cell, keyed ``(zoo, target)``. Nothing here imports torch or zoopick.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from scipy.stats import rankdata

Cell = tuple[str, str]  # (zoo, target)
Table = Mapping[str, Mapping[Cell, float]]

TIE = 0.01  # candidates this close to the best mean weighted tau tie (the rule's tie band)
WITHIN = 0.02  # the goal: the pick is first or within this of first on a held-out zoo
BOOTSTRAP = 2000  # resamples of the interval
BOOTSTRAP_SEED = 20


def rank_ensemble(scores: Mapping[str, Mapping[str, float]], members: Sequence[str]) -> dict:
    """A fixed rank ensemble: each member's scores ranked over the zoo (1 = worst, ties share
    their mean rank, an undefined score ranks below every model), the ranks averaged. Higher
    is better, like every metric."""
    models = list(next(iter(scores.values())))
    total = np.zeros(len(models))
    for name in members:
        s = np.array([scores[name][m] for m in models], dtype=float)
        s = np.where(np.isfinite(s), s, -np.inf)
        total += rankdata(s, method="average")
    return dict(zip(models, (total / len(members)).tolist(), strict=True))


def _value(v: float | None) -> float:
    """An undefined weighted tau (a metric that scores every model alike) counts as 0: no
    information about the order."""
    return 0.0 if v is None or not math.isfinite(v) else float(v)


def zoo_means(table: Table, candidate: str, zoos: Iterable[str]) -> dict[str, float]:
    """The candidate's mean weighted tau over each zoo's cells (zoos without a cell left out)."""
    out = {}
    cells = table[candidate]
    for z in zoos:
        vals = [_value(v) for (zz, _), v in cells.items() if zz == z]
        if vals:
            out[z] = float(np.mean(vals))
    return out


def pick(table: Table, zoos: Sequence[str], candidates: Sequence[str] | None = None) -> dict:
    """The pre-registered rule on the cells of ``zoos``:

    1. each candidate's score is the mean over ``zoos`` of its mean weighted tau per zoo
       (every zoo weighs the same);
    2. every candidate within :data:`TIE` of the best score ties;
    3. among the tied, the highest worst-zoo mean wins (a default is only as good as its worst
       zoo); then the higher score; then the name, alphabetically.

    Returns the pick and, per candidate, its score, worst zoo mean and whether it tied."""
    candidates = list(candidates if candidates is not None else table)
    rows = {}
    for c in candidates:
        means = zoo_means(table, c, zoos)
        if len(means) != len(zoos):
            raise ValueError(
                f"candidate {c!r} has no cell in zoos {sorted(set(zoos) - set(means))}"
            )
        rows[c] = {"score": float(np.mean(list(means.values()))), "worst": min(means.values())}
    best = max(r["score"] for r in rows.values())
    for r in rows.values():
        r["tied"] = r["score"] >= best - TIE - 1e-12
    tied = [c for c in candidates if rows[c]["tied"]]
    chosen = min(tied, key=lambda c: (-rows[c]["worst"], -rows[c]["score"], c))
    return {"pick": chosen, "rows": rows}


def leave_one_zoo_out(
    table: Table, zoos: Sequence[str], candidates: Sequence[str] | None = None
) -> dict[str, dict]:
    """For each zoo held out: the rule's pick on the other zoos, its mean weighted tau on the
    held-out zoo, the best candidate there, and whether the pick is within :data:`WITHIN`."""
    candidates = list(candidates if candidates is not None else table)
    out = {}
    for held in zoos:
        rest = [z for z in zoos if z != held]
        chosen = pick(table, rest, candidates)["pick"]
        on_held = {c: zoo_means(table, c, [held])[held] for c in candidates}
        best = max(candidates, key=lambda c: (on_held[c], c))
        gap = on_held[best] - on_held[chosen]
        out[held] = {
            "trained_on": rest,
            "pick": chosen,
            "pick_wtau": on_held[chosen],
            "best": best,
            "best_wtau": on_held[best],
            "gap": gap,
            "rank": 1 + sum(on_held[c] > on_held[chosen] for c in candidates),
            "within": gap <= WITHIN + 1e-12,
        }
    return out


def bootstrap_over_targets(
    values: Mapping[Cell, float], *, resamples: int = BOOTSTRAP, seed: int = BOOTSTRAP_SEED
) -> dict[str, float]:
    """Mean over the cells and a 95 % percentile interval from resampling *targets* with
    replacement (a drawn target brings its cell in every zoo: the same target in two zoos is
    not two independent draws)."""
    targets = sorted({t for _, t in values})
    by_target = {t: [_value(v) for (_, tt), v in values.items() if tt == t] for t in targets}
    sums = np.array([sum(by_target[t]) for t in targets])
    counts = np.array([len(by_target[t]) for t in targets])
    mean = float(sums.sum() / counts.sum())
    if len(targets) < 2:
        return {"mean": mean, "lo": float("nan"), "hi": float("nan"), "targets": len(targets)}
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(targets), size=(resamples, len(targets)))
    boot = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"mean": mean, "lo": float(lo), "hi": float(hi), "targets": len(targets)}
