"""The fine-tuning contract, owned by the trainer: the one config (defaults included), the
files a run writes, and the per-epoch record with its writer and parser.

Everyone who starts or follows a run uses this module: ``zoopick train``, the API's job schema
(its defaults and validation), the service's training task (which builds the config from a
job's options and reads the records back) and the trainer itself. It imports no torch, so the
API and a Celery worker can use it without loading the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TextIO

CHECKPOINT = "checkpoint.pt"
"""Model, optimizer and config after the last finished epoch (``--resume`` reads it)."""
FINAL_WEIGHTS = "model.safetensors"
"""The fine-tuned model, written by rank 0 when the run succeeds."""
FINAL_CONFIG = "model.json"
"""Architecture, classes and data config beside the final weights."""
METRICS = "metrics.jsonl"
"""One :class:`EpochRecord` per line, as printed on stdout."""

DEFAULT_WORKERS = 2
"""Data-parallel worker processes when there is no GPU to count (one per GPU otherwise)."""

JOB_OPTIONS = ("epochs", "lr", "compressor", "density", "hook_options")
"""The :class:`FinetuneConfig` fields a service job may set; the rest keep their defaults."""

SPARSE_WARMUP = 4
"""Iterations of DGC's exponential warm-up a sparse hook gets when a run names none
(``warmup`` in ``hook_options``; ``warmup=0`` turns it off): density 25 %, 6.25 %, 1.56 %,
then the target for 1 % (below 0.4 % a fourth step). Fine-tuning a pretrained model with
spardl at 1 %, 5 seeds, ended 0.8 points below dense without it and inside dense's seed
spread with it (``benchmarks/convergence/README.md``); it costs about a third of one dense
iteration's bytes."""


@dataclass
class FinetuneConfig:
    """Everything a run needs; stored in checkpoints so ``--resume`` can refuse a changed run.

    The defaults here are the only ones: the CLI, the API schema and the service's task take
    theirs from this class."""

    zoo: str
    model: str
    data: str
    out: str
    test_data: str | None = None
    test_fraction: float = 0.2
    max_per_class: int | None = None
    epochs: int = 3
    batch_size: int = 32
    lr: float = 0.01
    weight_decay: float = 0.0
    momentum: float = 0.9
    optimizer: str = "sgd"
    compressor: str = "spardl"
    density: float = 0.01
    hook_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    resume: bool = False
    bucket_cap_mb: float = 25.0

    def comm_options(self) -> dict[str, Any]:
        """The hook's options as the run uses them: ``hook_options`` plus the default sparse
        warm-up (:data:`SPARSE_WARMUP`) for a hook that has one and was given none."""
        from zoopick.training.comm import get

        options = dict(self.hook_options)
        if "warmup" not in options and "warmup" in get(self.compressor).options:
            options["warmup"] = SPARSE_WARMUP
        return options

    def check(self) -> None:
        """Reject values no run could use (raises ``ValueError`` naming the field); the hook
        and its options are checked by :func:`check_comm`."""
        if self.epochs < 1:
            raise ValueError("epochs must be >= 1")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not (0 < self.density <= 1):
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be sgd or adam, got {self.optimizer!r}")
        if not (0 < self.test_fraction < 1):
            raise ValueError("test_fraction must be in (0, 1)")
        check_momentum(self.hook_options, self.optimizer, self.momentum)

    # fields that may change between a run and its resumption
    _RESUMABLE = frozenset({"epochs", "resume", "out"})

    def same_run(self, other: dict[str, Any]) -> list[str]:
        """Names of fields that differ from a saved config (ignoring the resumable ones)."""
        mine = asdict(self)
        return sorted(k for k in mine if k not in self._RESUMABLE and mine[k] != other.get(k))

    @classmethod
    def from_job(
        cls, options: Mapping[str, Any], *, zoo: str, model: str, data: str, out: str, **extra: Any
    ) -> FinetuneConfig:
        """The config of a service job: its :data:`JOB_OPTIONS` over the defaults."""
        chosen = {k: options[k] for k in JOB_OPTIONS if options.get(k) is not None}
        return cls(zoo=zoo, model=model, data=data, out=out, **chosen, **extra)


def default(name: str) -> Any:
    """The default of a :class:`FinetuneConfig` field (for schemas and CLI options)."""
    for f in fields(FinetuneConfig):
        if f.name == name:
            return f.default_factory() if callable(f.default_factory) else f.default
    raise KeyError(name)


def check_momentum(hook_options: Mapping[str, Any], optimizer: str, momentum: float) -> None:
    """Hook momentum (DGC momentum correction) and optimizer momentum are exclusive: both on
    would apply momentum twice (the hook's ``u <- m u + g`` feeds an optimizer that does the
    same), so reject the pair with a message saying which to turn off."""
    hook_m = float(hook_options.get("momentum", 0.0) or 0.0)
    if hook_m <= 0.0:
        return
    if optimizer == "adam":
        raise ValueError(
            f"hook_options momentum={hook_m} with the adam optimizer: Adam keeps its own "
            "moments; drop the hook's momentum"
        )
    if momentum > 0.0:
        raise ValueError(
            f"hook_options momentum={hook_m} and optimizer momentum={momentum} would apply "
            "momentum twice; set momentum=0 (the hook's momentum correction replaces it) or "
            "drop the hook's momentum"
        )


def check_comm(
    compressor: str,
    density: float,
    hook_options: Mapping[str, Any],
    *,
    optimizer: str = "sgd",
    momentum: float = 0.9,
) -> None:
    """Validate the communication hook, its density and its options without starting any
    process (raises ``training.comm.CommError``, a ``ValueError``, naming the bad one).
    ``optimizer`` and ``momentum`` (the run's, :class:`FinetuneConfig`'s defaults unless
    given) are checked against the hook's momentum. Imports the hooks (and torch) on first
    use."""
    from zoopick.training.comm import check_options

    check_options(compressor, density=density, **dict(hook_options))
    check_momentum(hook_options, optimizer, momentum)


# -- what a run prints: one record per epoch, or an error ------------------------------------


@dataclass(frozen=True)
class EpochRecord:
    """One epoch of a run, averaged over the workers (``bytes_sent`` is per worker).

    On the wire (stdout, ``metrics.jsonl``) it is one JSON object per line:
    ``{"epoch", "loss", "train_acc", "test_acc", "bytes_sent", "seconds": {"compute",
    "select", "communicate"}, "workers", "compressor", "iterations", "dense_bytes"}``;
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
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpochRecord:
        seconds = data.get("seconds")
        seconds = seconds if isinstance(seconds, Mapping) else {}

        def num(value: Any) -> float | None:
            return None if value is None else float(value)

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
        )


MAX_ERROR_CHARS = 2000
"""An error line stays well under the 4 KiB a pipe writes atomically (see :func:`write_line`)."""


def write_line(stream: TextIO, line: str) -> None:
    """Write ``line`` and its newline in one ``write`` and flush: every rank shares torchrun's
    stderr, and ``print`` on an unbuffered stream writes the text and the newline separately,
    so two ranks failing at once could interleave into one unreadable line."""
    stream.write(line + "\n")
    stream.flush()


@dataclass(frozen=True)
class TrainerError:
    """What a failing rank prints on stderr before it exits: ``{"error": ..., "rank": r}``."""

    error: str
    rank: int | None = None

    def to_json(self) -> str:
        return json.dumps({"error": self.error[:MAX_ERROR_CHARS], "rank": self.rank})

    def describe(self) -> str:
        return f"rank {'?' if self.rank is None else self.rank}: {self.error}"


def parse_line(line: str) -> EpochRecord | TrainerError | None:
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
        if "epoch" in data:
            return EpochRecord.from_dict(data)
    except (TypeError, ValueError):
        return None
    return None
