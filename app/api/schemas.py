"""Request and response bodies of the REST API."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from enum import StrEnum
from typing import Any, Generic, Literal, TypeVar

from pydantic import (
    AliasPath,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from zoopick.selection.zoo import MAX_NUM_CLASSES
from zoopick.service.db.models import DatasetStatus, JobStatus
from zoopick.service.inputs import NoNulModel
from zoopick.service.jobs import JobCreate
from zoopick.service.tracking import STATUSES as MLFLOW_STATUSES
from zoopick.training.config import FinetuneOptions
from zoopick.training.race import SelectionOptions

__all__ = ["JobCreate", "NoNulModel"]  # bodies the service core defines, in the API's schema

T = TypeVar("T")


def one_of(enum: type[StrEnum]) -> Any:
    """A ``Literal`` of ``enum``'s values: a field whose schema lists what the enum holds."""
    return Literal[tuple(member.value for member in enum)]


def pattern_of(enum: type[StrEnum]) -> str:
    """A query parameter's ``pattern`` that admits exactly ``enum``'s values."""
    return f"^({'|'.join(re.escape(member.value) for member in enum)})$"


STORED_OPTIONS: dict[str, tuple[type[BaseModel], Callable[[Mapping[str, Any]], BaseModel]]] = {
    "finetune": (FinetuneOptions, FinetuneOptions.stored),
    "selection": (SelectionOptions, SelectionOptions.stored),
}
"""A job's option fields, each with how a row's stored value is read back unvalidated."""


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_page_token: str | None = Field(
        None, description="Pass as ?page_token= for the next page; null on the last page."
    )


class DatasetOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    name: str
    format: str
    filename: str
    size_bytes: int
    file_sha256: str
    status: one_of(DatasetStatus)  # type: ignore[valid-type]
    error: str | None
    classes: list[str] | None
    counts: dict[str, int] | None
    num_samples: int | None
    digest: str | None
    created_at: datetime
    updated_at: datetime


class ZooModelIn(NoNulModel):
    """A model to register. ``weights``: a checkpoint path on the workers' file system, a
    checkpoint in an S3-compatible store (``s3://bucket/key``, read with the server's
    ``AWS_*`` variables; checked once, then each worker fetches it), ``"hub"`` (timm's
    pretrained weights) or ``"none"`` (random init).

    Strict: the engine's manifest rules (``zoopick.selection.zoo``) refuse ``true`` or ``"8"``
    for a number, so the API must not coerce them first (``num_classes: true`` was stored as
    1, ``input_size: [3, true, true]`` as [3, 1, 1]); a 422 names the field. An integer where
    a float is expected (``crop_pct: 1``) stays accepted, as JSON does not tell them apart."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$",
        description="The model's id in jobs; default: timm's name of arch "
        '("hf-hub:timm/resnet50.a1_in1k" is "resnet50.a1_in1k").',
    )
    arch: str = Field(
        min_length=1,
        max_length=200,
        description="A timm model name, with a pretrained tag if wanted (resnet50.a1_in1k), "
        "or a Hugging Face hub name timm's registry knows (hf-hub:timm/resnet50.a1_in1k).",
    )
    weights: str = Field(min_length=1, max_length=4096)
    num_classes: int | None = Field(
        None,
        ge=1,
        le=MAX_NUM_CLASSES,
        description="Outputs of the source head; default for hub weights: their pretrained "
        "config's (1000 for ImageNet-1k), required otherwise.",
    )
    input_size: list[int] | None = Field(None, min_length=3, max_length=3)
    mean: list[float] | None = Field(None, min_length=3, max_length=3)
    std: list[float] | None = Field(None, min_length=3, max_length=3)
    interpolation: str | None = Field(None, max_length=32)
    crop_pct: float | None = Field(None, gt=0, le=1)
    crop_mode: str | None = Field(None, max_length=16)
    source: str | None = Field(None, max_length=200)
    tags: list[str] = Field(default_factory=list, max_length=32)


class ZooModelOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    arch: str
    weights: str = Field(
        description='"hub", "none", or the checkpoint path or s3:// URL (admins; others see '
        '"checkpoint").'
    )
    num_classes: int
    overrides: dict[str, Any]
    source: str | None
    tags: list[str]
    origin: str
    created_at: datetime
    data_config: dict[str, Any] | None = Field(
        None,
        description="timm's eval data config with the overrides applied (input_size, mean, "
        "std, interpolation, crop_pct, crop_mode): what scoring feeds the model. In a "
        "registration's answer and a single model's view; null in lists.",
    )


class RankedModel(BaseModel):
    rank: int
    model: str
    scores: dict[str, float]
    seconds: dict[str, float]
    cached: bool = Field(
        False, description="Its forward pass was skipped: the features came from the cache."
    )


class ScoringOut(BaseModel):
    """How far scoring is (``service.progress.scoring_view``)."""

    done: int = Field(description="Models settled: scored on every metric, or skipped.")
    total: int
    fraction: float
    never_scored: list[str] = Field(
        description="Once the job ended: models never scored (a cancelled job stops between "
        "models)."
    )


class CurvePointOut(BaseModel):
    x: float = Field(description="Epochs done, with the share of the current one.")
    loss: float | None
    train_accuracy: float | None


class RunProgressOut(BaseModel):
    """Where a training run is (``service.progress.run_view``)."""

    phase: str | None = Field(
        description="starting workers, loading data, training, evaluating, saving the model "
        "or finished."
    )
    epoch: int | None
    epochs: int | None
    step: int | None
    steps: int | None = Field(description="Optimizer steps per epoch.")
    fraction: float | None = Field(description="Share of the run's epochs done.")
    elapsed_seconds: float
    remaining_seconds: float | None = Field(description="Expected from the pace so far.")
    hosts: list[str]
    points: list[CurvePointOut] = Field(
        description="Rank 0's running loss and accuracy within epochs (sub-epoch curve)."
    )


class EpochOut(BaseModel):
    model_config = ConfigDict(from_attributes=True, populate_by_name=True)

    epoch: int
    loss: float | None
    train_accuracy: float | None
    test_accuracy: float | None
    bytes_sent: int | None
    compute_seconds: float | None
    select_seconds: float | None
    comm_seconds: float | None
    iterations: int | None = Field(
        None,
        validation_alias=AliasPath("extra", "iterations"),
        description="Training iterations in the epoch.",
    )
    dense_bytes: float | None = Field(
        None,
        validation_alias=AliasPath("extra", "dense_bytes"),
        description="What a dense float32 all-reduce of the same gradients would have sent per "
        "worker in the epoch: the baseline of bytes_sent.",
    )


class TrainingOut(BaseModel):
    run_id: uuid.UUID
    model: str
    status: str
    world_size: int
    backend: str = Field("local", description="Where it runs: local (torchrun) or ray.")
    backend_ref: str | None = Field(None, description="The backend's id of the run (Ray job).")
    resumes: int = Field(
        0, description="Times it continued from its checkpoint after a lost worker or node."
    )
    error: str | None
    started_at: datetime
    finished_at: datetime | None
    epochs: list[EpochOut]
    options: dict[str, Any] = Field(
        default_factory=dict, description="The run's fine-tune options (learning rate...)."
    )
    progress: RunProgressOut | None = None
    recipe: dict[str, Any] | None = Field(
        None,
        description="What the fine-tune recipe chose (training.recipe): plan (recipe, steps, "
        "warmup_steps, optimizer, weight_decay, label_smoothing, augment, head_lr_scale, "
        "lr_source, candidates, trial_steps, validation_fraction...), lr, trials (the learning "
        "rate search's curve: lr, val_accuracy, val_loss and loss_se, the standard error of its "
        "loss's difference from the lowest, paired per image), and once the run ended "
        "best_step, best_val_accuracy and stopped_early.",
    )


class RaceEntryOut(BaseModel):
    model: str
    status: str = Field(description="queued, running, done, failed or cancelled.")
    steps: int | None = Field(description="Optimizer steps its checkpoint holds after the rung.")
    reached_steps: int | None = Field(
        description="Steps its trainer has reached so far, live while the rung runs."
    )
    target_steps: int
    val_accuracy: float | None
    loss: float | None
    seconds: float | None
    attempts: int
    error: str | None


class RaceRungOut(BaseModel):
    index: int
    candidates: int
    steps_each: int = Field(description="Steps each candidate trains in this rung.")
    total_steps: int = Field(description="Steps each candidate holds once the rung is done.")
    entries: list[RaceEntryOut]


class RaceOut(BaseModel):
    """Stage 2 of a two-stage selection: the metric's shortlist racing short fine-tunes."""

    shortlist: list[str]
    train_images: int | None
    steps_per_epoch: int | None
    budget_steps: int | None = Field(description="The budget in optimizer steps (never exceeded).")
    spent_steps: int = Field(description="Steps the candidates hold in all (counted).")
    rung: int = Field(description="The rung running now (0-based).")
    rungs: list[RaceRungOut]
    winner: str | None
    why: str | None


class MlflowOut(BaseModel):
    """How logging the finished job to MLflow went (``ZOOPICK_MLFLOW_TRACKING_URI``)."""

    status: Literal[MLFLOW_STATUSES] = Field(  # type: ignore[valid-type]
        description="pending (waiting for a try, or for the next after a failed one), logging, "
        "logged, or failed (given up after the last try; the job itself is unaffected)."
    )
    attempts: int = 0
    error: str | None = Field(None, description="Why the last try failed (a warning).")
    run_id: str | None = None
    experiment_id: str | None = None
    url: str | None = Field(None, description="The run's page in the MLflow UI.")
    logged_at: datetime | None = None


class JobSummary(BaseModel):
    id: uuid.UUID
    status: one_of(JobStatus)  # type: ignore[valid-type]
    progress: float
    error: str | None
    dataset_id: uuid.UUID | None
    models: list[str]
    metrics: list[str]
    select_by: str
    finetune: FinetuneOptions | None
    selection: SelectionOptions | None = None
    chosen_model: str | None
    cancel_requested: bool
    recoveries: int = Field(
        0, description="Times the job was re-queued after its worker or messages were lost."
    )
    model_errors: dict[str, str] = Field(
        default_factory=dict,
        description="Models that could not be scored, with why (skipped; the others rank).",
    )
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    name: str | None = Field(None, description="The job's name, as submitted or patched.")
    tags: list[str] = Field(default_factory=list, description="The job's tags.")
    notes: str | None = Field(None, description="The job's notes.")

    @field_validator(*STORED_OPTIONS, mode="wrap")
    @classmethod
    def _as_stored(
        cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> Any:
        """The options as the job row stored them (validated once, when the job was
        submitted): a mapping is read back without validating it again, an instance taken as
        it is (pydantic would run its ``after`` validators on it). A poll runs no option
        validator, and a rule tightened since the job was submitted cannot make its view, or
        the list, fail; the fields' schema stays the models'."""
        model, read = STORED_OPTIONS[info.field_name]
        if isinstance(value, model):
            return value
        return read(value) if isinstance(value, Mapping) else handler(value)


class JobOut(JobSummary):
    ranking: list[RankedModel] = Field(
        description="Models scored so far, best first by select_by (equal scores share a rank)."
    )
    race: RaceOut | None = None
    training: TrainingOut | None
    scoring: ScoringOut | None = None
    mlflow: MlflowOut | None = Field(
        None, description="The job's MLflow run, when a tracking server is configured."
    )
    links: dict[str, str]


class Health(BaseModel):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)
