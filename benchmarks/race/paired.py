"""The race's paired rule, a reference the benchmark measures beside the service's.

The metric's order stands unless a challenger is better than the rung's *favourite* (the
surviving candidate the metric ranked highest) on the *same* validation images by more than
their sampling noise explains: a one-sided paired t-test per challenger on per-image score
differences, Holm's correction over the challengers. It was the pre-registered alternative to
halving by validation accuracy on the development zoo and lost there
(``benchmarks/race/PREREGISTRATION.md``, ``benchmarks/results/race_base_variants.md``): the
test bounds the error of "better on these validation images now", but what a race gets wrong
at small budgets is the other step, "better now" to "better after a full fine-tune", which no
test on the validation images sees. Kept as a reference variant (``variants.py``), not in the
service.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SIGNIFICANCE = 0.05
"""The family-wise level of a rung's tests (the conventional 5 %, not tuned)."""


@dataclass(frozen=True)
class Scored:
    """A candidate after a rung: its validation accuracy (None: its rung failed), its place in
    the metric's ranking (0 = best) and its per-image validation scores (higher is better;
    the same images in the same order for every candidate)."""

    model: str
    val_accuracy: float | None
    metric_place: int
    val_scores: tuple[float, ...] | None = None

    @property
    def failed(self) -> bool:
        return self.val_accuracy is None


@dataclass(frozen=True)
class Paired:
    """A challenger against the rung's favourite on the same ``n`` validation images: its
    mean per-image score advantage and the one-sided p-value of "it is better"."""

    advantage: float
    p_value: float
    n: int


def paired_test(challenger: Sequence[float], favourite: Sequence[float]) -> Paired:
    """One-sided paired t-test of "the challenger's mean per-image score is higher" (the
    images are the pairs). The score of a proper rule is bounded or nearly so, so at the
    dozens of images a race validates on the t reference is accurate; two models' scores on
    one image are strongly correlated (both find the same images hard), which pairing removes
    from the noise, so it is far more sensitive than comparing two accuracies."""
    if len(challenger) != len(favourite):
        raise ValueError(
            f"paired scores need the same images: {len(challenger)} and {len(favourite)}"
        )
    n = len(challenger)
    diffs = [float(a) - float(b) for a, b in zip(challenger, favourite, strict=True)]
    mean = math.fsum(diffs) / n if n else 0.0
    if n < 2:
        return Paired(mean, 1.0, n)
    var = math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)
    scale = max(abs(mean), *(abs(d) for d in diffs))
    if var <= (1e-12 * scale) ** 2:  # every image moved by the same amount (or none did)
        return Paired(mean, 0.0 if mean > 1e-12 * scale else 1.0, n)
    from scipy.special import stdtr  # imported here: the API never decides a rung

    t = mean / math.sqrt(var / n)
    return Paired(mean, float(stdtr(n - 1, -t)), n)


def holm(p_values: Mapping[str, float], level: float) -> set[str]:
    """The hypotheses Holm's step-down procedure rejects at family-wise ``level``: sorted
    by p-value, the j-th smallest (from 0) is rejected while p <= level / (m - j)."""
    m = len(p_values)
    rejected: set[str] = set()
    for j, (name, p) in enumerate(sorted(p_values.items(), key=lambda kv: (kv[1], kv[0]))):
        if p > level / (m - j):
            break
        rejected.add(name)
    return rejected


@dataclass(frozen=True)
class Standing:
    """A candidate's place after a rung and why: ``favourite`` (the metric's best of the
    rung's candidates that did not fail), ``better`` or ``worse`` than it on significant
    paired evidence, ``level`` (no significant difference, or nothing to compare), or
    ``failed``. ``versus``: its test against the favourite."""

    result: Scored
    verdict: str
    versus: Paired | None = None


def ranked(results: Sequence[Scored], significance: float = SIGNIFICANCE) -> list[Standing]:
    """The rung's candidates best first: those significantly better than the favourite (by
    mean advantage), the favourite, those level with it (the metric's order), those
    significantly worse (the metric's order), the failed ones (the metric's order).

    Two families of one-sided tests, each with Holm's correction at ``significance``: "better
    than the favourite" (the decision that can overrule the metric) and "worse than it" (which
    only decides who is dropped first among the others). Candidates without per-image scores
    (or scored on other images) are compared with no one: level."""
    by_place = sorted(results, key=lambda r: (r.metric_place, r.model))
    alive = [r for r in by_place if not r.failed]
    failed = [Standing(r, "failed") for r in by_place if r.failed]
    if not alive:
        return failed
    favourite = alive[0]
    mine = favourite.val_scores
    tests: dict[str, Paired] = {}
    reverse: dict[str, Paired] = {}
    for r in alive[1:]:
        if mine is not None and r.val_scores is not None and len(r.val_scores) == len(mine):
            tests[r.model] = paired_test(r.val_scores, mine)
            reverse[r.model] = paired_test(mine, r.val_scores)
    better = holm({m: t.p_value for m, t in tests.items()}, significance)
    worse = holm({m: t.p_value for m, t in reverse.items()}, significance)
    ahead, level, behind = [], [], []
    for r in alive[1:]:
        if r.model in better:
            ahead.append(Standing(r, "better", tests[r.model]))
        elif r.model in worse:
            behind.append(Standing(r, "worse", tests[r.model]))
        else:
            level.append(Standing(r, "level", tests.get(r.model)))
    ahead.sort(key=lambda s: -s.versus.advantage)  # type: ignore[union-attr]
    return [*ahead, Standing(favourite, "favourite"), *level, *behind, *failed]
