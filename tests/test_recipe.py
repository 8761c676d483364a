"""The fine-tune recipe's rules (``training.recipe``), each against a hand-computed case."""

import math

import pytest

from zoopick.training import recipe
from zoopick.training.config import FinetuneConfig, FinetuneOptions

WHERE = {"zoo": "z", "model": "m", "data": "d", "out": "o"}


def test_the_length_comes_from_the_data_unless_epochs_are_given():
    # 898 digits at batch 32: 28 steps an epoch; ten epochs are 280, raised to the floor
    assert recipe.run_steps(None, 28) == recipe.MIN_STEPS == 400
    assert recipe.run_steps(None, 100) == 1000  # ten epochs
    assert recipe.run_steps(None, 1875) == recipe.MAX_STEPS == 4000  # Fashion-MNIST: bounded
    assert recipe.run_steps(3, 28) == 84  # given epochs are honoured as they are
    with pytest.raises(ValueError):
        recipe.run_steps(None, 0)


def test_warmup_then_cosine_per_step():
    steps, warm = 100, 5
    # linear warm-up: 1/6, 2/6 ... 5/6, then the cosine starts at 1
    assert [recipe.lr_factor(s, steps, warm) for s in range(5)] == pytest.approx(
        [1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6]
    )
    assert recipe.lr_factor(5, steps, warm) == 1.0
    # half-way through the 95 cosine steps: (1 + cos(pi/2)) / 2 = 0.5
    assert recipe.lr_factor(5 + 95 // 2, steps, warm) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 47 / 95))
    )
    last = recipe.lr_factor(99, steps, warm)
    assert 0 < last < 0.001
    factors = [recipe.lr_factor(s, steps, warm) for s in range(5, 100)]
    assert all(a > b for a, b in zip(factors, factors[1:], strict=False))  # strictly falling
    with pytest.raises(ValueError):
        recipe.lr_factor(100, steps, warm)


def test_the_search_goes_past_an_end_and_finds_a_known_best_rate():
    """Validation accuracy as a known unimodal function of log10(lr), peaked at 3e-2: the
    search starts at 3e-4, 1e-3, 3e-3 and must walk up past the end to the peak."""

    def trial(lr: float) -> recipe.Trial:
        x = math.log10(lr) - math.log10(3e-2)
        return recipe.Trial(lr, 1.0 - 0.1 * x * x, 1.0 + x * x)

    trials = recipe.search(recipe.LR_CANDIDATES["adamw"], trial)
    rates = [t.lr for t in trials]
    assert rates[:3] == [3e-4, 1e-3, 3e-3]
    assert rates[3:] == pytest.approx([3e-3 * 10**0.5, 3e-2])
    assert recipe.pick(trials) == pytest.approx(3e-2)
    assert len(trials) <= recipe.MAX_TRIALS

    # a peak inside the first candidates: no extension; one below them: one step down
    inside = recipe.search([1e-4, 1e-3, 1e-2], lambda lr: recipe.Trial(lr, -abs(lr - 1e-3), 0))
    assert [t.lr for t in inside] == [1e-4, 1e-3, 1e-2]
    # peaked at 5e-4, below both: down one step (3.2e-4, now the best), then one more (1e-4,
    # worse), and the best is no longer at an end
    peak = lambda lr: recipe.Trial(lr, -abs(math.log10(lr / 5e-4)), 0)  # noqa: E731
    low = recipe.search([1e-3, 3e-3], peak)
    assert [t.lr for t in low] == pytest.approx([1e-3, 3e-3, 1e-3 / 10**0.5, 1e-4])
    assert recipe.pick(low) == pytest.approx(1e-3 / 10**0.5)


def test_pick_takes_the_lowest_loss_then_accuracy_then_the_smaller_rate_and_skips_diverged():
    t = recipe.Trial
    assert recipe.pick([t(1e-3, 0.9, 0.5), t(3e-3, 0.8, 0.4)]) == 3e-3  # loss first
    assert recipe.pick([t(1e-3, 0.8, 0.4), t(3e-3, 0.9, 0.4)]) == 3e-3  # then accuracy
    assert recipe.pick([t(1e-3, 0.9, 0.4), t(3e-3, 0.9, 0.4)]) == 1e-3  # then the smaller
    assert recipe.pick([t(1e-3, 0.5, 1.0), t(3e-3, 0.95, math.inf)]) == 1e-3
    with pytest.raises(ValueError, match="diverged"):
        recipe.pick([t(1e-3, 0.1, math.inf)])


def test_early_stop_and_the_best_checkpoint_rule(monkeypatch):
    # with no noise band (the rule before it): the maximum, ties to the later check
    monkeypatch.setattr(recipe, "BAND_STANDARD_ERRORS", 0.0)

    def stop(history, step):
        return recipe.should_stop(history, step=step, steps=100, patience=4, n=100)

    assert not stop([0.9, 0.5, 0.5, 0.5, 0.5], 40)  # before half the schedule: never
    assert stop([0.9, 0.5, 0.5, 0.5, 0.5], 60)  # after it: four checks all below the best
    assert not stop([0.9, 0.5, 0.9, 0.5, 0.5], 60)  # a tie with the best is not a decline
    assert not stop([0.9, 0.5, 0.5], 60)
    assert recipe.keeps([0.9], 100) and recipe.keeps([0.9, 0.9], 100)
    assert not recipe.keeps([0.9, 0.89], 100)


def test_the_noise_band_by_hand(monkeypatch):
    monkeypatch.setattr(recipe, "BAND_STANDARD_ERRORS", 1.0)
    # best 0.9 on 100 images: se = sqrt(0.9 * 0.1 / 100) = 0.03, the band starts at 0.87
    assert recipe.band([0.5, 0.9], 100) == pytest.approx(0.87)
    assert recipe.keeps([0.9, 0.87], 100) and not recipe.keeps([0.9, 0.86], 100)
    # a perfect check is no more certain than one image: the band is 1 - 1/n
    assert recipe.band([1.0], 80) == pytest.approx(1 - 1 / 80)
    # the early stop needs a decline past the band, not below the maximum
    assert not recipe.should_stop(
        [0.9, 0.88, 0.88, 0.88, 0.88], step=60, steps=100, patience=4, n=100
    )
    assert recipe.should_stop([0.9, 0.8, 0.8, 0.8, 0.86], step=60, steps=100, patience=4, n=100)
    # kept online, the check returned is the latest one within the final best's band
    history: list[float] = []
    kept = None
    for i, acc in enumerate([0.70, 0.90, 0.88, 0.91, 0.85, 0.89]):
        history.append(acc)
        if recipe.keeps(history, 100):
            kept = i
    # best 0.91: se = sqrt(.91 * .09 / 100) = 0.0286, so 0.89 (the last check) is within it
    assert kept == 5
    assert kept == max(i for i, a in enumerate(history) if a >= recipe.band(history, 100))


def test_validation_share_is_bounded_and_skipped_for_tiny_classes(monkeypatch):
    monkeypatch.setattr(recipe, "SMALL_SPLIT_VALIDATION", 0)  # a flat tenth
    assert recipe.validation_fraction([100] * 10) == pytest.approx(0.1)
    assert recipe.validation_fraction([40] * 10) == pytest.approx(0.1)
    monkeypatch.setattr(recipe, "SMALL_SPLIT_VALIDATION", 100)
    assert recipe.validation_fraction([100] * 10) == pytest.approx(0.1)
    assert recipe.validation_fraction([100] * 4) == pytest.approx(0.2)  # 100/400, capped
    assert recipe.validation_fraction([90] * 10) == pytest.approx(100 / 900)
    assert recipe.validation_fraction([6000] * 10) == pytest.approx(2000 / 60000)
    assert recipe.validation_fraction([100, 4]) is None
    assert recipe.validation_fraction([]) is None


def test_plans_fill_only_what_the_user_left_unset():
    auto = recipe.plan(FinetuneConfig(**WHERE), steps_per_epoch=28, validation=0.1)
    assert (auto.recipe, auto.optimizer, auto.lr, auto.lr_source) == (
        "auto",
        "adamw",
        None,
        "search",
    )
    assert auto.steps == 400 and auto.warmup_steps == 20 and auto.trial_steps == 32
    assert auto.candidates == recipe.LR_CANDIDATES["adamw"] and auto.keep_best
    assert (auto.label_smoothing, auto.augment, auto.head_lr_scale) == (0.1, False, 1.0)
    assert auto.weight_decay == recipe.ADAMW_WEIGHT_DECAY and auto.eval_every == 40

    given = recipe.plan(
        FinetuneConfig(**WHERE, lr=0.02, optimizer="sgd", augment=True, epochs=20),
        steps_per_epoch=28,
        validation=0.1,
    )
    assert (given.lr, given.lr_source, given.candidates) == (0.02, "given", ())
    assert given.head_lr_scale == 10.0  # SGD's discriminative rate for the new head
    assert (given.optimizer, given.augment, given.steps, given.weight_decay) == (
        "sgd",
        True,
        560,
        0.0,
    )
    # a run too short to search within its share takes the default rate
    short = recipe.plan(FinetuneConfig(**WHERE, epochs=1), steps_per_epoch=28, validation=0.1)
    assert (short.lr, short.lr_source, short.candidates) == (1e-3, "default", ())
    # no validation split (tiny classes), or a race's rung: no search, the last weights
    for p in (
        recipe.plan(FinetuneConfig(**WHERE), steps_per_epoch=28, validation=None),
        recipe.plan(FinetuneConfig(**WHERE), steps_per_epoch=28, validation=0.1, rung=True),
    ):
        assert (p.lr, p.lr_source, p.keep_best) == (1e-3, "default", False)

    fixed = recipe.plan(FinetuneConfig(**WHERE, recipe="fixed"), steps_per_epoch=28, validation=0.1)
    assert (fixed.steps, fixed.lr, fixed.optimizer, fixed.momentum) == (84, 0.01, "sgd", 0.9)
    assert not fixed.cosine and not fixed.keep_best and fixed.head_lr_scale == 1.0
    assert fixed.label_smoothing == 0.0 and fixed.augment is False


def test_jobs_stored_before_the_recipe_read_as_fixed():
    old = {"epochs": 3, "lr": 0.01, "optimizer": "sgd", "momentum": 0.9, "weight_decay": 0.0}
    assert FinetuneOptions.stored(old).recipe == "fixed"
    assert FinetuneOptions.stored(FinetuneOptions().model_dump(mode="json")).recipe == "auto"
    assert FinetuneOptions().resolved("optimizer") == "adamw"
    assert FinetuneOptions(recipe="fixed").resolved("lr") == 0.01
    # hook momentum is refused with the recipe's AdamW as with Adam
    with pytest.raises(ValueError, match="adamw"):
        FinetuneOptions(hook_options={"momentum": 0.9})


def test_describe_says_what_was_chosen():
    chosen = recipe.Choices(
        plan=recipe.plan(FinetuneConfig(**WHERE), steps_per_epoch=28, validation=0.1).to_dict(),
        lr=3e-3,
        best_step=360,
        best_val_accuracy=0.98,
    )
    text = recipe.describe(chosen.to_dict())
    assert "adamw at lr 0.003 (search), 400 steps" in text and "best validation step 360" in text
    assert "every training image" not in text
    refit = recipe.plan(FinetuneConfig(**WHERE), steps_per_epoch=9, validation=0.2, refit=True)
    text = recipe.describe(recipe.Choices(plan=refit.to_dict(), lr=1e-3).to_dict())
    assert text.endswith("on every training image (the validation share put back), last weights")


def test_the_search_trusts_only_trials_that_learned(monkeypatch):
    t = recipe.Trial
    monkeypatch.setattr(recipe, "MIDDLE_WHEN_NOTHING_LEARNED", False)  # rules 5-7's pick
    monkeypatch.setattr(recipe, "CHANCE_STANDARD_ERRORS", None)
    assert recipe.chance_floor([20, 20, 20, 20]) is None  # the rule off: every trial counts
    monkeypatch.setattr(recipe, "CHANCE_STANDARD_ERRORS", 2.0)
    # four balanced classes of 20: m = 0.25, se = sqrt(.25 * .75 / 80) = 0.0484; floor 0.3468
    floor = recipe.chance_floor([20, 20, 20, 20])
    assert floor.loss is None
    assert floor.accuracy == pytest.approx(0.25 + 2 * math.sqrt(0.25 * 0.75 / 80))
    chance = [t(3e-4, 0.25, 1.387), t(1e-3, 0.25, 1.398), t(3e-3, 0.25, 1.394)]
    # nothing learned: the lowest loss (3e-4) is noise; the search goes up, not down
    assert recipe.next_rate(chance, None) == pytest.approx(3e-4 / recipe.LR_STEP)
    assert recipe.next_rate(chance, floor) == pytest.approx(3e-3 * recipe.LR_STEP)
    assert recipe.pick(chance, floor) == 3e-3  # the highest finite rate
    # a diverged top: no higher rate, and the highest finite one is picked
    diverged = [*chance[:2], t(3e-3, 0.25, math.inf)]
    assert recipe.next_rate(diverged, floor) is None
    assert recipe.pick(diverged, floor) == 1e-3
    # once some trial learned, only those are judged (by loss, as before)
    learned = [*chance, t(9.5e-3, 0.40, 1.30), t(3e-2, 0.30, 1.20)]
    assert recipe.pick(learned, floor) == 9.5e-3  # 3e-2's lower loss is at chance accuracy
    assert recipe.pick(learned, None) == 3e-2
    # and the walk is the same as without the rule where every trial learned
    fine = [t(3e-4, 0.8, 0.6), t(1e-3, 0.9, 0.4), t(3e-3, 0.95, 0.3)]
    assert recipe.next_rate(fine, floor) == recipe.next_rate(fine, None)
    assert recipe.pick(fine, floor) == recipe.pick(fine, None) == 3e-3
    # the whole search on chance-level trials goes up to MAX_TRIALS and takes the top
    trials = recipe.search((3e-4, 1e-3, 3e-3), lambda lr: t(lr, 0.25, 1.39), floor)
    assert [x.lr for x in trials] == pytest.approx(
        [3e-4, 1e-3, 3e-3, 3e-3 * recipe.LR_STEP, 3e-3 * recipe.LR_STEP**2]
    )


def test_a_small_split_is_refit_after_its_search(monkeypatch):
    """Rules 6 (PREREGISTRATION.md): below ``REFIT_BELOW`` images the validation share
    chooses the rate only; the plan then keeps no checkpoint and never stops early. Off
    (None), or without a share, or for a rung, nothing is refit."""
    monkeypatch.setattr(recipe, "REFIT_BELOW", 1000)
    assert recipe.refits(999, 0.2) and not recipe.refits(1000, 0.1)
    assert not recipe.refits(300, None)  # no share held out: nothing to put back
    monkeypatch.setattr(recipe, "REFIT_BELOW", None)
    assert not recipe.refits(300, 0.2)
    refit = recipe.plan(FinetuneConfig(**WHERE), steps_per_epoch=9, validation=0.2, refit=True)
    assert refit.refit and refit.lr_source == "search" and refit.trial_steps == 32
    assert (refit.keep_best, refit.eval_every, refit.patience) == (False, 0, 0)
    assert refit.validation_fraction == 0.2 and refit.steps == 400
    kept = recipe.plan(FinetuneConfig(**WHERE), steps_per_epoch=9, validation=0.2)
    assert not kept.refit and kept.keep_best and kept.patience == recipe.PATIENCE


def test_rules_7_judges_learning_by_the_loss_against_the_class_prior(monkeypatch):
    """Rules 7: a trial learned when its validation loss is under the class prior's loss
    (by hand: four balanced classes, ln 4 = 1.3863; trained on shares 1/2, 1/6, 1/6, 1/6 and
    checked on balanced labels, -(ln 1/2 + 3 ln 1/6) / 4 = 1.5171) by the margin's share.
    The letters case that prompted it: a trial at 0.003 with the lowest loss but an
    accuracy under rules 5's floor counts, and the search goes on past it."""
    t = recipe.Trial
    monkeypatch.setattr(recipe, "LEARNED_LOSS_MARGIN", 0.02)
    assert recipe.prior_loss([30, 30, 30, 30], [10, 10, 10, 10]) == pytest.approx(math.log(4))
    assert recipe.prior_loss([60, 20, 20, 20], [5, 5, 5, 5]) == pytest.approx(
        -(math.log(1 / 2) + 3 * math.log(1 / 6)) / 4
    )
    floor = recipe.chance_floor([8] * 8, [32] * 8)
    assert floor.accuracy is None and floor.loss == pytest.approx(0.98 * math.log(8))
    trials = [t(3e-4, 0.109, 2.065), t(1e-3, 0.219, 1.917), t(3e-3, 0.188, 1.806)]
    assert [recipe.learned(x, floor) for x in trials] == [False, True, True]
    assert recipe.pick(trials, floor) == 3e-3
    assert recipe.next_rate(trials, floor) == pytest.approx(3e-3 * recipe.LR_STEP)
    # rules 5 on the same trials: 0.003's accuracy is under m + 2 se, so 0.001 wins and stops
    monkeypatch.setattr(recipe, "LEARNED_LOSS_MARGIN", None)
    old = recipe.chance_floor([8] * 8, [32] * 8)
    assert old.loss is None and recipe.pick(trials, old) == 1e-3
    assert recipe.next_rate(trials, old) is None
    # chance-level losses (within 1 % of ln 4: rules 5's lcnet case) learned nothing
    monkeypatch.setattr(recipe, "LEARNED_LOSS_MARGIN", 0.02)
    flat = recipe.chance_floor([20] * 4, [80] * 4)
    chance = [t(3e-4, 0.25, 1.387), t(1e-3, 0.25, 1.380), t(3e-3, 0.25, 1.394)]
    assert not any(recipe.learned(x, flat) for x in chance)
    assert recipe.next_rate(chance, flat) == pytest.approx(3e-3 * recipe.LR_STEP)


def test_rules_8_takes_the_highest_rate_within_the_noise_of_the_best(monkeypatch):
    """Rules 8 (``HORIZON_STANDARD_ERRORS``): by hand. Losses 1.50 (1e-3), 1.54 (3e-3), 1.80
    (1e-2); with a paired standard error of 0.05 between any two, 3e-3 is within one of the
    best (0.04 <= 0.05) and 1e-2 is not (0.30): 3e-3. Off, or with errors of 0.01: 1e-3. A
    higher trial within the noise that learned nothing (its loss over the floor) never wins."""
    t = recipe.Trial
    trials = [t(1e-3, 0.5, 1.50), t(3e-3, 0.5, 1.54), t(1e-2, 0.3, 1.80)]
    wide, narrow = (lambda a, b: 0.05), (lambda a, b: 0.01)
    monkeypatch.setattr(recipe, "HORIZON_STANDARD_ERRORS", None)
    assert recipe.pick(trials, noise=wide) == 1e-3
    monkeypatch.setattr(recipe, "HORIZON_STANDARD_ERRORS", 1.0)
    assert recipe.pick(trials) == 1e-3  # no errors measured: the lowest loss
    assert recipe.pick(trials, noise=wide) == 3e-3
    assert recipe.pick(trials, noise=narrow) == 1e-3
    # every trial within the noise: the highest that learned
    huge = lambda a, b: 1.0  # noqa: E731
    assert recipe.pick(trials, recipe.Floor(loss=1.7), noise=huge) == 3e-3
    assert recipe.pick(trials, noise=huge) == 1e-2
    # the errors are read between the best and each higher rate, not between neighbours
    seen = []
    recipe.pick(trials, noise=lambda a, b: seen.append((a.lr, b.lr)) or 0.0)
    assert sorted(seen) == [(3e-3, 1e-3), (1e-2, 1e-3)]


def test_rules_8_walks_on_up_when_the_noise_puts_the_pick_at_the_top(monkeypatch):
    """With the lowest loss at 1e-3 and 3e-3 (the top of the first candidates) within the
    noise, the pick is the top rate, so the search goes one step further up; that trial
    (3e-3 x sqrt 10) is far worse and ends it, and the pick stays 3e-3."""
    monkeypatch.setattr(recipe, "HORIZON_STANDARD_ERRORS", 1.0)
    losses = {3e-4: 2.0, 1e-3: 1.50, 3e-3: 1.52}
    trials = recipe.search(
        [3e-4, 1e-3, 3e-3],
        lambda lr: recipe.Trial(lr, 0.5, losses.get(lr, 3.0)),
        noise=lambda a, b: 0.05,
    )
    assert [x.lr for x in trials] == pytest.approx([3e-4, 1e-3, 3e-3, 3e-3 * 10**0.5])
    assert recipe.pick(trials, noise=lambda a, b: 0.05) == 3e-3
    monkeypatch.setattr(recipe, "HORIZON_STANDARD_ERRORS", None)  # rules 7: no extension
    assert [x.lr for x in recipe.search([3e-4, 1e-3, 3e-3], lambda lr: recipe.Trial(
        lr, 0.5, losses[lr]), noise=lambda a, b: 0.05)] == [3e-4, 1e-3, 3e-3]  # fmt: skip


def test_rules_8_takes_the_middle_rate_when_no_trial_learned(monkeypatch):
    """Five trials at chance (every loss over the floor 2.25): rules 7 takes the highest
    finite rate (3e-2), rules 8 the middle one (3e-3); with the top one diverged, the lower
    of the two middles of the four left (1e-3). A trial that learned still wins as before."""
    t = recipe.Trial
    trials = [t(lr, 0.1, loss) for lr, loss in
              [(3e-4, 2.31), (1e-3, 2.30), (3e-3, 2.31), (1e-2, 2.29), (3e-2, 2.33)]]  # fmt: skip
    floor = recipe.Floor(loss=2.25)
    monkeypatch.setattr(recipe, "MIDDLE_WHEN_NOTHING_LEARNED", False)
    assert recipe.pick(trials, floor) == 3e-2
    monkeypatch.setattr(recipe, "MIDDLE_WHEN_NOTHING_LEARNED", True)
    assert recipe.pick(trials, floor) == 3e-3
    assert recipe.pick([*trials[:4], t(3e-2, 0.1, math.inf)], floor) == 1e-3
    assert recipe.pick([*trials[:4], t(3e-2, 0.4, 2.0)], floor) == 3e-2
