"""Issue 18's goals R1-R3 (``benchmarks/race/goals.py``) on hand-made race results."""

from __future__ import annotations

from benchmarks.race.goals import judge, report_lines

TARGETS = ["a", "b", "c"]
BUDGETS = [0.05, 0.2, 1.0]


def _row(k: int, budget: float, rels: list[float], ratio: float | None, variant: str = "svc"):
    return {
        "config": f"race k={k}",
        "variant": variant,
        "k": k,
        "budget": budget,
        "targets": len(rels),
        "mean_rel@1": sum(rels) / len(rels),
        "min_rel@1": min(rels),
        "wtau_vs_ceiling": ratio,
    }


def _doc(rows: list[dict], metric: list[float], targets: list[str] = TARGETS) -> dict:
    return {
        "role": "held out",
        "service": "svc",
        "protocol": {"budgets": BUDGETS},
        "targets": {t: {} for t in targets},
        "summary": [
            {
                "config": "metric only",
                "targets": len(metric),
                "mean_rel@1": sum(metric) / len(metric),
                "min_rel@1": min(metric),
            },
            *rows,
        ],
    }


def _verdicts(doc: dict, expected: list[str] = TARGETS) -> dict[str, tuple[bool, bool]]:
    return {v.goal: (v.met, v.final) for v in judge(doc, expected)}


def _everywhere(rels: list[float], ratio: float = 0.8) -> list[dict]:
    return [_row(k, b, rels, ratio) for k in (3, 5) for b in BUDGETS]


def test_all_met_when_a_cheap_race_is_sure_and_every_race_beats_the_metric():
    rows = _everywhere([0.995, 0.999, 1.0])
    assert _verdicts(_doc(rows, metric=[0.95, 1.0, 1.0])) == {
        "R1": (True, True),
        "R2": (True, True),
        "R3": (True, True),
    }


def test_r1_needs_every_target_and_a_budget_of_at_most_a_fifth():
    rows = _everywhere([0.98, 1.0, 1.0])  # one target below 0.99 everywhere
    rows += [_row(3, 1.0, [1.0, 1.0, 1.0], 0.9)]  # sure, but at budget 1: not R1's
    rows = [r for r in rows if not (r["k"] == 3 and r["budget"] == 1.0 and r["min_rel@1"] < 0.99)]
    v = _verdicts(_doc(rows, metric=[0.9, 0.9, 0.9]))
    assert v["R1"] == (False, True) and v["R2"] == (False, True)


def test_r2_is_judged_at_the_cheapest_configuration_meeting_r1():
    rows = _everywhere([0.98, 1.0, 1.0])
    rows = [r for r in rows if (r["k"], r["budget"]) not in {(5, 0.2), (3, 0.2)}]
    rows += [_row(5, 0.2, [0.995, 1.0, 1.0], 0.9), _row(3, 0.2, [0.995, 1.0, 1.0], 0.5)]
    v = judge(_doc(rows, metric=[0.9, 0.9, 0.9]), TARGETS)
    assert v[0].met and "k=3 at budget 0.2" in v[0].detail
    assert not v[1].met and "0.500" in v[1].detail  # k=3 (cheaper than k=5) decides


def test_r3_a_tie_with_the_metric_is_not_higher():
    tie = [0.995, 0.999, 1.0]
    rows = _everywhere([1.0, 1.0, 1.0])
    rows = [r for r in rows if (r["k"], r["budget"]) != (5, 1.0)] + [_row(5, 1.0, tie, 0.8)]
    v = judge(_doc(rows, metric=[0.99, 0.999, 1.0]), TARGETS)
    assert v[2].met  # every race above the metric's 0.9963
    v = judge(_doc(rows, metric=tie), TARGETS)
    assert not v[2].met and "1 of 6" in v[2].detail and "k=5 at 1" in v[2].detail


def test_other_variants_and_the_whole_zoo_do_not_count():
    rows = [_row(k, b, [0.5, 0.5, 0.5], 0.0) for k in (3, 5) for b in BUDGETS]  # service: bad
    rows += [_row(k, b, [1.0, 1.0, 1.0], 1.0, variant="other") for k in (3, 5) for b in BUDGETS]
    whole = _row(18, 0.2, [1.0, 1.0, 1.0], 1.0)
    whole["config"] = "every model (k=18)"
    v = _verdicts(_doc([*rows, whole], metric=[0.9, 0.9, 0.9]))
    assert v == {"R1": (False, True), "R2": (False, True), "R3": (False, True)}


def test_a_partial_zoo_is_provisional_except_a_failed_r1():
    partial = TARGETS[:2]
    sure = _doc(_everywhere([0.995, 1.0]), metric=[0.9, 0.9], targets=partial)
    assert _verdicts(sure) == {"R1": (True, False), "R2": (True, False), "R3": (True, False)}
    unsure = _doc(_everywhere([0.98, 1.0]), metric=[0.9, 0.9], targets=partial)
    assert _verdicts(unsure)["R1"] == (False, True)  # more targets cannot raise a worst case
    # ... unless a configuration R1 allows has not been raced yet
    gap = [r for r in _everywhere([0.98, 1.0]) if (r["k"], r["budget"]) != (5, 0.05)]
    assert _verdicts(_doc(gap, metric=[0.9, 0.9], targets=partial))["R1"] == (False, False)
    lines = "\n".join(report_lines(unsure, TARGETS))
    assert "2 of 3 targets (missing: c)" in lines and "(provisional)" in lines


def test_a_development_zoo_is_not_judged():
    doc = _doc(_everywhere([1.0, 1.0, 1.0]), metric=[0.9, 0.9, 0.9])
    doc["role"] = "development"
    assert report_lines(doc, TARGETS) == []
