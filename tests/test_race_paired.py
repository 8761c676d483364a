"""The benchmark's paired racing rule (``benchmarks/race/paired.py``), a reference variant
beside the service's: its statistics against scipy and by hand, its decisions on hand-made
validation outcomes (a challenger with a significant paired advantage goes ahead of the
metric's favourite, a noisy one does not), and the per-image scores it is fed."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.race import paired


def _first(results, significance=paired.SIGNIFICANCE) -> str:
    return paired.ranked(results, significance)[0].result.model


def _scores(correct: list[int], confidence: float = 0.9) -> tuple[float, ...]:
    """Hand-made per-image scores: minus the Brier score of a two-class prediction that puts
    ``confidence`` on the true class where ``correct`` says 1, on the other class where 0."""
    return tuple(-2 * (1 - confidence) ** 2 if c else -2 * confidence**2 for c in correct)


def test_paired_test_matches_scipys_paired_t_test():
    from scipy import stats

    rng = np.random.default_rng(0)
    a, b = rng.normal(0.1, 1, 40), rng.normal(0, 1, 40)
    got = paired.paired_test(tuple(a), tuple(b))
    want = stats.ttest_rel(a, b, alternative="greater")
    assert got.n == 40 and got.advantage == pytest.approx(float(np.mean(a - b)))
    assert got.p_value == pytest.approx(want.pvalue, rel=1e-9)
    # every image better by the same amount: certain; no difference at all: no evidence
    assert paired.paired_test((1.0, 2.0), (0.5, 1.5)).p_value == 0.0
    assert paired.paired_test((1.0, 2.0), (1.0, 2.0)).p_value == 1.0
    with pytest.raises(ValueError, match="same images"):
        paired.paired_test((1.0,), (1.0, 2.0))


def test_holm_rejects_step_down():
    # m = 3: 0.01 <= 0.05/3, 0.02 <= 0.05/2, 0.06 > 0.05/1: two rejected
    assert paired.holm({"a": 0.02, "b": 0.01, "c": 0.06}, 0.05) == {"a", "b"}
    # 0.02 > 0.05/3 stops at once, though 0.04 <= 0.05/2 alone would pass
    assert paired.holm({"a": 0.02, "b": 0.04, "c": 0.9}, 0.05) == set()
    assert paired.holm({}, 0.05) == set()


def test_a_challenger_replaces_the_favourite_only_on_significant_paired_evidence():
    base = [1] * 30 + [0] * 30  # the favourite gets 30 of 60 validation images right
    # "strong" also gets 12 of the favourite's misses right and loses none: 0.70 vs 0.50
    strong = [1] * 30 + [1] * 12 + [0] * 18
    # "noisy" is ahead on accuracy too (0.55), but trades images with the favourite: 9 won,
    # 6 lost; the favourite's order stands
    noisy = [1] * 24 + [0] * 6 + [1] * 9 + [0] * 21
    results = [
        paired.Scored("fav", 0.50, 0, _scores(base)),
        paired.Scored("noisy", 0.55, 1, _scores(noisy)),
        paired.Scored("strong", 0.70, 2, _scores(strong)),
        paired.Scored("failed", None, 3),
    ]
    order = paired.ranked(results)
    assert [(s.result.model, s.verdict) for s in order] == [
        ("strong", "better"), ("fav", "favourite"), ("noisy", "level"), ("failed", "failed"),
    ]  # fmt: skip
    assert order[0].versus.p_value < 0.001 and order[2].versus.p_value > 0.1
    # without the strong one, halving by accuracy would crown "noisy"; this rule keeps "fav"
    rest = [r for r in results if r.model != "strong"]
    assert _first(rest) == "fav"
    # a stricter level needs more evidence: the p-value of "strong" is about 1.5e-4
    assert _first(results, significance=1e-6) == "fav"


def test_significantly_worse_candidates_drop_first_and_unscored_ones_stay_level():
    base = [1] * 40 + [0] * 20
    worse = [0] * 15 + [1] * 25 + [0] * 20  # loses 15 of the favourite's images, wins none
    results = [
        paired.Scored("fav", 40 / 60, 0, _scores(base)),
        paired.Scored("worse", 25 / 60, 1, _scores(worse)),
        paired.Scored("old", 0.9, 2),  # no per-image scores: nothing to pair it with
    ]
    assert [(s.result.model, s.verdict) for s in paired.ranked(results)] == [
        ("fav", "favourite"), ("old", "level"), ("worse", "worse"),
    ]  # fmt: skip
    # the favourite failed: the next by the metric is the favourite now
    results[0] = paired.Scored("fav", None, 0)
    assert _first(results) == "worse"


def test_per_image_scores_by_hand():
    from benchmarks.race.variants import per_image

    # p = (1/2, 1/2) with true class 0; p = (3/4, 1/4) with true class 1
    log_probs, y = np.log([[0.5, 0.5], [0.75, 0.25]]), np.array([0, 1])
    assert per_image("brier", log_probs, y) == pytest.approx([-0.5, -(0.75**2) * 2])
    assert per_image("loglik", log_probs, y) == pytest.approx([np.log(0.5), np.log(0.25)])
    assert per_image("accuracy", log_probs, y).tolist() == [1.0, 0.0]
