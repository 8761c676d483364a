"""The race benchmark's candidates train as a job's rungs do (``benchmarks/race/trainer_pool``):
the config the service's own functions build for a rung (the recipe's options, the rung's
steps, annealed from the rung's start, validated on the selection's share), and a real
candidate trained two rungs by the service's trainer with the recipe's optimizer and rate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.race import trainer_pool
from tests.comm_harness import launch
from tests.conftest import tiny_arrays
from zoopick.training import race, recipe
from zoopick.training.config import CHECKPOINT


@pytest.fixture
def zoo_root(tiny_zoo):
    """A transfer-benchmark zoo folder: the tiny zoo plus one target's train and test files."""
    root = tiny_zoo.parent
    (root / "targets").mkdir()
    for split, seed in (("train", 0), ("test", 1)):
        x, y, names = tiny_arrays(per_class=10, seed=seed)
        np.savez(root / "targets" / f"t-{split}.npz", x=x, y=y, class_names=np.array(names))
    return root


def test_a_rung_is_configured_as_race_step_configures_it(zoo_root, tmp_path):
    rungs = race.plan(3, 30)  # (candidates, steps each, total): (3, 5, 5), (2, 7, 12)
    pool = trainer_pool.TrainerPool(zoo_root, "t", rungs, tmp_path / "w", validation_fraction=0.2)
    cfg = pool.config("tiny-vit", 1)
    assert (cfg.recipe, cfg.workers, cfg.compressor, cfg.hook_options) == ("auto", 1, "dense", {})
    assert (cfg.max_steps, cfg.decay_from, cfg.validation_fraction) == (12, 5, 0.2)
    assert cfg.test_data.endswith("t-test.npz") and not cfg.resume
    plan = recipe.plan(cfg, steps_per_epoch=5, validation=None, rung=True)
    assert (plan.optimizer, plan.lr, plan.lr_source) == (
        "adamw",
        recipe.DEFAULT_LR["adamw"],
        "default",
    )
    assert (plan.label_smoothing, plan.weight_decay) == (0.1, recipe.ADAMW_WEIGHT_DECAY)
    # a job's stored options are read as submitted: a body without "recipe" is still auto
    job = trainer_pool.service_job({"epochs": 2}, rungs)
    assert trainer_pool.options({"epochs": 2}).recipe == "auto" and job.finetune["epochs"] == 2


def _two_rungs(rank: int, world: int, root: str, work: str) -> dict:
    from pathlib import Path

    pool = trainer_pool.TrainerPool(
        Path(root), "t", race.plan(3, 18), Path(work), validation_fraction=0.2
    )  # rung 1: 3 candidates, steps 0-2; rung 2: 2 candidates, steps 3-6
    got = [pool.outputs("tiny-resnet", 1)]  # trains rung 0 first, then resumes for rung 1
    blob = torch.load(Path(work) / "tiny-resnet" / CHECKPOINT, weights_only=False)
    return {
        "outputs": got + [pool.outputs("tiny-resnet", 0)],
        "steps": pool.steps,
        "configs": [(c.max_steps, c.decay_from, c.resume) for c in pool.configs],
        "plan": blob["recipe"]["plan"],
        "lr": blob["recipe"]["lr"],
        "groups": [(g["lr"], g["weight_decay"]) for g in blob["optimizer"]["param_groups"]],
    }


def test_a_candidate_trains_its_rungs_with_the_recipes_optimizer_and_annealed_rate(
    zoo_root, tmp_path
):
    (out,) = launch(_two_rungs, 1, str(zoo_root), str(tmp_path / "work"))
    assert out["configs"] == [(3, 0, False), (7, 3, True)]  # rung 2 resumes rung 1's run
    assert out["steps"] == 7 and [taken for _, taken in out["outputs"]] == [4, 3]
    assert all(0.0 <= acc <= 1.0 for acc, _ in out["outputs"])
    assert (out["plan"]["optimizer"], out["plan"]["label_smoothing"]) == ("adamw", 0.1)
    assert out["lr"] == recipe.DEFAULT_LR["adamw"]
    # the last step (6) of the rung over steps 3-6 at the recipe's rate, annealed from step 3
    last = recipe.DEFAULT_LR["adamw"] * race.rung_lr_factor(6, 3, 7)
    assert out["groups"] == [(pytest.approx(last), recipe.ADAMW_WEIGHT_DECAY)]
