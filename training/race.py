"""Two-stage selection's second stage: racing the metric's shortlist with short fine-tunes.

The metric ranks every model from one forward pass; the ``shortlist`` best then race. Each
rung trains the survivors further (resuming their own runs, never restarting), validates them
on a stratified share of the training split (never the test split), and keeps the better half
(successive halving: Jamieson and Talwalkar 2016, the rule Hyperband is built on); the last
one standing is chosen, and the final fine-tune starts from its race checkpoint.

Each rung anneals: its learning rate falls from the run's rate down a cosine to near zero
over the rung's steps and restarts at the next rung (:func:`rung_lr_factor`; SGDR's warm
restarts, Loshchilov and Hutter 2017). A rung is judged by where its run ends, and a run
validated at a constant high rate is judged at an arbitrary point of a noisy trajectory, which
ranks how fast a model starts more than where a full fine-tune (whose rate decays) ends; an
annealed run's accuracy is the short version of the full one's. Chosen on the development zoo
by a rule fixed beforehand (``benchmarks/race/PREREGISTRATION.md``): it beat the constant
rate under every judging rule tried there.

The budget is in epochs of the race's training images summed over every candidate and rung
(one epoch: one pass over the training split minus its validation share), turned into
optimizer steps once, before the race starts, and split equally between the rungs and, in a
rung, between its candidates. Every rung runs whole numbers of steps and the sum never
exceeds the budget: what a candidate trains is counted by the trainer (its checkpoint's step
count), not estimated.

Torch-free: the API checks a submission's plan (and refuses a budget too small to give every
shortlisted model one step) without loading the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ETA = 2
"""Successive halving's reduction factor: each rung keeps the better half (rounded up)."""


class SelectionOptions(BaseModel):
    """A job's ``selection``: race the ``shortlist`` best models by the metric, spending
    ``budget_epochs`` in all. Without it a job's metric alone picks."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    shortlist: int = Field(
        3,
        ge=2,
        le=64,
        description="How many of the metric's best models race, at most: a job with fewer "
        "models races them all (the job's `race.shortlist` lists the racers).",
    )
    budget_epochs: float = Field(
        3.0,
        gt=0,
        le=10_000,
        description="Training the race may spend, in epochs of the race's training images "
        "summed over every candidate and rung (3: as much as one default fine-tune). Split "
        "equally between the rungs and, in a rung, between its candidates; never exceeded.",
    )
    validation_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="Stratified share of the training split the candidates are validated on "
        "(the test split is never used by the race).",
    )

    @classmethod
    def stored(cls, data: Mapping[str, Any]) -> SelectionOptions:
        """A job's ``selection`` as its row stored it (validated when the job was submitted):
        read back without validating again; fields added since take their defaults."""
        return cls.model_construct(**{k: v for k, v in data.items() if k in cls.model_fields})


class BudgetTooSmall(ValueError):
    """The budget cannot give every candidate of some rung one optimizer step."""


@dataclass(frozen=True)
class Rung:
    """One rung: ``candidates`` models each train ``steps_each`` more steps, reaching
    ``total_steps`` each."""

    index: int
    candidates: int
    steps_each: int
    total_steps: int


def rung_sizes(shortlist: int) -> list[int]:
    """Candidates per rung: ``k``, then the better half rounded up, down to the last two
    (the last rung decides between them): 5 -> [5, 3, 2], 4 -> [4, 2], 3 -> [3, 2]."""
    sizes = [shortlist]
    while sizes[-1] > 2:
        sizes.append(math.ceil(sizes[-1] / ETA))
    return sizes


def plan(shortlist: int, budget_steps: int) -> list[Rung]:
    """The rungs of a race of ``shortlist`` models with ``budget_steps`` optimizer steps in
    all: each rung gets an equal share of the budget, split equally between its candidates
    (the sum of ``candidates * steps_each`` is at most ``budget_steps``)."""
    if shortlist < 2:
        raise ValueError("a race needs at least 2 models")
    sizes = rung_sizes(shortlist)
    per_rung = budget_steps // len(sizes)
    rungs: list[Rung] = []
    total = 0
    for index, n in enumerate(sizes):
        each = per_rung // n
        if each < 1:
            raise BudgetTooSmall(
                f"a budget of {budget_steps} step(s) gives each of the {n} models of rung "
                f"{index + 1} of {len(sizes)} less than one step"
            )
        total += each
        rungs.append(Rung(index, n, each, total))
    return rungs


def race_train_size(
    counts: Mapping[str, int],
    *,
    test_fraction: float,
    validation_fraction: float,
    max_per_class: int | None,
) -> int:
    """Images the race trains on: each class capped at ``max_per_class``, less its test share
    and then its validation share, by the trainer's own split rule
    (``selection.data.split_count``)."""
    from zoopick.selection.data import training_count

    return training_count(
        counts.values(),
        max_per_class=max_per_class,
        fractions=(test_fraction, validation_fraction),
    )


def steps_per_epoch(train_images: int, batch_size: int) -> int:
    """Optimizer steps of one epoch on one worker (the trainer drops the last partial batch)."""
    if train_images < 2:
        return 0
    return train_images // min(batch_size, train_images)


def budget_steps(budget_epochs: float, epoch_steps: int) -> int:
    return int(math.floor(budget_epochs * epoch_steps + 1e-9))


@dataclass(frozen=True)
class Result:
    """A candidate after a rung: its validation accuracy (None when its rung failed) and its
    place in the metric's ranking (0 = the metric's best), which breaks ties."""

    model: str
    val_accuracy: float | None
    metric_place: int


def rung_lr_factor(step: int, start: int, end: int) -> float:
    """The learning-rate multiplier of optimizer step ``step`` (counted from the run's start,
    0-based) of a rung that trains steps ``start`` to ``end - 1``: a cosine from 1 at its
    first step towards 0 after its last, ``(1 + cos(pi (step - start) / (end - start))) / 2``."""
    if not start <= step < end:
        raise ValueError(f"step {step} is not in the rung's steps {start}..{end - 1}")
    return 0.5 * (1.0 + math.cos(math.pi * (step - start) / (end - start)))


def ranked(results: Sequence[Result]) -> list[Result]:
    """Best first by validation accuracy; failed candidates last; ties to the metric's
    order."""
    return sorted(
        results,
        key=lambda r: (r.val_accuracy is None, -(r.val_accuracy or 0.0), r.metric_place),
    )


def survivors(results: Sequence[Result], keep: int) -> list[str]:
    """The ``keep`` best by validation accuracy; ties (and failed candidates, which rank
    last) go to the metric's order."""
    order = ranked(results)
    return [r.model for r in order[:keep] if r.val_accuracy is not None]


def why_won(results: Sequence[Result], steps: int) -> str:
    """One sentence on the last rung: who won, by how much, after how many steps."""
    order = ranked(results)
    best = order[0]
    text = (
        f"{best.model} won the last rung with validation accuracy "
        f"{best.val_accuracy:.4f} after {steps} steps"
    )
    if len(order) > 1:
        other = order[1]
        acc = "failed" if other.val_accuracy is None else f"{other.val_accuracy:.4f}"
        text += f" (runner-up {other.model}: {acc})"
        if other.val_accuracy == best.val_accuracy:
            text += "; tied, so the metric's order decided"
    return text + f"; it was #{best.metric_place + 1} by the metric"
