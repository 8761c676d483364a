"""Data-parallel fine-tuning of a zoo model on a target dataset with a sparse comm hook.

One process per worker (started by ``torchrun`` or by :func:`zoopick.training.launch.spawn_local`);
each runs :func:`run` after the process group exists. Rank 0 streams one JSON line per epoch
(loss, accuracies, bytes sent, seconds split into compute / select / communicate) to stdout and
to ``metrics.jsonl`` so the service can store the curve as it grows, writes a resumable
checkpoint every epoch, and finally the model as safetensors beside its data config.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from zoopick.selection.extract import normalise, preprocess
from zoopick.training import augment, recipe
from zoopick.training.config import (
    CHECKPOINT,
    COMM_STATE,
    FINAL_CONFIG,
    FINAL_WEIGHTS,
    METRICS,
    EpochRecord,
    FinetuneConfig,
    RunEvent,
    TrainerError,
    failure_text,
    write_line,
)
from zoopick.training.progress import Reporter
from zoopick.training.race import rung_lr_factor

if TYPE_CHECKING:
    from zoopick.selection.data import TargetDataset
    from zoopick.selection.zoo import ZooEntry


def _log(record: EpochRecord | RunEvent, out: Path) -> None:
    line = record.to_json()
    write_line(sys.stdout, line)
    with open(out / METRICS, "a") as fh:
        fh.write(line + "\n")


def _load_data(cfg: FinetuneConfig, world: int):
    """(train, held out, validation): the held-out part is the test data (or split), or, for
    a run with ``validation_fraction`` (a race), a stratified share of the training split, so
    the test split is never looked at. The training split is the same either way (same seed),
    which is what lets the final fine-tune start from a race checkpoint without having seen
    its test images. ``validation`` is the auto recipe's own share of the training split
    (``recipe.validation_fraction``, drawn as the race's is), what it chooses on; None where
    it holds none out (the fixed recipe, a rung, too few images)."""
    from zoopick.selection import decoded
    from zoopick.selection.data import load_dataset, load_test_data, split_dataset
    from zoopick.selection.limits import DatasetLimits

    limits = DatasetLimits(**cfg.dataset_limits) if cfg.dataset_limits else None
    train = None
    if cfg.decoded:  # the images validation decoded: the same dataset, no archive read
        train = decoded.load(cfg.decoded, max_per_class=cfg.max_per_class, seed=cfg.seed,
                             limits=limits)  # fmt: skip
    if train is None:
        train = load_dataset(cfg.data, max_per_class=cfg.max_per_class, seed=cfg.seed,
                             limits=limits)  # fmt: skip
    if cfg.test_data:
        test = load_test_data(cfg.test_data, cfg.data, train.class_names, limits)
    else:
        train, test = split_dataset(train, cfg.test_fraction, cfg.seed)
    if cfg.validation_fraction is not None:
        train, held = split_dataset(train, cfg.validation_fraction, cfg.seed + 1)
        return train, held, None
    share = None
    if cfg.recipe == "auto" and cfg.max_steps is None:
        share = recipe.validation_fraction(list(train.class_counts().values()))
    if share is None:
        return train, test, None
    kept, val = split_dataset(train, share, cfg.seed + 1)
    if len(kept) // world < 2:  # the split would starve the workers: keep every image
        return train, test, None
    return kept, test, val


def _tensors(dataset, data_config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset through the model's eval transform, decoded once, as uint8 NCHW (1 byte a
    pixel) plus labels; normalisation happens per batch. ``preprocess``'s cache keeps its
    library budget: the run holds these tensors anyway, so a budget changes no memory here."""
    return preprocess(dataset, data_config), torch.as_tensor(dataset.labels, dtype=torch.long)


class _CommTimer:
    """Sums a hook's per-iteration stats over an epoch (bytes and select / comm seconds) as
    the difference of two snapshots of ``stats.cumulative`` (the stats keep only recent
    records, so a long epoch cannot be summed from the record list)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.mark = self._snapshot()

    def _snapshot(self) -> dict[str, float]:
        from zoopick.training.comm import sum_stats

        stats = getattr(self.state, "stats", None)
        if stats is None:
            return sum_stats([])
        stats.resolve()  # once per epoch: waits for CUDA timing events, if any
        return dict(stats.cumulative)

    def take(self) -> dict[str, float]:
        now = self._snapshot()
        total = {key: value - self.mark.get(key, 0) for key, value in now.items()}
        self.mark = now
        return total


def _evaluate(model, x, y, data_config, device, batch_size, amp) -> tuple[int, torch.Tensor]:
    """(correct, each image's cross-entropy in float64 on the CPU) on this rank's shard."""
    model.eval()
    correct, losses = 0, [torch.zeros(0, dtype=torch.float64)]
    with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=amp):
        for start in range(0, len(y), batch_size):
            xb = normalise(x[start : start + batch_size], data_config, device)
            yb = y[start : start + batch_size]
            logits = model(xb).float().cpu()
            correct += int((logits.argmax(1) == yb).sum())
            losses.append(torch.nn.functional.cross_entropy(logits, yb, reduction="none").double())
    return correct, torch.cat(losses)


def _paired_errors(
    new: torch.Tensor, earlier: dict[float, torch.Tensor], device: torch.device
) -> dict[float, float]:
    """For each earlier trial (its rate: this rank's per-image validation losses), the
    standard error of the difference between its mean validation loss and the new trial's,
    paired image by image over every rank's shard (the shards are the same images in every
    trial): ``sd(d) / sqrt(n)`` of the per-image differences ``d``. One all-reduce."""
    rates = list(earlier)
    sums: list[float] = [float(len(new))]
    for lr in rates:
        d = new - earlier[lr]
        sums += [float(d.sum()), float((d * d).sum())]
    totals = _all_sum(sums, device)
    n = totals[0]
    if n <= 1:  # no spread to measure: no difference is known to be real
        return dict.fromkeys(rates, math.inf)
    errors = {}
    for i, lr in enumerate(rates):
        s1, s2 = totals[1 + 2 * i], totals[2 + 2 * i]
        variance = (s2 - s1 * s1 / n) / (n - 1)
        errors[lr] = math.sqrt(max(variance, 0.0) / n)
    return errors


def _all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


class Diverged(RuntimeError):
    """The training loss became NaN or infinite: nothing the run goes on to write (an epoch
    record, a checkpoint, the model) would be usable. (A run of NaN weights used to end with
    exit 0 and a saved model, its metrics holding bare ``NaN`` no JSON parser takes.)"""


def _head(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of the model's classifier (timm's ``get_classifier``): the new head the
    recipe trains at its own rate; none for a model that does not name one."""
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    return list(head.parameters()) if isinstance(head, torch.nn.Module) else []


def _optimizer(model: torch.nn.Module, plan: recipe.Plan, lr: float) -> torch.optim.Optimizer:
    """The plan's optimizer: the body at ``lr``, the head (when the plan scales it) at
    ``lr * head_lr_scale``; each group keeps its ``lr_scale`` for the schedule."""
    head = {id(p) for p in _head(model)} if plan.head_lr_scale != 1.0 else set()
    body = [p for p in model.parameters() if id(p) not in head]
    groups = [{"params": body, "lr_scale": 1.0}]
    if head:
        own = [p for p in model.parameters() if id(p) in head]
        groups.append({"params": own, "lr_scale": plan.head_lr_scale})
    for group in groups:
        group["lr"] = lr * group["lr_scale"]
    if plan.optimizer == "sgd":
        return torch.optim.SGD(
            groups, lr=lr, momentum=plan.momentum, weight_decay=plan.weight_decay
        )
    kind = torch.optim.AdamW if plan.optimizer == "adamw" else torch.optim.Adam
    return kind(groups, lr=lr, weight_decay=plan.weight_decay)


def _copy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's state (parameters and buffers) that later steps do not change."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def _epoch_shape(n: int, world: int, batch_size: int) -> tuple[int, int, int]:
    """(images per rank, batch, steps per epoch) for ``n`` training images on ``world``
    ranks: every rank runs the same number of equally sized batches (DDP needs it); the last
    partial batch is dropped (a batch of one breaks batch norm)."""
    per_rank = n // world
    if per_rank < 2:
        raise ValueError(f"{n} training images cannot feed {world} workers")
    batch = min(batch_size, per_rank)
    return per_rank, batch, per_rank // batch


class _Run:
    """One rank's run: the model in DDP with its hook, the data on the host as uint8, and the
    plan; trains steps, evaluates, searches the rate. Every decision it takes comes from sums
    all-reduced over the ranks, so every rank takes the same one."""

    def __init__(self, cfg, model, ddp, state, device, amp, data_config, data, rank, world):
        self.cfg, self.model, self.ddp, self.state = cfg, model, ddp, state
        self.device, self.amp, self.data_config = device, amp, data_config
        self.rank, self.world = rank, world
        train, self.test, self.val = data
        self.train_on(*train)
        self.every_image: tuple[torch.Tensor, torch.Tensor] | None = None
        """The training split with the validation share put back, for a refit run (the
        recipe's ``refit``): what it trains on once the rate is chosen."""
        self.plan: recipe.Plan | None = None
        self.floor: recipe.Floor | None = None
        """What a trial of the search must beat on the validation split to count."""
        self.n_val = 0
        """The validation split's images, every rank's shards together (0: none)."""
        self.noise: recipe.Noise | None = None
        """The search's paired standard errors between its trials' losses (once it ran)."""

    def train_on(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Train on ``(x, y)``: every rank holds all of it and takes its share of each
        epoch's order (:func:`_epoch_shape`)."""
        self.x_train, self.y_train = x, y
        self.per_rank, self.batch, self.steps = _epoch_shape(
            len(y), self.world, self.cfg.batch_size
        )

    @property
    def limit(self) -> int:
        """The run's length in steps: ``max_steps`` when set (``epochs`` then only says what a
        full run is), else the plan's."""
        return self.cfg.max_steps if self.cfg.max_steps is not None else self.plan.steps

    @property
    def epochs(self) -> int:
        """The epochs the run's steps span (the last one may be partial)."""
        return -(-self.limit // self.steps)

    @property
    def held(self) -> str:
        """The record's field for the held-out accuracy: a race's validation share, or the
        test split."""
        return "val_accuracy" if self.cfg.validation_fraction is not None else "test_accuracy"

    def rate(self, lr: float, at: int) -> float:
        """The learning rate of step ``at`` (counted from the run's start): a race's rung
        anneals from its own start (``training.race``), the plan may warm up and follow a
        cosine, else ``lr`` throughout."""
        if self.cfg.decay_from is not None:
            return lr * rung_lr_factor(at, self.cfg.decay_from, self.limit)
        if self.plan.cosine:
            return lr * recipe.lr_factor(at, self.limit, self.plan.warmup_steps)
        return lr

    def order(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.cfg.seed * 1000 + epoch)
        lo = self.rank * self.per_rank
        return torch.randperm(len(self.y_train), generator=gen)[lo : lo + self.per_rank]

    def batch_at(self, order: torch.Tensor, step: int, gen: torch.Generator | None):
        idx = order[step * self.batch : (step + 1) * self.batch]
        xb = normalise(self.x_train[idx], self.data_config, self.device)
        if gen is not None:
            xb = augment.shift(xb, gen)
        if self.amp:
            xb = xb.contiguous(memory_format=torch.channels_last)
        return xb, self.y_train[idx].to(self.device)

    def augmenter(self, epoch: int) -> torch.Generator | None:
        if not self.plan or not self.plan.augment:
            return None
        return torch.Generator().manual_seed((self.cfg.seed * 1000 + epoch) * 4096 + self.rank)

    def step(self, opt, xb, yb):
        """One optimizer step; the loss and logits, left on the device."""
        opt.zero_grad(set_to_none=True)
        smoothing = self.plan.label_smoothing if self.plan else 0.0
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.amp):
            logits = self.ddp(xb)
            loss = torch.nn.functional.cross_entropy(logits, yb, label_smoothing=smoothing)
        loss.backward()
        opt.step()
        return loss, logits

    def evaluate(self, part) -> tuple[float, float]:
        """(accuracy, mean loss) on ``part`` (this rank's shard of it), summed over the ranks."""
        return self.evaluate_images(part)[:2]

    def evaluate_images(self, part) -> tuple[float, float, torch.Tensor]:
        """:meth:`evaluate` and this rank's per-image losses (its shard's, in order)."""
        x, y = part
        correct, losses = _evaluate(
            self.model, x, y, self.data_config, self.device, self.cfg.batch_size * 2, self.amp
        )
        c, n, loss = _all_sum([correct, len(losses), float(losses.sum())], self.device)
        return c / max(n, 1), loss / max(n, 1), losses

    def restart(self, weights: dict[str, torch.Tensor]) -> None:
        """Back to the run's starting point: its weights, and the hook's error feedback and
        warm-up from zero (a trial of the search must not leak into the next)."""
        self.model.load_state_dict(weights)
        self.state.reset_state()
        self.state.iteration = 0

    def search(self, report: Reporter) -> list[recipe.Trial]:
        """The recipe's rate search (``recipe.search``): from the same starting weights, a
        short annealed run (warm-up and cosine over ``trial_steps``) at each rate, judged on
        the validation split. The model and the hook are left at the starting point."""
        plan = self.plan
        start = _copy_weights(self.model)
        warm = recipe.warmup_steps(plan.trial_steps)
        tried = itertools.count(1)
        losses: dict[float, torch.Tensor] = {}  # this rank's per-image losses of each trial
        errors: dict[tuple[float, float], float] = {}

        def trial(lr: float) -> recipe.Trial:
            report.phase("choosing the learning rate", step=next(tried))
            self.restart(start)
            opt = _optimizer(self.model, plan, lr)
            self.ddp.train()
            done, epoch = 0, 0
            while done < plan.trial_steps:
                order, gen = self.order(epoch), self.augmenter(epoch)
                for s in range(min(self.steps, plan.trial_steps - done)):
                    _set_lr(opt, lr * recipe.lr_factor(done, plan.trial_steps, warm))
                    self.step(opt, *self.batch_at(order, s, gen))
                    done += 1
                epoch += 1
            acc, loss, mine = self.evaluate_images(self.val)
            for other, se in _paired_errors(mine, losses, self.device).items():
                errors[lr, other] = errors[other, lr] = se
            losses[lr] = mine
            return recipe.Trial(lr, acc, loss if math.isfinite(loss) else math.inf)

        self.noise = lambda a, b: errors[a.lr, b.lr]
        trials = recipe.search(plan.candidates, trial, self.floor, self.noise)
        finite = [t for t in trials if math.isfinite(t.val_loss)]
        if finite:  # the curve's error bars, for the record
            lowest = min(finite, key=lambda t: t.val_loss)
            for t in trials:
                t.loss_se = 0.0 if t is lowest else errors.get((t.lr, lowest.lr))
        self.restart(start)
        return trials


@dataclass
class _Progress:
    """Where the run stands: the epoch and step it starts at (after a resume, inside the
    checkpoint's epoch), its optimizer, and the recipe's state the loop updates and each
    checkpoint keeps (its choices, the best validation weights, the validation history)."""

    epoch: int
    step: int
    opt: torch.optim.Optimizer
    choices: recipe.Choices
    best: dict[str, torch.Tensor] | None
    history: list[float]


@dataclass
class _Trained:
    """One epoch's training on this rank: its sums on the device, the step it stopped at
    (``first`` is where it began) and its wall time."""

    loss_sum: torch.Tensor
    correct: torch.Tensor
    first: int
    step: int
    wall: float


def run(
    cfg: FinetuneConfig,
    device: torch.device | None = None,
    checkpointed: Callable[[EpochRecord], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune on this rank; the process group must be initialised (by torchrun's
    :func:`main_worker`, or by Ray Train in the ``ray`` backend, which passes the ``device``
    it assigned, and ``checkpointed``: called on every rank with the epoch's record once its
    checkpoint is in ``cfg.out``, so Ray can keep it in its storage).
    Always wrapped in DDP with the run's comm hook, at every world size (one
    included). The recipe (``training.recipe``) plans the run from the data; with ``auto`` the
    rate is searched first and the model returned is the best validation checkpoint. Returns
    the last epoch's record (the same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if device is None:
        device = _rank_device()
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    report = Reporter(lambda event: _log(event, out), active=rank == 0)
    report.phase("loading data")

    entry, train, r = _setup(cfg, device, rank, world)
    progress = _start(r, out, report)
    record = _train(r, progress, out, report, checkpointed)
    if cfg.max_steps is not None:  # a rung: its checkpoint is the product, not a model file
        if record is None:  # nothing left to train (a re-delivered rung that had finished)
            record = _standing(r, progress, out)
        dist.barrier()
        return record.to_dict()
    if record is None and progress.best is not None:  # resumed after the last epoch
        r.model.load_state_dict(progress.best)  # the best again
    _write_model(r, entry, train, progress.choices, record, out, report)
    dist.barrier()
    return record.to_dict() if record else {}


def _rank_device() -> torch.device:
    """This rank's device under torchrun: its GPU (``LOCAL_RANK``) under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _setup(
    cfg: FinetuneConfig, device: torch.device, rank: int, world: int
) -> tuple[ZooEntry, TargetDataset, _Run]:
    """(zoo entry, training split, the rank's :class:`_Run`): the data, the model in DDP with
    the run's comm hook, and the recipe's plan for it."""
    from zoopick.selection.zoo import load_zoo
    from zoopick.training.comm import build, select

    entry = load_zoo(cfg.zoo)[cfg.model]
    train, test, val = _load_data(cfg, world)
    model = entry.create_model(num_classes=len(train.class_names))
    data_config = entry.data_config(model)

    def shard(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's contiguous shard of an evaluation set's tensors (views of them)."""
        lo, hi = rank * len(y) // world, (rank + 1) * len(y) // world
        return x[lo:hi], y[lo:hi]

    # the validation share once: a refit run trains on it too once the rate is chosen
    every_val = _tensors(val, data_config) if val is not None else None
    data = (
        _tensors(train, data_config),
        shard(*_tensors(test, data_config)),
        shard(*every_val) if every_val is not None else None,
    )

    amp = device.type == "cuda"
    model.to(device)
    if amp:
        model.to(memory_format=torch.channels_last)
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
    )
    select.CUDA_TRITON = cfg.comm_triton  # process-wide: read by the hooks' selection
    state, hook = build(cfg.compressor, cfg.comm_hook())  # validated when launch read cfg
    ddp.register_comm_hook(state, hook)
    r = _Run(cfg, model, ddp, state, device, amp, data_config, data, rank, world)
    share = None
    if val is not None:
        r.floor = recipe.chance_floor(
            list(val.class_counts().values()), list(train.class_counts().values())
        )
        r.n_val = len(val)
        share = _validation_share(train, val)
    refit = cfg.max_steps is None and recipe.refits(len(train) + r.n_val, share)
    steps_per_epoch = r.steps
    if refit:  # the run's length counts the images it trains on once the rate is chosen
        assert every_val is not None  # a refit needs a validation share (recipe.refits)
        x_val, y_val = every_val
        r.every_image = (torch.cat([r.x_train, x_val]), torch.cat([r.y_train, y_val]))
        steps_per_epoch = _epoch_shape(len(r.every_image[1]), world, cfg.batch_size)[2]
    r.plan = recipe.plan(
        cfg,
        steps_per_epoch=steps_per_epoch,
        validation=share,
        rung=cfg.max_steps is not None,
        refit=refit,
    )
    return entry, train, r


def _start(r: _Run, out: Path, report: Reporter) -> _Progress:
    """Where the run starts: from scratch, from its own checkpoint (``resume``), or from
    another run's (``init_from``, a race winner's); the recipe's choices (searched now unless
    the checkpoint holds them) and the optimizer, its state restored."""
    cfg, model, rank = r.cfg, r.model, r.rank
    start_epoch = start_step = 0
    resumed = cfg.resume and (out / CHECKPOINT).exists()
    saved: dict[str, Any] = {}
    # another run's checkpoint (a race winner's) that this one starts from: read once, its
    # weights now (the search starts from them), its optimizer state once the optimizer exists
    seed = _load(Path(cfg.init_from)) if cfg.init_from and not resumed else None
    if seed is not None:  # the comm hook's residuals start from zero: that run had its own
        model.load_state_dict(seed["model"])
    if resumed:
        start_epoch, start_step, saved = _restore(out, cfg, model, r.state, rank, r.world)
    choices = saved.get("recipe")
    if choices is None:
        choices = _choose(r, report)
        if rank == 0:
            _log(RunEvent("recipe", recipe=choices.to_dict()), out)
    else:
        choices = recipe.Choices(**choices)
    if r.plan.refit:  # the rate is chosen: every training image from here on
        r.train_on(*r.every_image)
    opt = _optimizer(model, r.plan, choices.lr)
    if resumed:
        opt.load_state_dict(saved["optimizer"])
        if rank == 0:
            _log(RunEvent("resumed", epoch=start_epoch, workers=r.world), out)
    elif seed is not None:
        _init_optimizer(seed, cfg, opt)
    history = list(saved.get("history", []))
    return _Progress(start_epoch, start_step, opt, choices, saved.get("best"), history)


def _train(
    r: _Run,
    progress: _Progress,
    out: Path,
    report: Reporter,
    checkpointed: Callable[[EpochRecord], None] | None = None,
) -> EpochRecord | None:
    """The epochs from where the run starts, each recorded and checkpointed; the last one's
    record, or None where nothing was left to train. A run with ``max_steps`` may stop
    mid-epoch, the auto recipe's early; the model is left at the run's product (its best
    validation checkpoint where the recipe keeps one)."""
    steps, limit, choices = r.steps, r.limit, progress.choices
    timer = _CommTimer(r.state)
    record: EpochRecord | None = None
    for epoch in range(progress.epoch, r.epochs):
        if choices.stopped_early:
            break
        first = progress.step if epoch == progress.epoch else 0
        last = min(steps, limit - epoch * steps)  # a run with max_steps may stop mid-epoch
        if last <= first:
            break
        trained = _train_epoch(r, progress, epoch, first, last, report)
        comm = timer.take()
        step = trained.step
        finished = step == steps
        ending = choices.stopped_early or epoch * steps + step >= limit
        if ending and progress.best is not None:
            r.model.load_state_dict(progress.best)  # the run returns its best validation checkpoint
        record = _epoch_record(r, progress, epoch, trained, comm, ending, report)
        if r.rank == 0:
            _log(record, out)
        resume_at = (epoch + 1, 0) if finished else (epoch, step)
        extra = {"recipe": choices.to_dict(), "best": progress.best, "history": progress.history}
        _save(out, r.cfg, r.model, progress.opt, r.state, *resume_at, r.rank, r.world, extra)
        if checkpointed is not None:
            checkpointed(record)
        if not finished or choices.stopped_early:
            break
    return record


def _train_epoch(
    r: _Run, progress: _Progress, epoch: int, first: int, last: int, report: Reporter
) -> _Trained:
    """Steps ``first`` to ``last`` of ``epoch``; where the plan keeps the best checkpoint,
    validation at its intervals (which may stop the run early)."""
    steps, limit, epochs, lr = r.steps, r.limit, r.epochs, progress.choices.lr
    order, gen = r.order(epoch), r.augmenter(epoch)
    r.ddp.train()
    t0 = time.perf_counter()
    report.phase("training", epoch=epoch + 1, epochs=epochs, step=first, steps=steps)
    # summed on the device: a step never waits for the GPU (a report reads them)
    loss_sum = torch.zeros((), dtype=torch.float64, device=r.device)
    correct = torch.zeros((), dtype=torch.float64, device=r.device)
    step = first
    while step < last:
        at = epoch * steps + step
        _set_lr(progress.opt, r.rate(lr, at))
        xb, yb = r.batch_at(order, step, gen)
        loss, logits = r.step(progress.opt, xb, yb)
        loss_sum += loss.detach().double() * len(yb)
        correct += (logits.argmax(1) == yb).sum()
        step += 1
        if report.due(step - 1, first, last):
            report.step(
                epoch=epoch + 1,
                epochs=epochs,
                step=step,
                steps=steps,
                loss_sum=loss_sum,
                correct=correct,
                seen=(step - first) * r.batch,
            )
        due = r.plan.keep_best and ((at + 1) % r.plan.eval_every == 0 or at + 1 == limit)
        if due and _validate(r, progress, at + 1):  # eval_every is 0 unless keep_best
            break
    return _Trained(loss_sum, correct, first, step, time.perf_counter() - t0)


def _validate(r: _Run, progress: _Progress, done: int) -> bool:
    """The auto recipe's look at the validation split after ``done`` steps: the weights kept
    when they are the best so far; True when the run stops early here."""
    acc, _ = r.evaluate(r.val)
    progress.history.append(acc)
    if recipe.keeps(progress.history, r.n_val):
        progress.choices.best_val_accuracy, progress.choices.best_step = acc, done
        progress.best = _copy_weights(r.model)
    r.ddp.train()
    stop = recipe.should_stop(
        progress.history, step=done, steps=r.limit, patience=r.plan.patience, n=r.n_val
    )
    if stop and done < r.limit:
        progress.choices.stopped_early = True
        return True
    return False


def _epoch_record(
    r: _Run,
    progress: _Progress,
    epoch: int,
    trained: _Trained,
    comm: dict[str, float],
    ending: bool,
    report: Reporter,
) -> EpochRecord:
    """The epoch's record, summed over the ranks, with the held-out accuracy of the model as
    it now stands; raises :class:`Diverged` (on every rank) when the loss is not finite."""
    from zoopick.training.comm.stats import dense_allreduce_bytes

    cfg, world, steps, choices = r.cfg, r.world, r.steps, progress.choices
    used = (trained.step - trained.first) * r.batch
    report.phase("evaluating", epoch=epoch + 1, epochs=r.epochs)
    test_correct, test_losses = _evaluate(
        r.model, *r.test, r.data_config, r.device, cfg.batch_size * 2, r.amp
    )
    test_n = len(test_losses)
    totals = _all_sum(
        [
            float(trained.loss_sum),
            float(trained.correct),
            used,
            test_correct,
            test_n,
            comm["bytes_sent"],
        ],
        r.device,
    )
    if not math.isfinite(totals[0]):  # the same sum on every rank: all of them stop
        raise Diverged(
            f"the training loss is not finite in epoch {epoch + 1} ({totals[0] / totals[2]}):"
            f" the run diverged (lr {choices.lr}, weight_decay {r.plan.weight_decay}); no model "
            "is written"
        )
    values = {r.held: totals[3] / max(totals[4], 1)}
    if r.plan.keep_best and progress.history:
        values["val_accuracy"] = choices.best_val_accuracy if ending else progress.history[-1]
    return EpochRecord(
        epoch=epoch + 1,
        loss=totals[0] / totals[2],
        train_accuracy=totals[1] / totals[2],
        bytes_sent=totals[5] / world,  # per worker
        compute_seconds=max(trained.wall - comm["select_s"] - comm["comm_s"], 0.0),
        select_seconds=comm["select_s"],
        comm_seconds=comm["comm_s"],
        workers=world,
        compressor=cfg.compressor,
        iterations=int(comm["iterations"]),
        dense_bytes=dense_allreduce_bytes(comm["numel"], world),
        steps=epoch * steps + trained.step,
        **values,
    )


def _standing(r: _Run, progress: _Progress, out: Path) -> EpochRecord:
    """Where a rung with nothing left to train stands (a re-delivered rung that had already
    finished), so whoever waits for it gets its validation accuracy."""
    acc, _ = r.evaluate(r.test)
    record = EpochRecord(
        epoch=progress.epoch + (1 if progress.step else 0),
        steps=progress.epoch * r.steps + progress.step,
        workers=r.world,
        compressor=r.cfg.compressor,
        **{r.held: acc},
    )
    if r.rank == 0:
        _log(record, out)
    return record


def _write_model(
    r: _Run,
    entry: ZooEntry,
    train: TargetDataset,
    choices: recipe.Choices,
    record: EpochRecord | None,
    out: Path,
    report: Reporter,
) -> None:
    """The fine-tuned model (rank 0) as safetensors beside its config: architecture, classes,
    data config, the last record and the recipe's choices. Every replica must end with the
    same parameters (the hooks apply the same averaged update on every rank): their digests
    are recorded, so a run whose replicas drifted apart can be told."""
    from zoopick.selection.zoo import save_checkpoint

    digests: list[str | None] = [None] * r.world
    dist.all_gather_object(digests, _parameter_digest(r.model))
    if r.rank != 0:
        return
    report.phase("saving the model")
    save_checkpoint(r.model, out / FINAL_WEIGHTS)
    meta = {
        "rank_digests": digests,
        "arch": entry.arch,
        "source_model": entry.id,
        "num_classes": len(train.class_names),
        "class_names": list(train.class_names),
        "data_config": {
            k: list(v) if isinstance(v, tuple) else v for k, v in r.data_config.items()
        },
        "final": record.to_dict() if record else None,
        "recipe": choices.to_dict(),
    }
    (out / FINAL_CONFIG).write_text(json.dumps(meta, indent=2))


def _validation_share(train, val) -> float:
    """The share of the training images the validation split took (for the plan's record)."""
    return len(val) / (len(train) + len(val))


def _choose(r: _Run, report: Reporter) -> recipe.Choices:
    """The recipe's choices before training: the rate (searched where the plan says so)."""
    plan = r.plan
    if plan.lr is not None:
        return recipe.Choices(plan=plan.to_dict(), lr=plan.lr)
    t0 = time.perf_counter()
    trials = r.search(report)
    chosen = recipe.pick(trials, r.floor, r.noise)
    return recipe.Choices(
        plan=plan.to_dict(),
        lr=chosen,
        trials=[vars(t) for t in trials],
        search_floor=r.floor.accuracy if r.floor else None,
        search_loss_floor=r.floor.loss if r.floor else None,
        search_seconds=time.perf_counter() - t0,
    )


def _parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters, in order. Buffers are left out: batch norm's
    running statistics follow each rank's own last batches (DDP copies rank 0's at each
    forward, and the forward then updates them locally), and rank 0's are the ones saved."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in model.named_parameters():
        h.update(name.encode())
        h.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_file(out: Path, rank: int) -> Path:
    return out / COMM_STATE.format(rank=rank)


def _save(out, cfg, model, opt, state, epoch, step, rank, world, extra) -> None:
    """Model + optimizer from rank 0 (identical everywhere); each rank's error-feedback
    residuals beside it, since those differ per worker and a resumed run needs them.
    ``epoch`` epochs are complete, and ``step`` steps of the next one (a run that stopped at
    ``max_steps``). ``extra``: the recipe's state (its choices, the best validation weights
    and the validation history), so a resumed run neither searches again nor loses its best.

    The residuals are written first and tagged with the point they belong to (``at``), and
    rank 0 writes the checkpoint only once every rank's are on disk (the first barrier): a
    reader that takes the folder's files while they change (the store's uploader, a worker
    killed mid-save) never finds a checkpoint newer than a rank's residuals, and
    :func:`_restore` refuses residuals of another point (the next save's, written before its
    checkpoint) rather than pair them with this one."""
    _atomic_save({**state.state_dict(model), "at": [epoch, step]}, state_file(out, rank))
    dist.barrier()
    if rank == 0:
        blob = {
            "epoch": epoch,
            "step": step,
            "world": world,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "config": cfg.model_dump(mode="json"),
            **extra,
        }
        _atomic_save(blob, out / CHECKPOINT)
    dist.barrier()


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _restore(out, cfg, model, state, rank, world) -> tuple[int, int, dict[str, Any]]:
    """(epochs done, steps done of the next epoch, the rest of the checkpoint: optimizer
    state and the recipe's) to continue after. The hook's residuals and scheme state come
    back too, unless the run continues on another number of workers (an elastic run that lost
    or gained one): each rank's residuals belong to its shard of the data, so they start from
    zero then, as at the start of a run; likewise when a rank's residuals were saved at
    another point than the checkpoint (``at``, see :func:`_save`; residuals from before the
    tag are taken as they are)."""
    blob = _load(out / CHECKPOINT)
    changed = cfg.same_run(blob["config"])
    if changed:
        raise ValueError(f"--resume: the run's settings changed since the checkpoint: {changed}")
    model.load_state_dict(blob["model"])
    where = int(blob["epoch"]), int(blob.get("step", 0))
    if blob.get("world", world) != world:
        return (*where, blob)
    path = state_file(out, rank)
    if not path.exists():
        raise ValueError(f"--resume: {path.name} is missing (was the run on more workers?)")
    residuals = torch.load(path, map_location="cpu", weights_only=True)
    at = residuals.pop("at", None)
    if at is not None and tuple(at) != where:
        return (*where, blob)
    state.load_state_dict(model, residuals)
    return (*where, blob)


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def _init_optimizer(blob: dict[str, Any], cfg: FinetuneConfig, opt) -> None:
    """Another run's optimizer state (``blob``, its checkpoint: momentum, Adam's moments) when
    it used the same optimizer and parameter groups, so no step it took is lost; this run's
    own rate (set at every step), weight decay and momentum apply from here on."""
    saved = blob.get("optimizer", {})
    theirs = FinetuneConfig.stored(blob.get("config", {})).resolved("optimizer")
    same = theirs == cfg.resolved("optimizer")
    if not same or len(saved.get("param_groups", [])) != len(opt.param_groups):
        return
    mine = [(g["lr_scale"], g["weight_decay"], g.get("momentum")) for g in opt.param_groups]
    opt.load_state_dict(saved)
    for group, (scale, decay, momentum) in zip(opt.param_groups, mine, strict=True):
        group["lr_scale"], group["weight_decay"] = scale, decay
        if momentum is not None:
            group["momentum"] = momentum


def main_worker(cfg: FinetuneConfig) -> int:
    """Entry point of one worker process under torchrun: init the group, run, clean up."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        run(cfg)
    except Exception as exc:
        error = TrainerError(failure_text(type(exc).__name__, str(exc)), dist.get_rank())
        write_line(sys.stderr, error.to_json())
        raise
    finally:
        dist.destroy_process_group()
        # DDP, its reducer and the hook's futures form reference cycles that hold the process
        # group and gloo's work objects: freed here, while the interpreter is whole, not by
        # its finalisation (see ``launch.exit_now``)
        gc.collect()
    return 0
