"""The fine-tune recipe: how long to train, at which learning rate, with what, and which
weights to return, chosen from the data when the user leaves a field unset.

Why: a fixed epoch count and a constant rate fit no dataset in general (three epochs of a
900-image dataset are 84 steps; issue 39 measured the old default at 0.18-0.66 of what the
same trainer reaches with a long cosine schedule and a good rate). The ``auto`` recipe follows
what the field's fine-tuning recipes agree on, with no user sweep:

* **length** in optimizer steps from the data: :data:`EPOCHS_EQUIVALENT` passes over the
  training split, at least :data:`MIN_STEPS` (a small dataset gets hundreds of steps where
  three epochs gave tens), at most :data:`MAX_STEPS` (a large one is bounded); an explicit
  ``epochs`` (or a race rung's ``max_steps``) is honoured as it is;
* **schedule**: linear warm-up over :data:`WARMUP_SHARE` of the steps, then a cosine to zero
  (timm's and fast.ai's shape), per optimizer step;
* **optimizer**: AdamW, weight decay :data:`ADAMW_WEIGHT_DECAY`; with SGD the new head learns
  10 times faster than the pretrained body (:data:`HEAD_LR_SCALE`: the usual discriminative
  rates), with the Adam family at the body's rate;
* **learning rate**: chosen per model and dataset by short annealed trials from the same
  starting weights (each :data:`TRIAL_SHARE` of the run's steps) at the rates of
  :data:`LR_CANDIDATES`, going on past an end where the best is there (:func:`next_rate`, at
  most :data:`MAX_TRIALS`), judged on a validation split by its loss (:func:`pick`): the
  race's rule (an annealed short run's end predicts the long run's), applied to rates
  instead of models. Only trials that learned something count (a validation loss under
  the class prior's by :data:`LEARNED_LOSS_MARGIN` of it), and among them the highest rate
  within :data:`HORIZON_STANDARD_ERRORS` paired standard errors of the lowest loss; when
  none did, the search tries higher rates and keeps the middle of the rates it tried
  (:data:`MIDDLE_WHEN_NOTHING_LEARNED`). A run too short to give a trial
  :data:`MIN_TRIAL_STEPS` (an explicit short ``epochs``) takes :data:`DEFAULT_LR` instead:
  the search never costs more than its share;
* **label smoothing** :data:`LABEL_SMOOTHING`; **augmentation** (random shifts of up to 1/8
  of the side, no flips) is off unless asked for (``augment``): within a budget of ten
  epochs it slowed fitting more than it regularised (on the benchmark's dev pairs a
  from-scratch ViT lost 10 points with it, and no pair gained);
* **validation**: a stratified share of the training split (:func:`validation_fraction`:
  a tenth, more for a small split, at most :data:`MAX_VALIDATION` images), evaluated
  :data:`EVALUATIONS` times; the model returned is the latest check within the noise band of
  the best one (:func:`keeps`), and a run whose last :data:`PATIENCE` checks past half its
  schedule all fell below that band stops early. A split under :data:`REFIT_BELOW` images
  is **refit** instead: its share chooses the rate, then the run trains on every image and
  returns its last weights (:func:`refits`). The test split never chooses anything: it is
  only reported.

``fixed`` is the recipe before it (3 epochs, SGD at a constant 0.01, one parameter group, no
augmentation, the last weights), kept so old runs can be reproduced; a job stored before the
field existed reads as ``fixed``.

Every value a user sets is honoured; the recipe fills only what is unset. Torch-free: the API
and the planner use it without the trainer. These rules were fixed from the literature before
the benchmark (``benchmarks/finetune/PREREGISTRATION.md``) and are reported on data they were
not chosen on: rules 8 (rules 7's refit and loss gate; the search's middle rate when
nothing learned and its higher rate within the noise) ship since 2026-11-29.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Recipe = Literal["auto", "fixed"]
RECIPES: tuple[str, ...] = ("auto", "fixed")

FIXED = {
    "epochs": 3,
    "lr": 0.01,
    "optimizer": "sgd",
    "momentum": 0.9,
    "weight_decay": 0.0,
    "label_smoothing": 0.0,
    "augment": False,
}
"""The ``fixed`` recipe's values for unset fields: zoopick's defaults before the auto recipe."""

EPOCHS_EQUIVALENT = 10
MIN_STEPS = 400
MAX_STEPS = 4000
WARMUP_SHARE = 0.05
ADAMW_WEIGHT_DECAY = 0.01
HEAD_LR_SCALE = {"sgd": 10.0, "adam": 1.0, "adamw": 1.0}
"""The new head's rate as a multiple of the body's. SGD's classic discriminative rate (the head
starts from random weights, the body from useful ones); Adam's per-parameter normalisation
already moves a fresh head as fast as it needs: on the benchmark's dev pairs (a pretrained
and three random bodies, ``benchmarks/finetune``) AdamW with the head at 10x was never better
than at 1x and up to 1.6 points worse."""
LABEL_SMOOTHING = 0.1
LR_CANDIDATES: dict[str, tuple[float, ...]] = {
    "adamw": (3e-4, 1e-3, 3e-3),
    "adam": (3e-4, 1e-3, 3e-3),
    "sgd": (3e-3, 1e-2, 3e-2),
}
"""Body rates the search tries first, per optimizer: half a decade apart around the rate the
field's fine-tuning recipes use at batch 32. Where the best is at an end, the search goes on
past it, :data:`LR_STEP` at a time, up to :data:`MAX_TRIALS` trials (a random or far-off
model wants a higher rate, a large pretrained one a lower)."""
LR_STEP = 10**0.5
MAX_TRIALS = 5
CHANCE_STANDARD_ERRORS: float | None = 2.0
"""Rules 5's gate, used when :data:`LEARNED_LOSS_MARGIN` is None: a trial of the search
**learned** when its validation accuracy is above the split's majority-class share by more
than this many binomial standard errors of that share (:func:`chance_floor`); the search
trusts only trials that learned (:func:`pick`, :func:`next_rate`). None as well: every
trial is trusted (the rule before it)."""
LEARNED_LOSS_MARGIN: float | None = 0.02
"""Rules 7 (``benchmarks/finetune/PREREGISTRATION.md``; None: off, rules 5's accuracy
floor): a trial learned when its validation loss is below the loss of predicting the
training split's class shares by more than this share of it (:func:`chance_floor`)."""
HORIZON_STANDARD_ERRORS: float | None = 1.0
"""Rules 8 (``benchmarks/finetune/PREREGISTRATION.md``; None: off, rules 7): the searched
rate is the **highest** rate whose trial learned and whose validation loss is within this
many standard errors of the best trial's (the error of the two losses' difference, paired
image by image on the same validation share: :data:`Noise`). Why: a short trial favours
small rates over what a long run at the same rate reaches ("short-horizon bias", Wu et al.
2018), and on 60-100 validation images two neighbouring rates' losses often differ by less
than their noise; where the split cannot tell them apart, the bias says take the higher."""
MIDDLE_WHEN_NOTHING_LEARNED = True
"""Rules 8 (False: rules 7, the highest finite rate): when no trial of the search
learned anything, the searched rate is the middle of the finite rates it tried (the search
has walked up past its candidates by then: 3e-3 of AdamW's 3e-4 ... 3e-2). Why: a model that
learns nothing in a trial's few dozen steps is a slow starter (a ViT from a far source), not
one that needs the highest rate; on the dev pairs the highest rate left such runs at chance
(a ViT on digits: 0.15 where 3e-3 reaches 0.39). With nothing learned the trials say nothing
for either edge of what they explored: the middle is the hedge."""
DEFAULT_LR = {"adamw": 1e-3, "adam": 1e-3, "sgd": 1e-2}
"""The rate where no search runs (a race rung, a dataset too small to hold out a split)."""
TRIAL_SHARE = 0.08
"""One trial's steps as a share of the run's: the search costs at most
``MAX_TRIALS * TRIAL_SHARE`` = 0.4 of the run (its bound: 1.4 runs in all)."""
MIN_TRIAL_STEPS = 20
VALIDATION_FRACTION = 0.1
MAX_VALIDATION_FRACTION = 0.2
SMALL_SPLIT_VALIDATION = 100
"""Images a small training split holds out: ``max(VALIDATION_FRACTION, min(
MAX_VALIDATION_FRACTION, SMALL_SPLIT_VALIDATION / n))`` of it, so a 400-image split checks on
80 images, not 40 (0 here: a flat :data:`VALIDATION_FRACTION`, the rule before it)."""
MAX_VALIDATION = 2000
MIN_VALIDATION_CLASS = 5
"""A class needs this many training images for the recipe to hold some out: below it the run
keeps every image for training, uses :data:`DEFAULT_LR` and returns its last weights."""
REFIT_BELOW: int | None = 1000
"""A training split of fewer images than this is **refit**: its validation share chooses the
rate only, and the run then trains on every training image (the share included) and
returns its last weights, with no checks and no early stop (:func:`refits`). None: never
(the rule before it). See ``benchmarks/finetune/PREREGISTRATION.md``, rules 6."""
EVALUATIONS = 10
PATIENCE = 4
BAND_STANDARD_ERRORS = 1.0
"""How wide the noise band of the checkpoint rule is, in standard errors of the best check's
accuracy on the validation split (:func:`band`): checks within it count as ties. 0 gives the
rule before it (the maximum of the checks; stop when every recent check is below it)."""


@dataclass(frozen=True)
class Plan:
    """What a run does, every value decided (the recipe's choices and the user's fields)."""

    recipe: str
    steps: int
    """Optimizer steps of the run (the search's trials not included)."""
    warmup_steps: int
    optimizer: str
    momentum: float
    weight_decay: float
    label_smoothing: float
    augment: bool
    head_lr_scale: float
    lr: float | None
    """The body's rate; None: :attr:`candidates` are searched first."""
    lr_source: str
    """How :attr:`lr` was found: "given", "default", "fixed recipe" or "search"."""
    candidates: tuple[float, ...] = ()
    """The rates the search tries first (it may go on past an end: :func:`next_rate`)."""
    trial_steps: int = 0
    validation_fraction: float | None = None
    """The share of the training split held out to choose on (None: none is)."""
    eval_every: int = 0
    """Steps between validation checks (0: only per epoch as the fixed recipe did)."""
    patience: int = 0
    keep_best: bool = False
    refit: bool = False
    """The validation share chose the rate; the run trains on every image (:func:`refits`)."""
    cosine: bool = True
    """Per-step warm-up and cosine (False: a constant rate, the fixed recipe)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Trial:
    """One rate of the search and where its short run ended on the validation split."""

    lr: float
    val_accuracy: float
    val_loss: float
    loss_se: float | None = None
    """The standard error of the difference between this trial's loss and the lowest loss
    of the search (paired image by image; 0 for that trial; None: not measured)."""


Noise = Callable[[Trial, Trial], float]
"""The standard error of the difference of two trials' validation losses (paired image by
image on the same validation share); what :data:`HORIZON_STANDARD_ERRORS` counts in."""


@dataclass
class Choices:
    """What the recipe chose in a run, as the trainer reports it (``{"event": "recipe"}``) and
    keeps in its checkpoint: the plan, the search's curve and the best validation step."""

    plan: dict[str, Any]
    lr: float
    trials: list[dict[str, float]] = field(default_factory=list)
    best_step: int | None = None
    best_val_accuracy: float | None = None
    search_floor: float | None = None
    """The validation accuracy a trial had to beat to count (None: every trial counted, or
    the loss was the gate)."""
    search_loss_floor: float | None = None
    """The validation loss a trial had to get under to count (rules 7; None: not this gate)."""
    stopped_early: bool = False
    search_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def value(options: Any, name: str) -> Any:
    """``options.name`` as the run uses it: the user's value, else the recipe's (``fixed``:
    :data:`FIXED`; ``auto``: AdamW's settings, or None where the data decide)."""
    given = getattr(options, name)
    if given is not None:
        return given
    if options.recipe == "fixed":
        return FIXED[name]
    optimizer = options.optimizer or "adamw"
    auto = {
        "epochs": None,
        "lr": None,
        "optimizer": optimizer,
        "momentum": 0.9,
        "weight_decay": ADAMW_WEIGHT_DECAY if optimizer == "adamw" else 0.0,
        "label_smoothing": LABEL_SMOOTHING,
        "augment": False,
    }
    return auto[name]


def run_steps(epochs: int | None, steps_per_epoch: int) -> int:
    """The run's length in optimizer steps: ``epochs`` whole epochs when given, else
    :data:`EPOCHS_EQUIVALENT` epochs bounded to [:data:`MIN_STEPS`, :data:`MAX_STEPS`]."""
    if steps_per_epoch < 1:
        raise ValueError("an epoch needs at least one step")
    if epochs is not None:
        return epochs * steps_per_epoch
    return min(max(EPOCHS_EQUIVALENT * steps_per_epoch, MIN_STEPS), MAX_STEPS)


def validation_fraction(class_counts: Sequence[int]) -> float | None:
    """The share of the training split the auto recipe holds out to choose on:
    :data:`VALIDATION_FRACTION` of it, raised towards :data:`SMALL_SPLIT_VALIDATION` images
    for a small split (at most :data:`MAX_VALIDATION_FRACTION`), never more than
    :data:`MAX_VALIDATION` images; None when some class has fewer than
    :data:`MIN_VALIDATION_CLASS` images (too few to spare any).

    Why more for a small split: a check on 40 images moves in steps of 2.5 points, so the best
    of ten such checks is mostly noise (a winner's curse: the rule before this one returned an
    early checkpoint on the benchmark's two misses)."""
    if not class_counts or min(class_counts) < MIN_VALIDATION_CLASS:
        return None
    n = sum(class_counts)
    share = max(VALIDATION_FRACTION, min(MAX_VALIDATION_FRACTION, SMALL_SPLIT_VALIDATION / n))
    return min(share, MAX_VALIDATION / n)


def refits(n_train: int, validation: float | None) -> bool:
    """Whether a run on a training split of ``n_train`` images (before any hold-out) with the
    validation share ``validation`` (None: none) is refit on every image after its rate
    search (:data:`REFIT_BELOW`).

    Why: on a small split the hold-out costs the run a fifth of its images, and the checks it
    buys are too noisy to tell its checkpoints apart (a hundred images give a noise band of
    several points); on the transfer suite's small targets training on the held-out images
    too was worth 2 to 6 points at the same rate (``benchmarks/finetune``, the ablation)."""
    return validation is not None and REFIT_BELOW is not None and n_train < REFIT_BELOW


def plan(
    options: Any,
    *,
    steps_per_epoch: int,
    validation: float | None,
    rung: bool = False,
    refit: bool = False,
) -> Plan:
    """The run's plan. ``options``: the run's :class:`~zoopick.training.config.FinetuneConfig`
    (or options); ``steps_per_epoch``: an epoch of the images the run trains on;
    ``validation``: the share held out for the recipe (None: none); ``rung``: a race's rung
    (``max_steps``: its length and schedule are the race's, no search, no validation of its
    own); ``refit``: the share only chooses the rate, the run trains on every image
    (:func:`refits`)."""
    get = lambda name: value(options, name)  # noqa: E731
    optimizer = get("optimizer")
    common = {
        "recipe": options.recipe,
        "optimizer": optimizer,
        "momentum": get("momentum"),
        "weight_decay": get("weight_decay"),
        "label_smoothing": get("label_smoothing"),
        "augment": get("augment"),
    }
    if options.recipe == "fixed":
        steps = run_steps(get("epochs"), steps_per_epoch)
        return Plan(
            **common,
            steps=steps,
            warmup_steps=0,
            head_lr_scale=1.0,
            lr=get("lr"),
            lr_source="given" if options.lr is not None else "fixed recipe",
            cosine=False,
        )
    steps = run_steps(options.epochs, steps_per_epoch)
    head = HEAD_LR_SCALE[optimizer]
    if rung or validation is None:
        lr = options.lr if options.lr is not None else DEFAULT_LR[optimizer]
        return Plan(
            **common,
            steps=steps,
            warmup_steps=warmup_steps(steps),
            head_lr_scale=head,
            lr=lr,
            lr_source="given" if options.lr is not None else "default",
        )
    candidates = () if options.lr is not None else LR_CANDIDATES[optimizer]
    trial = math.floor(TRIAL_SHARE * steps) if candidates else 0
    if candidates and trial < MIN_TRIAL_STEPS:  # a run too short to search within its bound
        candidates, trial = (), 0
    lr = options.lr if options.lr is not None or candidates else DEFAULT_LR[optimizer]
    source = "given" if options.lr is not None else "search" if candidates else "default"
    return Plan(
        **common,
        steps=steps,
        warmup_steps=warmup_steps(steps),
        head_lr_scale=head,
        lr=lr,
        lr_source=source,
        candidates=candidates,
        trial_steps=trial,
        validation_fraction=validation,
        eval_every=0 if refit else max(1, math.ceil(steps / EVALUATIONS)),
        patience=0 if refit else PATIENCE,
        keep_best=not refit,
        refit=refit,
    )


def warmup_steps(steps: int) -> int:
    return max(1, round(WARMUP_SHARE * steps)) if steps > 1 else 0


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """The rate's multiplier at optimizer step ``step`` (0-based) of ``steps``: linear from
    1/(warmup+1) up to 1 over the first ``warmup`` steps, then a cosine from 1 towards 0
    (``(1 + cos(pi t / T)) / 2`` over the ``T`` steps after the warm-up)."""
    if not 0 <= step < steps:
        raise ValueError(f"step {step} is outside the run's {steps} steps")
    if step < warmup:
        return (step + 1) / (warmup + 1)
    t, span = step - warmup, steps - warmup
    return 0.5 * (1.0 + math.cos(math.pi * t / span))


@dataclass(frozen=True)
class Floor:
    """What a trial of the search must beat to count as having learned something: a
    validation accuracy above ``accuracy`` (rules 5), or a validation loss below ``loss``
    (rules 7, :data:`LEARNED_LOSS_MARGIN`)."""

    accuracy: float | None = None
    loss: float | None = None


def chance_floor(
    class_counts: Sequence[int], train_counts: Sequence[int] | None = None
) -> Floor | None:
    """What a trial must beat to have learned something (None: the rule is off, or there is
    no split). ``class_counts``: the validation split's classes; ``train_counts``: the
    training split's, in the same order.

    With :data:`LEARNED_LOSS_MARGIN` set (rules 7): a validation loss below the loss of
    always predicting the training split's class shares (:func:`prior_loss`) by that share
    of it. Else (rules 5): a validation accuracy above the split's majority-class share ``m``
    by :data:`CHANCE_STANDARD_ERRORS` of ``sqrt(m (1 - m) / n)``.

    Why: a short trial of a model from random weights can end at chance at every rate, and
    the lowest loss among chance-level trials is noise; followed past an end of the grid it
    sent a run to 3e-5 (benchmarks/finetune/PREREGISTRATION.md, rules 5). Why the loss
    (rules 7): an accuracy on 60-120 images is too coarse a gate; it discarded a trial
    whose loss was the search's lowest, and the run took a rate 10 times too small."""
    if not class_counts or sum(class_counts) < 1:
        return None
    if LEARNED_LOSS_MARGIN is not None and train_counts:
        return Floor(loss=(1.0 - LEARNED_LOSS_MARGIN) * prior_loss(train_counts, class_counts))
    if CHANCE_STANDARD_ERRORS is None:
        return None
    n = sum(class_counts)
    m = max(class_counts) / n
    return Floor(accuracy=m + CHANCE_STANDARD_ERRORS * math.sqrt(m * (1.0 - m) / n))


def prior_loss(train_counts: Sequence[int], class_counts: Sequence[int]) -> float:
    """The cross-entropy on a split with ``class_counts`` of always predicting the training
    split's class shares (``train_counts``, same order): what a model that learned nothing
    but the class frequencies scores (``ln K`` for ``K`` balanced classes)."""
    n_train, n = sum(train_counts), sum(class_counts)
    return -sum(
        c / n * math.log(max(t, 1) / n_train)
        for t, c in zip(train_counts, class_counts, strict=True)
        if c
    )


def learned(trial: Trial, floor: Floor | None) -> bool:
    """Whether ``trial`` learned something (beyond :func:`chance_floor`'s ``floor``)."""
    if floor is None:
        return True
    if floor.loss is not None:
        return trial.val_loss < floor.loss
    return floor.accuracy is None or trial.val_accuracy > floor.accuracy


def pick(trials: Sequence[Trial], floor: Floor | None = None, noise: Noise | None = None) -> float:
    """The searched rate: the lowest validation loss among the trials that learned something
    (:func:`learned`; all of them without a ``floor``); ties to the higher accuracy, then to
    the smaller rate (the safer one). A trial whose loss is not finite never wins. When no
    trial learned, the highest rate whose loss is finite: nothing was learned at any rate
    tried, and a higher rate is what learns soonest.

    Why the loss and not the accuracy: a validation split of about a hundred images moves its
    accuracy in steps of a point and ties often after a short trial, while the cross-entropy
    averages a continuous quantity per image (on the dev pairs, ``benchmarks/finetune``, the
    accuracy's pick was the worse rate by the field truth twice where the loss's was not).

    With ``noise`` and :data:`HORIZON_STANDARD_ERRORS` set (rules 8): the highest rate that
    learned and whose loss is within that many of ``noise``'s standard errors of the best's;
    with :data:`MIDDLE_WHEN_NOTHING_LEARNED`, when no trial learned, the middle of the finite
    rates tried (the lower of two middles)."""
    finite = [t for t in trials if math.isfinite(t.val_loss)]
    if not finite:
        raise ValueError("every learning rate of the search diverged")
    informative = [t for t in finite if learned(t, floor)]
    if not informative:
        rates = sorted(t.lr for t in finite)
        return rates[(len(rates) - 1) // 2] if MIDDLE_WHEN_NOTHING_LEARNED else rates[-1]
    best = min(informative, key=lambda t: (t.val_loss, -t.val_accuracy, t.lr))
    if noise is None or HORIZON_STANDARD_ERRORS is None:
        return best.lr
    within = [
        t
        for t in informative
        if t.lr > best.lr and t.val_loss - best.val_loss <= HORIZON_STANDARD_ERRORS * noise(t, best)
    ]
    return max((t.lr for t in within), default=best.lr)


def search(
    candidates: Sequence[float],
    trial: Callable[[float], Trial],
    floor: Floor | None = None,
    noise: Noise | None = None,
) -> list[Trial]:
    """Run the rate search: ``trial(lr)`` at each candidate, then on past an end while the best
    is there (:func:`next_rate`). Returns every trial, in the order run. ``noise`` must know
    every trial ``trial`` returned (the trainer's measures each as it ends)."""
    trials: list[Trial] = []
    pending = list(candidates)
    lr: float | None = pending.pop(0) if pending else None
    while lr is not None:
        trials.append(trial(lr))
        lr = pending.pop(0) if pending else next_rate(trials, floor, noise)
    return trials


def next_rate(
    trials: Sequence[Trial], floor: Floor | None = None, noise: Noise | None = None
) -> float | None:
    """The search's next rate after ``trials`` (the first candidates tried, in order): one
    :data:`LR_STEP` past the end where the best so far is the highest or lowest rate tried,
    while fewer than :data:`MAX_TRIALS` ran; when no trial learned anything (``floor``), one
    step above the highest rate tried, unless that one diverged; None: the search is over."""
    if len(trials) >= MAX_TRIALS or len(trials) < 2:
        return None
    finite = [t for t in trials if math.isfinite(t.val_loss)]
    if not finite:
        return None
    top = max(trials, key=lambda t: t.lr)
    if not any(learned(t, floor) for t in finite):
        return top.lr * LR_STEP if math.isfinite(top.val_loss) else None
    best = pick(trials, floor, noise)
    rates = sorted(t.lr for t in trials)
    if best == rates[-1]:
        return best * LR_STEP
    if best == rates[0]:
        return best / LR_STEP
    return None


def band(history: Sequence[float], n: int) -> float:
    """The accuracy below which a check counts as worse than the best of ``history`` on a
    validation split of ``n`` images: the best minus :data:`BAND_STANDARD_ERRORS` of its
    binomial standard error ``sqrt(p (1 - p) / n)`` (at least ``1 / n``: a perfect check is
    no more certain than one image)."""
    best = max(history)
    se = max(math.sqrt(best * (1.0 - best) / max(n, 1)), 1.0 / max(n, 1))
    return best - BAND_STANDARD_ERRORS * se


def keeps(history: Sequence[float], n: int) -> bool:
    """Whether the latest check of ``history`` (accuracies, oldest first, on ``n`` validation
    images) becomes the checkpoint the run returns: it is within the noise band of the best
    check (:func:`band`). Kept online, this returns the **latest** check within the band of
    the final best: a check that raises the best is within its own band, and one that does
    not leaves the band where it was. Why the latest: among checks the split cannot tell
    apart, the later weights are further down the cosine, where a run usually ends best."""
    return history[-1] >= band(history, n)


def should_stop(history: Sequence[float], *, step: int, steps: int, patience: int, n: int) -> bool:
    """Early stop: past half the schedule, and the last ``patience`` validation checks of
    ``history`` (accuracies, oldest first, on ``n`` images) were all below the best's noise
    band (:func:`band`): a decline the split can tell from noise, not a tie."""
    if patience < 1 or step < steps // 2 or len(history) <= patience:
        return False
    floor = band(history, n)
    return all(acc < floor for acc in history[-patience:])


def describe(choices: Mapping[str, Any]) -> str:
    """One line for a person: what the recipe chose and how."""
    plan_ = choices.get("plan") or {}
    how = plan_.get("lr_source", "?")
    text = (
        f"recipe {plan_.get('recipe', '?')}: {plan_.get('optimizer', '?')} at lr "
        f"{choices.get('lr'):.3g} ({how}), {plan_.get('steps', '?')} steps"
    )
    if plan_.get("refit"):
        text += ", then on every training image (the validation share put back), last weights"
    if choices.get("best_step") is not None:
        acc = choices.get("best_val_accuracy")
        text += f", best validation step {choices['best_step']}"
        if acc is not None:
            text += f" ({acc:.4f})"
    if choices.get("stopped_early"):
        text += ", stopped early"
    return text
