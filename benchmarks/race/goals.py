"""Issue 18's goals R1-R3 on a held-out zoo's race result, as pre-registered.

The rules are section 2 of ``benchmarks/race/PREREGISTRATION.md``, judged per held-out zoo on
the service's variant (``doc["service"]``), shortlists 3 and 5, from the summary rows of
``run.summarise``:

- **R1**: at some budget of at most 0.2, for k = 3 or k = 5, rel@1 >= 0.99 on every target.
- **R2**: at that configuration, the race order's weighted tau on its shortlist is at least
  0.75 of the seed-to-seed ceiling (mean over targets of the ratio). Where several
  configurations meet R1, "that configuration" is read as the cheapest of them (the lowest
  budget, then the shorter shortlist): what a user who wants R1 would run.
- **R3**: at every budget measured, for k = 3 and k = 5, the race's mean rel@1 is higher than
  the metric's top-1's; a tie is not higher.

A zoo raced on fewer targets than the suite has is judged provisionally, except where a
verdict cannot change: R1 fails for good once every configuration it allows has a target
below 0.99 (more targets only lower a worst case), and R2 fails with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

R1_MAX_BUDGET = 0.2
R1_MIN_REL = 0.99
R2_MIN_RATIO = 0.75
SHORTLISTS = (3, 5)
EPS = 1e-9


@dataclass(frozen=True)
class Verdict:
    goal: str
    met: bool
    final: bool  # False: the zoo is not raced on every target yet and this could change
    detail: str


def _races(doc: dict) -> list[dict]:
    """The summary rows of the service's variant racing a shortlist of 3 or 5."""
    return [
        r
        for r in doc["summary"]
        if r.get("variant") == doc["service"]
        and r["config"].startswith("race k=")
        and r.get("k") in SHORTLISTS
    ]


def judge(doc: dict, expected_targets: Sequence[str]) -> list[Verdict]:
    """R1, R2 and R3 on a race result ``doc`` (``run.py``'s JSON) whose zoo should be raced
    on ``expected_targets``."""
    n = len(doc["targets"])
    complete = set(expected_targets) <= set(doc["targets"])
    rows = _races(doc)
    metric = next(r for r in doc["summary"] if r["config"] == "metric only")

    allowed = [r for r in rows if r["budget"] <= R1_MAX_BUDGET + EPS]
    sure = [r for r in allowed if r["targets"] == n and r["min_rel@1"] >= R1_MIN_REL]
    cheapest = min(sure, key=lambda r: (r["budget"], r["k"]), default=None)
    if cheapest is not None:
        detail = (
            f"k={cheapest['k']} at budget {cheapest['budget']:g}: worst rel@1 "
            f"{cheapest['min_rel@1']:.3f}"
        )
        v1 = Verdict("R1", True, complete, detail)
        ratio = cheapest.get("wtau_vs_ceiling")
        shown = "undefined" if ratio is None else f"{ratio:.3f}"
        detail = (
            f"at k={cheapest['k']}, budget {cheapest['budget']:g}: race order wtau / ceiling "
            f"{shown} (goal {R2_MIN_RATIO})"
        )
        met = ratio is not None and ratio >= R2_MIN_RATIO
        v2 = Verdict("R2", met, complete, detail)
    else:
        if allowed:
            # final only when every configuration R1 allows was raced (on the targets so far)
            r1_budgets = [b for b in doc["protocol"]["budgets"] if b <= R1_MAX_BUDGET + EPS]
            wanted = {(k, b) for k in SHORTLISTS for b in r1_budgets}
            raced = {(r["k"], r["budget"]) for r in allowed if r["targets"] == n}
            best = max(allowed, key=lambda r: (r["min_rel@1"], -r["budget"]))
            detail = (
                f"no k in {SHORTLISTS} at a budget <= {R1_MAX_BUDGET:g} has every target >= "
                f"{R1_MIN_REL}; the closest, k={best['k']} at {best['budget']:g}, has a worst "
                f"rel@1 of {best['min_rel@1']:.3f}"
            )
            v1 = Verdict("R1", False, complete or wanted <= raced, detail)
        else:
            detail = f"no race of the service's variant at a budget <= {R1_MAX_BUDGET:g}"
            v1 = Verdict("R1", False, complete, detail)
        v2 = Verdict("R2", False, v1.final, "no configuration meets R1")

    budgets = doc["protocol"]["budgets"]
    by_key = {(r["k"], r["budget"]): r for r in rows}
    losing: list[str] = []
    for k in SHORTLISTS:
        for b in budgets:
            r = by_key.get((k, b))
            if r is None or r["targets"] != n:
                losing.append(f"k={k} at {b:g} (not raced on every target)")
            elif not r["mean_rel@1"] > metric["mean_rel@1"] + EPS:
                losing.append(f"k={k} at {b:g} ({r['mean_rel@1']:.3f})")
    total = len(SHORTLISTS) * len(budgets)
    detail = f"metric's top-1 mean rel@1 {metric['mean_rel@1']:.3f}; " + (
        f"the race is higher at all {total} (k, budget)"
        if not losing
        else f"not higher at {len(losing)} of {total}: " + ", ".join(losing)
    )
    v3 = Verdict("R3", not losing, complete, detail)
    return [v1, v2, v3]


def report_lines(doc: dict, expected_targets: Sequence[str]) -> list[str]:
    """The report's goals section: held-out zoos only (a development zoo's numbers are
    in-sample and judge nothing)."""
    if doc["role"] != "held out":
        return []
    missing = [t for t in expected_targets if t not in doc["targets"]]
    lines = ["", "## Goals (issue 18), as pre-registered", ""]
    if missing:
        lines += [
            f"Raced on {len(doc['targets'])} of {len(expected_targets)} targets (missing: "
            f"{', '.join(missing)}): a verdict marked *provisional* may change; a final one "
            "cannot (`benchmarks/race/goals.py`).",
            "",
        ]
    for v in judge(doc, expected_targets):
        state = "met" if v.met else "not met"
        lines.append(f"- **{v.goal}**: {state}{'' if v.final else ' (provisional)'}: {v.detail}")
    return lines
