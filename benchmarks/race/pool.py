"""A race's candidates, trained lazily rung by rung and shared by every rule raced on them.

A candidate's training does not depend on the rule that judges it: the plan fixes how many
steps it has after each rung, and its seeds are its own. So for one (target, shortlist, plan,
schedule) every rule's race can draw on one set of runs: a candidate is trained up to a rung
the first time some rule keeps it that far, and its validation outputs there are kept. Each
rule's race is then exactly the race it would have run alone; its compute is the sum of the
steps of the segments it used, as the training loop counted them.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.transfer.finetune_gt import create_from_entry, model_inputs, stable_seed
from zoopick.selection.data import split_count
from zoopick.training import race

SCHEDULES = ("constant", "cosine")
"""A rung's learning rate: ``constant`` (the first race), or ``cosine`` (the service's:
``race.rung_lr_factor``, from the full rate to near zero over each rung's steps, restarting
at the next rung)."""


def stratified_split(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) indices: each class holds out ``split_count`` images (the service's
    rule), picked by a seeded generator per class."""
    val = []
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        n = split_count(len(members), fraction)
        rng = np.random.default_rng([seed, zlib.crc32(str(int(c)).encode())])
        val.append(rng.choice(members, n, replace=False))
    mask = np.zeros(len(y), dtype=bool)
    mask[np.concatenate(val)] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


def lr_factor(schedule: str, step: int, steps: int) -> float:
    """The learning-rate multiplier of the ``step``-th (from 0) of a rung's ``steps`` steps."""
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":  # the service's trainer: FinetuneConfig.decay_from
        return race.rung_lr_factor(step, 0, steps)
    raise ValueError(f"unknown schedule {schedule!r}; one of {SCHEDULES}")


@dataclass
class Candidate:
    """One model mid-race: weights and optimizer live on between rungs (what the service keeps
    in the candidate's checkpoint), so a rung continues where the last one stopped."""

    model_id: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    gen: torch.Generator
    x_train: torch.Tensor
    x_val: torch.Tensor
    steps: int = 0
    order: list[torch.Tensor] = field(default_factory=list)

    def train(
        self, y: torch.Tensor, steps: int, batch: int, lr: float, schedule: str, device: str
    ) -> int:
        """``steps`` optimizer steps (a new epoch: a fresh seeded shuffle, the last partial
        batch dropped, as the service's trainer does); returns the steps taken, counted."""
        self.model.train()
        taken = 0
        for i in range(steps):
            if not self.order:
                perm = torch.randperm(len(y), generator=self.gen)
                self.order = list(perm[: len(y) // batch * batch].split(batch))
            idx = self.order.pop(0)
            for group in self.opt.param_groups:
                group["lr"] = lr * lr_factor(schedule, i, steps)
            loss = F.cross_entropy(self.model(self.x_train[idx].to(device)), y[idx].to(device))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            taken += 1
        self.steps += taken
        return taken

    @torch.no_grad()
    def log_probs(self, device: str, batch: int = 256) -> np.ndarray:
        """Log-probabilities on the validation images, (n, classes) float64."""
        self.model.eval()
        out = [
            F.log_softmax(self.model(self.x_val[i : i + batch].to(device)).double(), 1).cpu()
            for i in range(0, len(self.x_val), batch)
        ]
        return torch.cat(out).numpy()


@dataclass
class Target:
    """A target's images for the race: the training split less a stratified validation share
    (the test split, where the ground truth's accuracies come from, is never used)."""

    name: str
    classes: int
    n_train: int
    train: Mapping[str, np.ndarray]  # the race's training images (x, y, class_names)
    val: Mapping[str, np.ndarray]
    y_train: torch.Tensor
    y_val: np.ndarray


def split_target(name: str, train: Mapping[str, np.ndarray], fraction: float, seed: int) -> Target:
    tr, va = stratified_split(train["y"], fraction, seed)
    part = {k: train[k] for k in ("class_names",)}
    return Target(
        name=name,
        classes=len(train["class_names"]),
        n_train=len(train["y"]),
        train={**part, "x": train["x"][tr], "y": train["y"][tr]},
        val={**part, "x": train["x"][va], "y": train["y"][va]},
        y_train=torch.from_numpy(train["y"][tr]).long(),
        y_val=train["y"][va].astype(np.int64),
    )


@dataclass(frozen=True)
class Recipe:
    """How every candidate trains (Adam at ``lr``, full fine-tuning, a fresh head)."""

    lr: float
    batch_size: int
    schedule: str
    seed: int
    device: str = "cpu"


class Pool:
    """The shortlist's candidates under one plan and recipe, trained only as far as some rule
    needs them: :meth:`outputs` returns a candidate's validation log-probabilities after rung
    ``r`` and the steps that rung's segment took."""

    def __init__(
        self,
        entries: Mapping[str, dict[str, Any]],
        root: Path,
        target: Target,
        rungs: Sequence[race.Rung],
        recipe: Recipe,
    ) -> None:
        self.entries, self.root, self.target = entries, root, target
        self.rungs, self.recipe = list(rungs), recipe
        self.live: dict[str, Candidate] = {}
        self.seen: dict[tuple[str, int], tuple[np.ndarray, int]] = {}
        self.steps = 0  # every step trained for this pool, whichever rule asked
        self.seconds = 0.0

    def _make(self, model_id: str) -> Candidate:
        entry, r = self.entries[model_id], self.recipe
        torch.manual_seed(stable_seed("race", self.target.name, model_id, r.seed))
        model = create_from_entry(entry, self.root, self.target.classes).to(r.device)
        x_train = model_inputs(entry, self.root, model, self.target.train)
        x_val = model_inputs(entry, self.root, model, self.target.val)
        opt = torch.optim.Adam(model.parameters(), lr=r.lr)
        order_seed = stable_seed("order", self.target.name, model_id, r.seed)
        gen = torch.Generator().manual_seed(order_seed)
        return Candidate(model_id, model, opt, gen, x_train, x_val)

    def outputs(self, model_id: str, rung: int) -> tuple[np.ndarray, int]:
        key = (model_id, rung)
        if key not in self.seen:
            if rung > 0 and (model_id, rung - 1) not in self.seen:
                self.outputs(model_id, rung - 1)
            if model_id not in self.live:
                self.live[model_id] = self._make(model_id)
            cand = self.live[model_id]
            target_steps = self.rungs[rung].total_steps
            assert cand.steps == target_steps - self.rungs[rung].steps_each, "rungs in order"
            t0 = time.perf_counter()
            r = self.recipe
            taken = cand.train(
                self.target.y_train, self.rungs[rung].steps_each, r.batch_size, r.lr,
                r.schedule, r.device,
            )  # fmt: skip
            assert cand.steps == target_steps
            self.seen[key] = (cand.log_probs(r.device), taken)
            self.steps += taken
            self.seconds += time.perf_counter() - t0
        return self.seen[key]


Ranker = Callable[[list[race.Result]], list[str]]


def run_race(
    pool: Pool,
    shortlist: Sequence[str],
    result_of: Callable[[str, np.ndarray, int], race.Result],
    rank: Ranker,
) -> dict[str, Any]:
    """One race over ``shortlist`` (best first by the metric) on ``pool``'s plan: each rung's
    candidates are judged by ``rank`` (best first), the plan's rung sizes say how many go
    on. Returns the winner, the race's order of the whole shortlist (best first: the last
    rung's order, then those dropped at each earlier rung in that rung's order), the compute
    it spent (counted steps of the segments it used) and each rung's accuracies."""
    place = {m: i for i, m in enumerate(shortlist)}
    alive, tail, spent, log = list(shortlist), [], 0, []
    for r in pool.rungs:
        results = []
        for m in alive:
            log_probs, taken = pool.outputs(m, r.index)
            spent += taken
            results.append(result_of(m, log_probs, place[m]))
        keep = pool.rungs[r.index + 1].candidates if r.index + 1 < len(pool.rungs) else 1
        order = rank(results)
        tail = order[keep:] + tail
        alive = order[:keep]
        log.append({x.model: round(x.val_accuracy or 0.0, 4) for x in results})
    return {"winner": alive[0], "order": alive + tail, "steps": spent, "rungs": log}
