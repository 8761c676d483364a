"""The fine-tuning contract, owned by the trainer: the one config (defaults included), the
files a run writes, and the per-epoch record with its writer and parser.

Everyone who starts or follows a run uses this module: ``zoopick train``, the API's job schema
(:class:`FinetuneOptions` is the job's ``finetune`` body), the service's training task (which
places a job's options into a :class:`FinetuneConfig` and reads the records back), the
backends and the trainer itself. It imports no torch, so the API and a Celery worker can use
it without loading the trainer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TextIO

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from zoopick.training import comm_options

CHECKPOINT = "checkpoint.pt"
"""Model, optimizer and config after the last finished epoch (``--resume`` reads it)."""
FINAL_WEIGHTS = "model.safetensors"
"""The fine-tuned model, written by rank 0 when the run succeeds."""
FINAL_CONFIG = "model.json"
"""Architecture, classes and data config beside the final weights."""
COMM_STATE = "comm-state-rank{rank}.pt"
"""Each rank's comm hook state (residuals, scheme state) beside the checkpoint."""
METRICS = "metrics.jsonl"
"""One :class:`EpochRecord` (or a ``resumed`` :class:`RunEvent`) per line, as printed on
stdout: what the ``ray`` backend's driver follows."""
RUN_CONFIG = "run.json"
"""The :class:`FinetuneConfig` a run was started with (the document every backend is handed)."""

DEFAULT_WORKERS = 2
"""Data-parallel worker processes when there is no GPU to count (one per GPU otherwise)."""
MAX_WORKERS = 4096

SPARSE_WARMUP = 4
"""Iterations of DGC's exponential warm-up a sparse hook gets when a run names none
(``warmup`` in ``hook_options``; ``warmup=0`` turns it off): density 25 %, 6.25 %, 1.56 %,
then the target for 1 % (below 0.4 % a fourth step). Fine-tuning a pretrained model with
spardl at 1 %, 5 seeds, ended 0.8 points below dense without it and inside dense's seed
spread with it (``benchmarks/convergence/README.md``); it costs about a third of one dense
iteration's bytes."""


class WorkerRange(BaseModel):
    """An elastic worker count: the run starts on as many workers as the pool can give, at
    least ``min`` and at most ``max``, and carries on with fewer (down to ``min``) when a
    machine is lost (the ``ray`` backend; the local one runs ``max``)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    min: int = Field(ge=1, le=MAX_WORKERS)
    max: int = Field(ge=1, le=MAX_WORKERS)

    @model_validator(mode="after")
    def _ordered(self) -> WorkerRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class FinetuneOptions(BaseModel):
    """What a user chooses about a fine-tune: the one typed object a job's ``finetune`` body,
    the dashboard's form and ``zoopick train``'s flags become, with the only defaults.

    Validated once, where it is made (pydantic, no torch: the hook and its options against
    ``training.comm_options``); stored as it is (``model_dump(mode="json")``) and read back
    without a second check. Types are strict: ``"epochs": "2"`` or ``2.0`` is refused, not
    coerced; a float field takes an integer."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    recipe: Literal["auto", "fixed"] = Field(
        "auto",
        description="How unset fields are chosen. auto: a length in steps from the data, "
        "warm-up and cosine, AdamW with the head's rate apart, a learning rate found by short "
        "trials on a validation split, label smoothing, and the best "
        "validation checkpoint returned (training.recipe). fixed: the defaults before it "
        "(3 epochs, SGD at a constant 0.01, the last weights).",
    )
    epochs: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="Passes over the training split; unset: the recipe's length (auto: 10 "
        "epochs, at least 400 and at most 4,000 steps; fixed: 3 epochs).",
    )
    workers: Annotated[int, Field(ge=1, le=MAX_WORKERS)] | WorkerRange = Field(
        DEFAULT_WORKERS,
        description='Data-parallel workers: a count, or {"min": m, "max": n} to run '
        "elastically on a pool (as many as it can give, carrying on with fewer after a loss).",
    )
    compressor: str = Field(
        "spardl",
        description=f"Communication hook: {', '.join(comm_options.HOOKS)}.",
        json_schema_extra={"enum": list(comm_options.HOOKS)},
    )
    density: float = Field(0.01, gt=0, le=1, description="Fraction of gradient entries sent.")
    hook_options: dict[str, Any] = Field(
        default_factory=dict,
        max_length=16,
        description="Options of the hook (e.g. spardl's teams, warmup, fp16). Sparse hooks "
        f"get {SPARSE_WARMUP} iterations of exponential warm-up unless warmup is given "
        "(0: none). Typed per hook, never coerced: the schema of each hook's options is "
        "below (anyOf, one per compressor).",
        json_schema_extra={"anyOf": comm_options.option_schemas()},
    )
    lr: float | None = Field(
        None,
        gt=0,
        le=10,
        description="The body's learning rate; unset: auto searches it, fixed uses 0.01.",
    )
    batch_size: int = Field(
        32,
        ge=2,
        le=65_536,
        description="Images per worker and step (at least 2: batch norm cannot train on one).",
    )
    optimizer: Literal["sgd", "adam", "adamw"] | None = Field(
        None, description="Unset: adamw (auto), sgd (fixed)."
    )
    momentum: float | None = Field(
        None, ge=0, lt=1, description="The optimizer's (sgd); unset: 0.9."
    )
    weight_decay: float | None = Field(
        None, ge=0, le=1, description="Unset: 0.01 with adamw, else 0."
    )
    label_smoothing: float | None = Field(
        None, ge=0, lt=1, description="Unset: 0.1 (auto), 0 (fixed)."
    )
    augment: bool | None = Field(
        None,
        description="Random shifts of up to 1/8 of the image side while training; unset: off.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1)
    max_per_class: int | None = Field(None, ge=1, description="Images kept per class.")
    test_fraction: float = Field(
        0.2, gt=0, lt=1, description="Held out for test accuracy when there is no test data."
    )
    bucket_cap_mb: float = Field(25.0, gt=0, le=1024, description="DDP's gradient buckets.")

    @field_validator("workers", mode="before")
    @classmethod
    def _count_or_range(cls, value: Any) -> int | WorkerRange:
        """One clear message for either form (a plain union would report both branches)."""
        if isinstance(value, dict):
            try:
                return WorkerRange.model_validate(value)
            except ValidationError as exc:
                raise ValueError(comm_options.describe(exc, WorkerRange)) from None
        if isinstance(value, WorkerRange):
            return value
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError('give a number of workers, or {"min": m, "max": n}')
        if not 1 <= value <= MAX_WORKERS:
            raise ValueError(f"the number of workers must be in [1, {MAX_WORKERS}]")
        return value

    @field_validator("compressor")
    @classmethod
    def _known_hook(cls, value: str) -> str:
        comm_options.options_model(value)  # "unknown comm hook 'x'; available: ..."
        return value

    @field_validator("hook_options")
    @classmethod
    def _hook_accepts(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """The hook's options as ``make_hook`` will check them (names, types, ranges)."""
        if "compressor" in info.data and "density" in info.data:
            comm_options.validate(
                info.data["compressor"], density=info.data["density"], options=value
            )
        return value

    @model_validator(mode="after")
    def _momentum_once(self) -> FinetuneOptions:
        check_momentum(self.hook_options, self.resolved("optimizer"), self.resolved("momentum"))
        comm_options.check_world(
            self.compressor, self.hook_options, self.min_workers, self.max_workers
        )
        return self

    def resolved(self, name: str) -> Any:
        """A field as the run uses it: the user's value, else the recipe's
        (``training.recipe.value``; None where the data decide, as auto's lr and epochs)."""
        from zoopick.training import recipe

        return recipe.value(self, name)

    @property
    def max_workers(self) -> int:
        """The most workers the run uses (its only count when it is not elastic)."""
        return self.workers.max if isinstance(self.workers, WorkerRange) else self.workers

    @property
    def min_workers(self) -> int:
        return self.workers.min if isinstance(self.workers, WorkerRange) else self.workers

    def feeding_problem(self, counts: Iterable[int], *, test_share: bool = True) -> str | None:
        """Why a dataset of these class sizes cannot feed this fine-tune, or None: its
        training split (each class capped at ``max_per_class``, less its test share by the
        trainer's own rule unless the test data is a file of its own) must give every worker
        at least 2 images. Checked where a run is asked for (a job's submission, ``zoopick
        train``), not where its workers have started."""
        from zoopick.selection.data import training_count

        capped = [min(int(n), self.max_per_class or int(n)) for n in counts]
        if test_share and capped and max(capped) < 2:
            return (
                f"max_per_class={self.max_per_class} leaves no class 2 images to split into "
                "training and test"
            )
        train = training_count(capped, fractions=(self.test_fraction,) if test_share else ())
        if train // self.max_workers < 2:
            return (
                f"the dataset's {train} training images cannot feed {self.max_workers} "
                "workers, 2 images each at least; use fewer workers or a larger dataset"
            )
        return None

    @property
    def workers_label(self) -> str:
        """``"2"``, or ``"1-4"`` for an elastic run."""
        lo, hi = self.min_workers, self.max_workers
        return str(hi) if lo == hi else f"{lo}-{hi}"

    def comm_options(self) -> dict[str, Any]:
        """The hook's options as the run uses them: ``hook_options`` plus the default sparse
        warm-up (:data:`SPARSE_WARMUP`) for a hook that has one and was given none."""
        options = dict(self.hook_options)
        if "warmup" not in options and comm_options.has_option(self.compressor, "warmup"):
            options["warmup"] = SPARSE_WARMUP
        return options

    def comm_hook(self) -> comm_options.HookOptions:
        """The hook's options as the typed object its state takes (``training.comm.build``):
        :meth:`comm_options` with ``density``, not validated again (they were, with these
        options, where they entered)."""
        return comm_options.stored(
            self.compressor, density=self.density, options=self.comm_options()
        )

    @classmethod
    def stored(cls, data: Mapping[str, Any]) -> FinetuneOptions:
        """Options as a job row stored them (validated when the job was submitted): read
        back without validating again; fields added since take their defaults."""
        known = {k: v for k, v in data.items() if k in cls.model_fields}
        # stored before the recipe existed: those jobs ran (and re-run) the fixed recipe
        known.setdefault("recipe", "fixed")
        if isinstance(known.get("workers"), Mapping):
            known["workers"] = WorkerRange.model_construct(**known["workers"])
        return cls.model_construct(**known)


class FinetuneConfig(FinetuneOptions):
    """One run: the options plus where its inputs and outputs are. Every backend (torchrun on
    this machine, Ray Train on a pool) is handed it as one JSON document
    (:meth:`to_json`, :data:`RUN_CONFIG` in the run folder); checkpoints keep it so a resumed
    run can refuse a changed one."""

    zoo: str = Field(min_length=1, description="Zoo manifest.")
    model: str = Field(min_length=1, description="Zoo id of the model.")
    data: str = Field(min_length=1, description="Training dataset.")
    out: str = Field(min_length=1, description="Run folder.")
    test_data: str | None = None
    resume: bool = False
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Stop after this many optimizer steps in all, counted from the run's start "
        "across resumptions, mid-epoch if need be; it replaces epochs as the run's length (a "
        "rung of a race: the next rung resumes the same run with a larger value).",
    )
    validation_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Hold out this stratified share of the training split and report "
        "validation accuracy on it instead of test accuracy (a race: the test split is never "
        "looked at, so it stays an unbiased estimate for the final fine-tune).",
    )
    init_from: str | None = Field(
        None,
        min_length=1,
        description="A checkpoint of another run (its checkpoint.pt) whose model and optimizer "
        "state start this run when it has none of its own (the final fine-tune starts from the "
        "race winner's).",
    )
    decay_from: int | None = Field(
        None,
        ge=0,
        description="With max_steps (a rung of a race): the step the rung starts at. The "
        "learning rate falls from lr down a cosine over steps decay_from to max_steps "
        "(training.race.rung_lr_factor) and the next rung restarts it, so every rung is judged "
        "at the end of an annealed run. None: a constant rate.",
    )

    dataset_limits: dict[str, Any] | None = Field(
        None,
        description="The bounds the run loads its datasets under "
        "(zoopick.selection.limits.DatasetLimits' fields: the deployment's, which validated "
        "the dataset); None: the library's defaults.",
    )

    comm_triton: bool = Field(
        False,
        description="On CUDA, the comm hooks select with the fused Triton kernels "
        "(zoopick.training.comm.triton_kernels) instead of torch.topk: the deployment's "
        "ZOOPICK_COMM_TRITON, or zoopick train's --comm-triton. The run's process sets "
        "training.comm.select.CUDA_TRITON from it before its hook is built.",
    )

    decoded: str | None = Field(
        None,
        min_length=1,
        description="A folder holding the training data decoded once at validation "
        "(zoopick.selection.decoded): the run reads its images there instead of decoding the "
        "file again, and reads the file where the folder holds no usable copy.",
    )

    # fields that may change between a run and its resumption
    _RESUMABLE = frozenset(
        {
            "epochs",
            "resume",
            "out",
            "max_steps",
            "decay_from",
            "dataset_limits",
            "decoded",
            "comm_triton",  # the same selection, ties aside: a resumed run may switch
        }
    )

    @model_validator(mode="after")
    def _decay_within_the_run(self) -> FinetuneConfig:
        if self.decay_from is not None and (
            self.max_steps is None or self.decay_from >= self.max_steps
        ):
            raise ValueError("decay_from needs max_steps, and must be below it")
        return self

    @classmethod
    def for_run(
        cls, options: FinetuneOptions, *, zoo: str, model: str, data: str, out: str, **where: Any
    ) -> FinetuneConfig:
        """``options`` placed: zoo, model, data, run folder (and what ``where`` adds: a rung's
        steps, a run to resume). Not validated again: the options were where they entered (a
        job's submission, ``zoopick train``) and a job row holds them as validated then; the
        run's process validates the whole config once, when it reads its file
        (:meth:`from_json`)."""
        unknown = sorted(set(where) - set(cls.model_fields))
        if unknown:
            raise TypeError(f"FinetuneConfig has no field(s) {unknown}")
        fields = {k: getattr(options, k) for k in FinetuneOptions.model_fields}
        return cls.model_construct(**fields, zoo=zoo, model=model, data=data, out=out, **where)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> FinetuneConfig:
        """A run's config as its process reads it from a file: the one validation there."""
        return cls.model_validate_json(text)

    # fields that name files: one file however it is spelt (./zoo.yaml, an absolute path)
    _PATHS = frozenset({"zoo", "data", "test_data", "init_from"})
    # the files a run reads and writes, named absolutely before it starts anywhere
    _RUN_FILES = ("zoo", "data", "out", "test_data")

    def with_absolute_paths(self) -> FinetuneConfig:
        """This config with its files named absolutely (resolved from the current directory):
        OUT/run.json then works from any directory, and Ray runs each worker in a folder of
        its own."""
        update = {k: str(_resolved(v)) for k in self._RUN_FILES if (v := getattr(self, k))}
        return self.model_copy(update=update)

    def same_run(self, other: Mapping[str, Any]) -> list[str]:
        """Names of fields that differ from a saved config (ignoring the resumable ones);
        paths are compared as the files they name, resolved from the current directory."""
        mine = self.model_dump(mode="json")

        def differs(key: str) -> bool:
            a, b = mine[key], other.get(key)
            if key in self._PATHS and isinstance(a, str) and isinstance(b, str):
                return _resolved(a) != _resolved(b)
            return a != b

        return sorted(k for k in mine if k not in self._RESUMABLE and differs(k))


def _resolved(path: str) -> Path:
    return Path(path).expanduser().resolve()


def default(name: str) -> Any:
    """The default of a :class:`FinetuneOptions` field (for CLI options and forms)."""
    field = FinetuneOptions.model_fields[name]
    return field.default_factory() if field.default_factory else field.default


def describe(exc: ValidationError) -> str:
    """A validation error of the options as one line naming each bad field."""
    return comm_options.describe(exc, FinetuneConfig)


def check_momentum(hook_options: Mapping[str, Any], optimizer: str, momentum: float) -> None:
    """Hook momentum (DGC momentum correction) and optimizer momentum are exclusive: both on
    would apply momentum twice (the hook's ``u <- m u + g`` feeds an optimizer that does the
    same), so reject the pair with a message saying which to turn off."""
    hook_m = hook_options.get("momentum", 0.0)
    hook_m = float(hook_m) if isinstance(hook_m, int | float) else 0.0
    if hook_m <= 0.0:
        return
    if optimizer in ("adam", "adamw"):
        raise ValueError(
            f"hook_options momentum={hook_m} with the {optimizer} optimizer: Adam keeps its own "
            "moments; drop the hook's momentum"
        )
    if momentum > 0.0:
        raise ValueError(
            f"hook_options momentum={hook_m} and optimizer momentum={momentum} would apply "
            "momentum twice; set momentum=0 (the hook's momentum correction replaces it) or "
            "drop the hook's momentum"
        )


# -- what a run prints: one record per epoch, or an error ------------------------------------


@dataclass(frozen=True)
class EpochRecord:
    """One epoch of a run, averaged over the workers (``bytes_sent`` is per worker).

    On the wire (stdout, ``metrics.jsonl``) it is one JSON object per line:
    ``{"epoch", "loss", "train_acc", "test_acc", "bytes_sent", "seconds": {"compute",
    "select", "communicate"}, "workers", "compressor", "iterations", "dense_bytes", "val_acc",
    "steps"}``;
    :meth:`to_json` and :func:`parse_line` are the only writer and reader of that form.
    ``dense_bytes`` is what a dense float32 all-reduce of the same gradients would have sent
    per worker over the epoch (``comm.stats.dense_allreduce_bytes``): the baseline of
    ``bytes_sent``; per iteration, divide both by ``iterations``."""

    epoch: int
    loss: float | None = None
    train_accuracy: float | None = None
    test_accuracy: float | None = None
    bytes_sent: float | None = None
    compute_seconds: float | None = None
    select_seconds: float | None = None
    comm_seconds: float | None = None
    workers: int | None = None
    compressor: str | None = None
    iterations: int | None = None
    dense_bytes: float | None = None
    val_accuracy: float | None = None
    steps: int | None = None
    """Optimizer steps since the run started (a record may close a partial epoch when the
    run has ``max_steps``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "loss": self.loss,
            "train_acc": self.train_accuracy,
            "test_acc": self.test_accuracy,
            "bytes_sent": self.bytes_sent,
            "seconds": {
                "compute": self.compute_seconds,
                "select": self.select_seconds,
                "communicate": self.comm_seconds,
            },
            "workers": self.workers,
            "compressor": self.compressor,
            "iterations": self.iterations,
            "dense_bytes": self.dense_bytes,
            "val_acc": self.val_accuracy,
            "steps": self.steps,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpochRecord:
        seconds = data.get("seconds")
        seconds = seconds if isinstance(seconds, Mapping) else {}

        num = finite_or_none
        return cls(
            epoch=int(data["epoch"]),
            loss=num(data.get("loss")),
            train_accuracy=num(data.get("train_acc")),
            test_accuracy=num(data.get("test_acc")),
            bytes_sent=num(data.get("bytes_sent")),
            compute_seconds=num(seconds.get("compute")),
            select_seconds=num(seconds.get("select")),
            comm_seconds=num(seconds.get("communicate")),
            workers=None if data.get("workers") is None else int(data["workers"]),
            compressor=None if data.get("compressor") is None else str(data["compressor"]),
            iterations=None if data.get("iterations") is None else int(data["iterations"]),
            dense_bytes=num(data.get("dense_bytes")),
            val_accuracy=num(data.get("val_acc")),
            steps=None if data.get("steps") is None else int(data["steps"]),
        )


MAX_ERROR_CHARS = 2000
"""An error line stays well under the 4 KiB a pipe writes atomically (see :func:`write_line`)."""


def write_line(stream: TextIO, line: str) -> None:
    """Write ``line`` and its newline in one ``write`` and flush: every rank shares torchrun's
    stderr, and ``print`` on an unbuffered stream writes the text and the newline separately,
    so two ranks failing at once could interleave into one unreadable line."""
    stream.write(line + "\n")
    stream.flush()


PLAIN_ERRORS = frozenset({"CommError", "DatasetError", "LimitExceeded", "ZooError"})
"""Our own errors, whose messages already say in plain words what is wrong: a failed job's
error shows the message alone, not the class name (which tells a user nothing)."""


def failure_text(name: str, message: str) -> str:
    """What a run's error says: ``message``, after the exception's class ``name`` unless
    it is one of :data:`PLAIN_ERRORS` (an unexpected error keeps its name: a clue)."""
    return message if name in PLAIN_ERRORS else f"{name}: {message}"


@dataclass(frozen=True)
class TrainerError:
    """What a failing rank prints on stderr before it exits: ``{"error": ..., "rank": r}``."""

    error: str
    rank: int | None = None

    def to_json(self) -> str:
        return json.dumps({"error": self.error[:MAX_ERROR_CHARS], "rank": self.rank})

    def describe(self) -> str:
        return f"rank {'?' if self.rank is None else self.rank}: {self.error}"


@dataclass(frozen=True)
class RunEvent:
    """Something that happened to a run besides an epoch, on its own line:
    ``{"event": "started", "backend": "ray", "ref": <the Ray job id>}`` (the driver, once
    connected) or ``{"event": "resumed", "epoch": e, "workers": w}`` (rank 0, continuing
    from the checkpoint of epoch ``e`` after a worker or node was lost, or a re-delivery), or
    ``{"event": "progress", "phase": ..., "epoch": e, "epochs": n, "step": j, "steps": m,
    "loss": l, "train_acc": a, "host": h}`` (rank 0, as it goes: the phase it is in, and during
    an epoch the step reached with rank 0's running mean loss and accuracy so far, a
    sub-epoch point of the curve, read from values the loop already holds on the host)."""

    event: Literal["started", "resumed", "progress", "recipe"]
    epoch: int | None = None
    workers: int | None = None
    backend: str | None = None
    ref: str | None = None
    phase: str | None = None
    epochs: int | None = None
    step: int | None = None
    steps: int | None = None
    loss: float | None = None
    train_acc: float | None = None
    host: str | None = None
    recipe: dict[str, Any] | None = None
    """``{"event": "recipe", "recipe": {...}}`` (rank 0, before training): what the recipe
    chose (``training.recipe.Choices``: the plan, the rate and how it was found, the search's
    curve)."""

    def to_json(self) -> str:
        fields = {k: v for k, v in vars(self).items() if v is not None}
        return json.dumps(fields)


def finite_or_none(value: Any) -> float | None:
    """A number read from the trainer's output, or None where it is missing or not finite.

    Why: Python's ``json`` writes and reads ``NaN`` and ``Infinity``, but neither PostgreSQL's
    JSON columns (a diverging run's running loss in ``training_runs.progress`` failed the whole
    task) nor an HTTP response can carry them; a loss that is not a number is not known."""
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def parse_line(line: str) -> EpochRecord | TrainerError | RunEvent | None:
    """The record a line of the trainer's output holds, or None for any other line (logs,
    tracebacks, a half-written line)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    try:
        if "error" in data:
            rank = data.get("rank")
            return TrainerError(str(data["error"]), rank if isinstance(rank, int) else None)
        if data.get("event") == "recipe":
            choices = data.get("recipe")
            return RunEvent("recipe", recipe=choices) if isinstance(choices, dict) else None
        if data.get("event") in ("started", "resumed", "progress"):
            ints = ("epoch", "workers", "epochs", "step", "steps")
            num = {k: int(data[k]) for k in ints if data.get(k) is not None}
            real = {k: finite_or_none(data.get(k)) for k in ("loss", "train_acc")}
            texts = ("backend", "ref", "phase", "host")
            text = {k: str(data[k])[:200] for k in texts if data.get(k) is not None}
            return RunEvent(data["event"], **num, **real, **text)
        if "epoch" in data:
            return EpochRecord.from_dict(data)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        return None
    return None
