"""Two-stage selection's race, as a library: the plan (hand-computed cases), the halving rule,
and the trainer's part on a real gloo process group: a run stopped at ``max_steps`` mid-epoch
and resumed ends where one straight run ends, it validates on a share of the training split
(never the test split), and a later run starts from its checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.comm_harness import launch
from tests.test_finetune import _cfg as finetune_cfg
from tests.test_finetune import _run_many
from zoopick.training import race
from zoopick.training.config import (
    CHECKPOINT,
    FINAL_WEIGHTS,
    METRICS,
    EpochRecord,
    FinetuneConfig,
    parse_line,
)


def test_rung_sizes_halve_rounding_up_to_a_final_pair():
    assert race.rung_sizes(2) == [2]
    assert race.rung_sizes(3) == [3, 2]
    assert race.rung_sizes(4) == [4, 2]
    assert race.rung_sizes(5) == [5, 3, 2]
    assert race.rung_sizes(8) == [8, 4, 2]


def test_plan_splits_the_budget_equally_and_never_exceeds_it():
    # 5 models, 100 steps: 3 rungs of 33 steps; 33 // 5 = 6, 33 // 3 = 11, 33 // 2 = 16
    rungs = race.plan(5, 100)
    assert [(r.candidates, r.steps_each, r.total_steps) for r in rungs] == [
        (5, 6, 6),
        (3, 11, 17),
        (2, 16, 33),
    ]
    assert sum(r.candidates * r.steps_each for r in rungs) == 5 * 6 + 3 * 11 + 2 * 16 == 95
    for k in range(2, 20):
        for budget in (2 * k, 37, 1000, 12345):
            try:
                plan = race.plan(k, budget)
            except race.BudgetTooSmall:
                continue
            assert sum(r.candidates * r.steps_each for r in plan) <= budget
            assert all(r.steps_each >= 1 for r in plan)


def test_a_budget_below_one_step_each_is_refused_naming_the_rung():
    with pytest.raises(race.BudgetTooSmall, match="rung 1 of 2"):
        race.plan(3, 5)  # 2 rungs of 2 steps: 2 // 3 = 0


def test_race_train_size_follows_the_trainers_split_rule():
    # 8 a class: test 2 (round 8 * .25), leaving 6; validation round(1.5) = 2: 4 a class
    counts = {"dark": 8, "mid": 8, "bright": 8}
    size = race.race_train_size(
        counts, test_fraction=0.25, validation_fraction=0.25, max_per_class=None
    )
    assert size == 12
    capped = race.race_train_size(
        counts, test_fraction=0.25, validation_fraction=0.25, max_per_class=4
    )
    assert capped == 3 * (4 - 1 - 1)
    assert race.steps_per_epoch(12, 4) == 3 and race.steps_per_epoch(12, 32) == 1
    assert race.budget_steps(1.5, 3) == 4


def test_survivors_keep_the_best_by_validation_then_the_metrics_order():
    results = [
        race.Result("a", 0.5, 0),
        race.Result("b", 0.7, 1),
        race.Result("c", 0.5, 2),
        race.Result("d", None, 3),  # failed
    ]
    assert race.survivors(results, 2) == ["b", "a"]
    assert race.survivors(results, 4) == ["b", "a", "c"]
    why = race.why_won(results[:3], 40)
    assert why.startswith("b won the last rung with validation accuracy 0.7000 after 40 steps")
    assert "#2 by the metric" in why


def test_the_rule_keeps_the_plans_rung_sizes_so_the_budget_holds():
    rng = np.random.default_rng(1)
    for k in (2, 3, 5, 8, 21):
        for budget in (4 * k, 97, 1000):
            try:
                rungs = race.plan(k, budget)
            except race.BudgetTooSmall:
                continue
            alive, spent = [f"m{i}" for i in range(k)], 0
            for r in rungs:
                assert len(alive) == r.candidates
                spent += r.candidates * r.steps_each
                accs = rng.integers(0, 4, len(alive)) / 4  # coarse: many ties
                results = [
                    race.Result(m, float(a), int(m[1:])) for m, a in zip(alive, accs, strict=True)
                ]
                keep = rungs[r.index + 1].candidates if r.index + 1 < len(rungs) else 1
                alive = race.survivors(results, keep)
                assert len(alive) == keep
            assert spent <= budget


def test_a_rung_anneals_its_learning_rate_down_a_cosine_by_hand():
    # a rung of 4 steps from step 6: 1, (1 + cos(pi/4)) / 2, 1/2, (1 + cos(3 pi/4)) / 2
    got = [race.rung_lr_factor(s, 6, 10) for s in range(6, 10)]
    half = 2**-0.5 / 2
    assert got == pytest.approx([1.0, 0.5 + half, 0.5, 0.5 - half])
    for outside in (5, 10):
        with pytest.raises(ValueError, match="not in the rung"):
            race.rung_lr_factor(outside, 6, 10)
    from pydantic import ValidationError

    where = {"zoo": "z", "model": "m", "data": "d", "out": "o"}
    assert FinetuneConfig(**where, max_steps=10, decay_from=6).decay_from == 6
    for bad in ({"decay_from": 0}, {"max_steps": 6, "decay_from": 6}):
        with pytest.raises(ValidationError, match="decay_from"):
            FinetuneConfig(**where, **bad)


def test_selection_options_are_strict():
    from pydantic import ValidationError

    assert race.SelectionOptions().shortlist == 3
    for bad in ({"shortlist": 1}, {"shortlist": "3"}, {"budget_epochs": 0}, {"k": 3}):
        with pytest.raises(ValidationError):
            race.SelectionOptions.model_validate(bad)


# -- the trainer's part ---------------------------------------------------------------------


def _cfg(tiny_zoo, tiny_npz, out, **kw) -> dict:
    """The trainer tests' run (the fixed recipe: the rungs' mechanics under SGD's
    hand-computed rates) as a race's rung: dense, one worker, a validation share."""
    rung = {"epochs": 100, "compressor": "dense", "validation_fraction": 0.25, "workers": 1}
    return finetune_cfg(tiny_zoo, tiny_npz, out, **rung) | kw


def _records(path) -> list[EpochRecord]:
    lines = (path / METRICS).read_text().splitlines()
    return [r for r in map(parse_line, lines) if isinstance(r, EpochRecord)]


def test_a_rung_stops_mid_epoch_resumes_exactly_and_seeds_the_final_run(
    tiny_zoo, tiny_npz, tmp_path
):
    straight = _cfg(tiny_zoo, tiny_npz, tmp_path / "straight", max_steps=5)
    rung1 = _cfg(tiny_zoo, tiny_npz, tmp_path / "race", max_steps=2)
    rung2 = _cfg(tiny_zoo, tiny_npz, tmp_path / "race", max_steps=5, resume=True)
    again = _cfg(tiny_zoo, tiny_npz, tmp_path / "race", max_steps=5, resume=True)
    # the final run: no validation split, a learning rate too small to move the weights, so
    # its model is the race checkpoint's if (and only if) it started from it
    final = _cfg(
        tiny_zoo, tiny_npz, tmp_path / "final", epochs=1, lr=1e-12, momentum=0.0,
        validation_fraction=None, max_steps=None, init_from=str(tmp_path / "race" / CHECKPOINT),
    )  # fmt: skip
    fresh = final | {"out": str(tmp_path / "fresh"), "init_from": None}
    # the same two rungs, annealed as the service's race runs them (decay_from)
    hot1 = _cfg(tiny_zoo, tiny_npz, tmp_path / "annealed", max_steps=2, decay_from=0)
    hot2 = _cfg(tiny_zoo, tiny_npz, tmp_path / "annealed", max_steps=5, resume=True, decay_from=2)
    launch(_run_many, 1, [straight, rung1, rung2, again, final, fresh, hot1, hot2])
    after2 = torch.load(tmp_path / "annealed" / CHECKPOINT, weights_only=False)
    # the last step's rate, by hand: rung 2's third of 3 steps, restarted at lr 0.05 at step 2:
    # 0.05 x (1 + cos(2 pi/3)) / 2 (a schedule over the whole run would give 0.05 x 0.095)
    assert after2["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.0125)

    a = _records(tmp_path / "straight")
    # 12 training images (race_train_size above) in batches of 4: 3 steps an epoch, so 5 steps
    # are epoch 1 and two thirds of epoch 2
    assert [(r.epoch, r.steps) for r in a] == [(1, 3), (2, 5)]
    assert all(r.val_accuracy is not None and r.test_accuracy is None for r in a)
    b = _records(tmp_path / "race")
    # rung 1 stops after 2 steps of epoch 1; rung 2 finishes epoch 1 and stops in epoch 2;
    # the re-run of rung 2 has nothing left to train and reports where it stands
    assert [(r.epoch, r.steps) for r in b] == [(1, 2), (1, 3), (2, 5), (2, 5)]
    assert b[-1].val_accuracy == b[-2].val_accuracy == a[-1].val_accuracy
    assert not (tmp_path / "race" / FINAL_WEIGHTS).exists()  # a rung writes no model file

    s = torch.load(tmp_path / "straight" / CHECKPOINT, weights_only=False)
    r = torch.load(tmp_path / "race" / CHECKPOINT, weights_only=False)
    assert (s["epoch"], s["step"]) == (r["epoch"], r["step"]) == (1, 2)
    for key, value in s["model"].items():
        torch.testing.assert_close(r["model"][key], value, rtol=1e-5, atol=1e-6)
    # annealing changed the training (a lower rate on every step but the first of a rung)
    head = [k for k in s["model"] if k.endswith("weight")][-1]
    assert (after2["epoch"], after2["step"]) == (1, 2)
    assert not torch.allclose(after2["model"][head], r["model"][head])

    from safetensors.torch import load_file

    seeded = load_file(tmp_path / "final" / FINAL_WEIGHTS)
    unseeded = load_file(tmp_path / "fresh" / FINAL_WEIGHTS)
    head = [k for k in seeded if k.endswith("weight")][-1]
    torch.testing.assert_close(seeded[head], r["model"][head], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(unseeded[head], r["model"][head])
    # the final run reports test accuracy (its test split), not validation accuracy
    final_records = _records(tmp_path / "final")
    assert final_records[-1].test_accuracy is not None
    assert final_records[-1].val_accuracy is None
    assert json.loads((tmp_path / "final" / "model.json").read_text())["num_classes"] == 3
