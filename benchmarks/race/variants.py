"""The racing rules the benchmark compares: what judges a rung and how a rung trains.

* ``accuracy``: the service's rule (``zoopick.training.race.ranked``): the better half by
  validation accuracy, ties to the metric's order;
* ``brier`` / ``loglik``: the paired rule (``paired.py``: the metric's favourite stands unless
  a challenger is significantly better on the same validation images) on a per-image proper
  score: minus the Brier score (bounded, in [-2, 0]) or the log-likelihood of the true class
  (unbounded below).

Each comes with a rung schedule (``pool.SCHEDULES``). ``service`` names the pair the service
runs: ``accuracy+cosine`` (``race.survivors``, and ``FinetuneConfig.decay_from`` for the
schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.race import paired
from benchmarks.race.pool import SCHEDULES, Ranker
from zoopick.training import race

SCORES = ("accuracy", "brier", "loglik")


def per_image(score: str, log_probs: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-image validation scores, higher is better."""
    rows = np.arange(len(y))
    if score == "accuracy":
        return (log_probs.argmax(1) == y).astype(np.float64)
    if score == "loglik":
        return log_probs[rows, y]
    if score == "brier":
        p = np.exp(log_probs)
        p[rows, y] -= 1.0
        return -(p * p).sum(1)
    raise ValueError(f"unknown score {score!r}; one of {SCORES}")


@dataclass(frozen=True)
class Variant:
    score: str
    schedule: str

    @property
    def name(self) -> str:
        return f"{self.score}+{self.schedule}"

    def result(self, model: str, log_probs: np.ndarray, place: int, y: np.ndarray) -> Any:
        acc = float((log_probs.argmax(1) == y).mean())
        if self.score == "accuracy":
            return race.Result(model, acc, place)
        scores = tuple(float(v) for v in per_image(self.score, log_probs, y))
        return paired.Scored(model, acc, place, scores)

    def ranker(self, significance: float) -> Ranker:
        if self.score == "accuracy":
            return lambda results: [r.model for r in race.ranked(results)]
        return lambda results: [s.result.model for s in paired.ranked(results, significance)]


SERVICE = Variant("accuracy", "cosine")
"""What the service runs: ``race.survivors`` on validation accuracy, each rung annealed."""
ALL = {v.name: v for v in (Variant(s, sch) for s in SCORES for sch in SCHEDULES)}


def resolve(name: str) -> Variant:
    """A variant by name; ``service``: what the service runs."""
    if name == "service":
        return SERVICE
    try:
        return ALL[name]
    except KeyError:
        raise SystemExit(f"unknown variant {name!r}; one of service, {', '.join(ALL)}") from None
