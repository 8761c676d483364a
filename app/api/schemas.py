"""Request and response bodies of the REST API."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import (
    AliasPath,
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    model_validator,
)

from zoopick.training.config import DEFAULT_WORKERS, SPARSE_WARMUP, default

DEFAULT_METRICS = ["fsms", "logme", "sms", "isms"]
DEFAULT_SELECT_BY = "fsms"
"""The metric that picks when a job names none: the best of the transfer benchmark
(`benchmarks/results/transfer.md`: highest mean weighted tau over its six targets)."""

T = TypeVar("T")


def default_select_by(metrics: list[str]) -> str:
    """The metric that picks when a job names none (see ``DEFAULT_SELECT_BY``)."""
    return DEFAULT_SELECT_BY if DEFAULT_SELECT_BY in metrics else metrics[0]


def _nul_path(value: Any, where: str) -> str | None:
    """The location of the first string holding a NUL character (PostgreSQL's text and jsonb
    cannot store one: without this check it surfaces as a 500 at insert)."""
    if isinstance(value, str):
        return where if "\x00" in value else None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _nul_path(k, where) or _nul_path(v, f"{where}.{k}")
            if found:
                return found
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = _nul_path(v, f"{where}[{i}]")
            if found:
                return found
    return None


class NoNulModel(BaseModel):
    """A request body whose strings, at any depth, may not contain NUL (422 naming the field)."""

    @model_validator(mode="after")
    def _no_nul(self) -> NoNulModel:
        for name in type(self).model_fields:
            found = _nul_path(getattr(self, name), name)
            if found:
                raise ValueError(f"{found} contains a NUL character")
        return self


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
    status: Literal["uploaded", "validating", "ready", "invalid"]
    error: str | None
    classes: list[str] | None
    counts: dict[str, int] | None
    num_samples: int | None
    digest: str | None
    created_at: datetime
    updated_at: datetime


class ZooModelIn(NoNulModel):
    """A model to register. ``weights``: a checkpoint path on the workers' file system,
    ``"hub"`` (timm's pretrained weights) or ``"none"`` (random init)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")
    arch: str = Field(min_length=1, max_length=200)
    weights: str = Field(min_length=1, max_length=4096)
    num_classes: int = Field(ge=1, le=1_000_000)
    input_size: list[int] | None = Field(None, min_length=3, max_length=3)
    mean: list[float] | None = Field(None, min_length=3, max_length=3)
    std: list[float] | None = Field(None, min_length=3, max_length=3)
    interpolation: str | None = Field(None, max_length=32)
    crop_pct: float | None = Field(None, gt=0, le=1)
    crop_mode: str | None = Field(None, max_length=16)
    source: str | None = Field(None, max_length=200)
    tags: list[str] = Field(default_factory=list, max_length=32)

    def overrides(self) -> dict[str, Any]:
        keys = ("input_size", "mean", "std", "interpolation", "crop_pct", "crop_mode")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class ZooModelOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    arch: str
    weights: str = Field(
        description='"hub", "none", or the checkpoint path (admins; others see "checkpoint").'
    )
    num_classes: int
    overrides: dict[str, Any]
    source: str | None
    tags: list[str]
    origin: str
    created_at: datetime


class FinetuneSpec(NoNulModel):
    """The fine-tune options a job may set. Defaults are the trainer's own
    (``zoopick.training.config``); the hook and its options are checked against
    ``zoopick.training.comm`` when the job is submitted (422 naming the bad one).

    Types are strict: ``"epochs": "2"`` or ``"epochs": 2.0`` is refused (422), not coerced;
    a float field takes a JSON integer (``"lr": 1``), nothing else."""

    model_config = ConfigDict(extra="forbid", strict=True)

    epochs: StrictInt = Field(default("epochs"), ge=1)
    workers: StrictInt = Field(DEFAULT_WORKERS, ge=1, description="Data-parallel worker processes.")
    compressor: str = Field(
        default("compressor"),
        min_length=1,
        max_length=64,
        description="Communication hook: dense, topk, gaussiank, spardl, exdyna, dfs.",
    )
    density: StrictFloat | StrictInt = Field(
        default("density"), gt=0, le=1, description="Fraction of gradient entries sent."
    )
    lr: StrictFloat | StrictInt = Field(default("lr"), gt=0, le=10)
    hook_options: dict[str, Any] = Field(
        default_factory=dict,
        max_length=16,
        description="Options of the hook (e.g. spardl's teams, warmup, fp16). Sparse hooks "
        f"get {SPARSE_WARMUP} iterations of exponential warm-up unless warmup is given (0: none).",
    )


class JobCreate(NoNulModel):
    """A job submission. Strict JSON types (no coercion of ``"2"`` to 2 or of a number to a
    string); ``dataset_id`` is a UUID string."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dataset_id: uuid.UUID = Field(strict=False)
    models: list[str] | Literal["all"] = Field(
        "all", description='Zoo model ids to score, or "all".'
    )
    metrics: list[str] = Field(
        default_factory=lambda: list(DEFAULT_METRICS), min_length=1, max_length=32
    )
    select_by: str | None = Field(
        None,
        description=f"The metric that picks the model to fine-tune. Default: {DEFAULT_SELECT_BY} "
        "when it is among the requested metrics, else the first requested metric.",
    )
    finetune: FinetuneSpec | None = None


class RankedModel(BaseModel):
    rank: int
    model: str
    scores: dict[str, float]
    seconds: dict[str, float]


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
    error: str | None
    started_at: datetime
    finished_at: datetime | None
    epochs: list[EpochOut]


class JobSummary(BaseModel):
    id: uuid.UUID
    status: Literal["queued", "scoring", "training", "succeeded", "failed", "cancelled"]
    progress: float
    error: str | None
    dataset_id: uuid.UUID | None
    models: list[str]
    metrics: list[str]
    select_by: str
    finetune: FinetuneSpec | None
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


class JobOut(JobSummary):
    ranking: list[RankedModel] = Field(
        description="Models scored so far, best first by select_by (equal scores share a rank)."
    )
    training: TrainingOut | None
    links: dict[str, str]


class Health(BaseModel):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)
