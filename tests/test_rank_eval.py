"""Evaluation helpers against hand-computed cases and a plain Kendall tau."""

import itertools
import math

import numpy as np
import pytest

from zoopick.selection.rank import evaluate, rel_at_k, tie_groups


def plain_kendall_tau_a(x, y):
    """Concordant minus discordant pairs over all pairs (no ties in the inputs used)."""
    pairs = list(itertools.combinations(range(len(x)), 2))
    s = sum(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in pairs)
    return s / len(pairs)


def test_tie_groups_orders_high_first_and_groups_equal():
    assert tie_groups([0.2, 0.9, 0.5, 0.9]) == [[1, 3], [2], [0]]
    assert tie_groups([1.0, 1.0 + 1e-12]) == [[1, 0]]


def test_rel_at_k_hand_case():
    truth = {"a": 0.9, "b": 0.6, "c": 0.8, "d": 0.3}
    scores = {"a": 0.1, "b": 0.9, "c": 0.5, "d": 0.7}
    # order by score: b (0.6), d (0.3), c (0.8), a (0.9)
    assert rel_at_k(scores, truth, 1) == pytest.approx(0.6 / 0.9)
    assert rel_at_k(scores, truth, 3) == pytest.approx(0.8 / 0.9)
    assert rel_at_k(scores, truth, 4) == pytest.approx(1.0)


def test_rel_at_k_tie_is_pessimistic():
    truth = {"a": 0.9, "b": 0.5, "c": 0.1}
    scores = {"a": 1.0, "b": 1.0, "c": 0.0}
    assert rel_at_k(scores, truth, 1) == pytest.approx(0.5 / 0.9)
    assert rel_at_k(scores, truth, 2) == pytest.approx(1.0)


def test_evaluate_matches_plain_tau_and_perfect_order():
    rng = np.random.default_rng(0)
    t = rng.random(7)
    s = t + rng.normal(0, 0.2, 7)
    ids = [f"m{i}" for i in range(7)]
    out = evaluate(dict(zip(ids, s, strict=True)), dict(zip(ids, t, strict=True)))
    assert out["kendall_tau"] == pytest.approx(plain_kendall_tau_a(s, t))
    assert out["pearson"] == pytest.approx(np.corrcoef(s, t)[0, 1])
    perfect = evaluate(dict(zip(ids, t, strict=True)), dict(zip(ids, t, strict=True)))
    assert perfect["weighted_tau"] == pytest.approx(1.0)
    assert perfect["rel@1"] == 1.0
    reverse = evaluate(dict(zip(ids, -t, strict=True)), dict(zip(ids, t, strict=True)))
    assert reverse["weighted_tau"] == pytest.approx(-1.0)


def test_evaluate_constant_scores_give_nan_correlation_not_crash():
    out = evaluate({"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 0.2, "b": 0.9, "c": 0.5})
    assert math.isnan(out["pearson"])
    assert out["rel@1"] == pytest.approx(0.2 / 0.9)


def test_evaluate_rejects_mismatched_models():
    with pytest.raises(ValueError, match="different models"):
        evaluate({"a": 1.0, "b": 2.0}, {"a": 1.0, "c": 2.0})
