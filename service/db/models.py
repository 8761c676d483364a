"""The service's data model (SQLAlchemy 2 typed ORM).

PostgreSQL is the source of truth for everything a job does: tasks claim the job row with a
lease, scores and per-epoch metrics carry unique keys so a re-delivered task upserts instead of
duplicating, and progress is written as it happens. The Alembic migrations in ``migrations/``
must create exactly these tables (a test compares them).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    Uuid,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from zoopick.service.db.types import UTCDateTime, utcnow

# Deterministic constraint names, so migrations can name (and drop) what they create.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON, list[Any]: JSON}


class DatasetStatus(StrEnum):
    uploaded = "uploaded"
    validating = "validating"
    ready = "ready"
    invalid = "invalid"


class JobStatus(StrEnum):
    queued = "queued"
    scoring = "scoring"
    racing = "racing"
    training = "training"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})


def _in(values: type[StrEnum]) -> str:
    return ", ".join(f"'{v.value}'" for v in values)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    webhook_url: Mapped[str | None] = mapped_column(Text)
    """The tenant's default webhook (``zoopick.service.webhooks``): jobs naming none use it."""
    webhook_phases: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """Whether the default webhook hears phase changes too, not only terminal states."""
    webhook_secret: Mapped[str | None] = mapped_column(String(64))
    """Key of the HMAC signature of the tenant's webhooks (made when first needed)."""

    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")


class ApiKey(Base):
    """Only the SHA-256 of a token is stored; ``prefix`` (its first characters) identifies a
    key in listings without revealing it."""

    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    name: Mapped[str] = mapped_column(String(100))
    prefix: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    sessions_ended_at: Mapped[datetime | None]
    """When the key last signed out of the dashboard: part of every session cookie's MAC, so
    the cookies made before it (in any browser) stop working (``app.dashboard.auth``)."""

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")


class Dataset(Base):
    __tablename__ = "datasets"
    __table_args__ = (
        CheckConstraint(f"status IN ({_in(DatasetStatus)})", name="status"),
        Index("ix_datasets_tenant_created", "tenant_id", "created_at", "id"),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    format: Mapped[str] = mapped_column(String(16))
    filename: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    file_sha256: Mapped[str] = mapped_column(String(64))
    storage_path: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default=DatasetStatus.uploaded.value)
    error: Mapped[str | None] = mapped_column(Text)
    classes: Mapped[list[Any] | None]
    counts: Mapped[dict[str, Any] | None]
    num_samples: Mapped[int | None]
    digest: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ZooModel(Base):
    """A candidate model. ``weights`` is a checkpoint path on the workers' file system, an
    ``s3://bucket/key`` object (its ``weights_size`` and ``weights_sha256`` as registered:
    ``service.zoo_weights``), ``"hub"`` or ``"none"``; ``overrides`` holds data-config keys
    (input_size, mean, ...)."""

    __tablename__ = "zoo_models"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    arch: Mapped[str] = mapped_column(String(200))
    weights: Mapped[str] = mapped_column(Text)
    weights_sha256: Mapped[str | None] = mapped_column(String(64))
    weights_size: Mapped[int | None] = mapped_column(BigInteger)
    num_classes: Mapped[int]
    overrides: Mapped[dict[str, Any]] = mapped_column(default=dict)
    source: Mapped[str | None] = mapped_column(String(200))
    tags: Mapped[list[Any]] = mapped_column(default=list)
    origin: Mapped[str] = mapped_column(String(16), default="api")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(f"status IN ({_in(JobStatus)})", name="status"),
        CheckConstraint("progress >= 0 AND progress <= 1", name="progress"),
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_jobs_status", "status"),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    dataset_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("datasets.id", ondelete="SET NULL"), index=True
    )
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.queued.value)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    error: Mapped[str | None] = mapped_column(Text)
    request: Mapped[dict[str, Any]]
    models: Mapped[list[Any]]
    metrics: Mapped[list[Any]]
    select_by: Mapped[str] = mapped_column(String(64))
    finetune: Mapped[dict[str, Any] | None]
    chosen_model: Mapped[str | None] = mapped_column(String(200))
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    task_ids: Mapped[list[Any]] = mapped_column(default=list)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None]
    model_errors: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict, server_default="{}")
    """Zoo models that could not be scored, with why: a broken entry is skipped, not fatal."""
    selection: Mapped[dict[str, Any] | None]
    """Two-stage selection as submitted (``training.race.SelectionOptions``); None: the metric
    alone picks."""
    race: Mapped[dict[str, Any] | None]
    """The race's plan and outcome (``service.race``): shortlist, rungs, budget, winner, why."""
    webhook: Mapped[dict[str, Any] | None]
    """The job's own webhook as submitted (``{"url": ..., "phases": bool}``); None: the
    tenant's default, if any."""
    recoveries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Times the sweeper (``zoopick.service.recovery``) re-queued this job after it was lost."""
    name: Mapped[str | None] = mapped_column(String(200))
    """The job's name as its owner gave it (``service.job_records``); None: unnamed."""
    tags: Mapped[list[Any]] = mapped_column(JSON, default=list, server_default="[]")
    """Its owner's tags (strings), searched by the job list."""
    notes: Mapped[str | None] = mapped_column(Text)
    """Its owner's notes, free text."""
    mlflow: Mapped[dict[str, Any] | None]
    """Logging the finished job to MLflow (``zoopick.service.tracking``): status (pending,
    logging, logged, failed), attempts, the last error, the run's id and page; None when no
    tracking server is configured."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    scores: Mapped[list[Score]] = relationship(
        back_populates="job", cascade="all, delete-orphan", passive_deletes=True
    )
    training_runs: Mapped[list[TrainingRun]] = relationship(
        back_populates="job", cascade="all, delete-orphan", passive_deletes=True
    )
    artefacts: Mapped[list[Artefact]] = relationship(
        back_populates="job", cascade="all, delete-orphan", passive_deletes=True
    )
    race_entries: Mapped[list[RaceEntry]] = relationship(
        back_populates="job", cascade="all, delete-orphan", passive_deletes=True
    )


class RaceEntry(Base):
    """One shortlisted model in one rung of a job's race: trained to ``steps`` optimizer steps
    in all (resuming its own run folder), then validated. Unique per (job, model, rung), so a
    re-delivered rung task finds its row; the lease says which task trains it now."""

    __tablename__ = "race_entries"
    __table_args__ = (UniqueConstraint("job_id", "model_id", "rung"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    model_id: Mapped[str] = mapped_column(String(200))
    rung: Mapped[int]
    status: Mapped[str] = mapped_column(String(16), default="queued")
    """queued, running, done, failed or cancelled."""
    target_steps: Mapped[int]
    """Optimizer steps the model has in all once this rung is done (its budget so far)."""
    steps: Mapped[int | None]
    """Steps its checkpoint really holds after the rung (counted by the trainer)."""
    reached_steps: Mapped[int | None]
    """Steps its trainer has reached so far, live from the trainer's progress lines while the
    rung runs (a killed worker's successor resumes from the last checkpoint, so this may
    step back)."""
    val_accuracy: Mapped[float | None] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    seconds: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    job: Mapped[Job] = relationship(back_populates="race_entries")


class ScoreLease(Base):
    """Which task scores one model of a job now, and until when it is alive: the lease its
    scoring task claims when it starts that model, renews while the forward pass runs and
    drops when the model is settled (scored or failed). One row per model being scored, as a
    race's candidates each hold their own lease (``race_entries``), beside the job's shared
    ``score:<job>`` lease: that one says some scoring task of the job is alive, this one which
    model's task died. A model whose row is past its expiry lost its task (a dead worker), and
    the sweeper re-sends it within about two lease periods, however long the job's other
    models take."""

    __tablename__ = "score_leases"

    job_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    model_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    lease_owner: Mapped[str] = mapped_column(String(200))
    """The scoring task's id: a message delivered again after its worker died takes its own
    lease back; a re-sent canvas's task (a fresh id) waits while the lease is live."""
    lease_expires_at: Mapped[datetime]


class Score(Base):
    """One metric's value for one model in one job; unique per (job, model, metric) so a
    re-delivered scoring task overwrites rather than duplicates."""

    __tablename__ = "scores"
    __table_args__ = (UniqueConstraint("job_id", "model_id", "metric"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    model_id: Mapped[str] = mapped_column(String(200))
    metric: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Float)
    seconds: Mapped[float] = mapped_column(Float)
    forward_seconds: Mapped[float | None] = mapped_column(Float)
    cached: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """The forward pass was skipped: its features came from the on-disk cache."""
    parts: Mapped[list[Any] | None]
    """A zoo-normalised metric's components for this model (NCTI's); ``value`` is its
    single-model stand-in until selection combines the zoo's parts
    (``pipeline.combine_zoo_scores``)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    job: Mapped[Job] = relationship(back_populates="scores")


class TrainingRun(Base):
    __tablename__ = "training_runs"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    model_id: Mapped[str] = mapped_column(String(200))
    config: Mapped[dict[str, Any]]
    world_size: Mapped[int]
    status: Mapped[str] = mapped_column(String(16), default="running")
    error: Mapped[str | None] = mapped_column(Text)
    output_dir: Mapped[str] = mapped_column(Text)
    backend: Mapped[str] = mapped_column(String(16), default="local", server_default="local")
    backend_ref: Mapped[str | None] = mapped_column(String(200))
    """The backend's own id of the run (the Ray job id), once it started."""
    resumes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Times the run continued from its checkpoint (a lost worker or node, a re-delivery)."""
    progress: Mapped[dict[str, Any] | None]
    """Where the run is now (``service.progress``): phase, epoch/step of how many, hosts, and
    the sub-epoch curve points the trainer reported."""
    recipe: Mapped[dict[str, Any] | None]
    """What the fine-tune recipe chose (``training.recipe.Choices``): the plan, the learning
    rate and how it was found, the search's curve; the best validation step once it ended."""
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]

    job: Mapped[Job] = relationship(back_populates="training_runs")
    epochs: Mapped[list[EpochMetric]] = relationship(
        back_populates="run",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="EpochMetric.epoch",
    )


class EpochMetric(Base):
    __tablename__ = "epoch_metrics"
    __table_args__ = (UniqueConstraint("run_id", "epoch"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("training_runs.id", ondelete="CASCADE"))
    epoch: Mapped[int]
    loss: Mapped[float | None] = mapped_column(Float)
    train_accuracy: Mapped[float | None] = mapped_column(Float)
    test_accuracy: Mapped[float | None] = mapped_column(Float)
    bytes_sent: Mapped[int | None] = mapped_column(BigInteger)
    compute_seconds: Mapped[float | None] = mapped_column(Float)
    select_seconds: Mapped[float | None] = mapped_column(Float)
    comm_seconds: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    run: Mapped[TrainingRun] = relationship(back_populates="epochs")


class Artefact(Base):
    __tablename__ = "artefacts"
    __table_args__ = (UniqueConstraint("job_id", "kind"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    path: Mapped[str] = mapped_column(Text)
    digest: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    job: Mapped[Job] = relationship(back_populates="artefacts")


class TaskDelivery(Base):
    """How many times a task for one piece of work was *started* (``validate:<dataset>``,
    ``score:<job>:<model>``). Celery re-delivers a task whose worker died (``acks_late`` +
    ``reject_on_worker_lost``); a task that kills its worker every time (a memory bomb under
    the kernel's OOM killer) would be re-delivered forever. The task counts its start here, and
    past ``ZOOPICK_MAX_DELIVERIES`` fails the work instead of running it again."""

    __tablename__ = "task_deliveries"

    key: Mapped[str] = mapped_column(String(300), primary_key=True)
    count: Mapped[int] = mapped_column(Integer, default=0)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class WorkerHeartbeat(Base):
    """A worker process that can run tasks, as last seen: written every few seconds by each
    pool process (not only the worker's main process, which keeps reserving tasks even when its
    pool is dead). ``/readyz`` and the dashboard read it."""

    __tablename__ = "worker_heartbeats"

    name: Mapped[str] = mapped_column(String(300), primary_key=True)
    """``<celery hostname>/<pid>``."""
    hostname: Mapped[str] = mapped_column(String(200), index=True)
    pid: Mapped[int]
    queues: Mapped[str] = mapped_column(String(200))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    seen_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    """One webhook call for one event of a job (``job.succeeded``, ``job.training``, ...): its
    payload as it was at the event, and how delivering it went (``pending``, ``delivered`` or
    ``failed`` after ``ZOOPICK_WEBHOOK_MAX_ATTEMPTS``). Written in the transaction that moved
    the job (an outbox: no event is lost to a crash between the move and the send)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        CheckConstraint("status IN ('pending', 'delivered', 'failed')", name="status"),
        Index("ix_webhook_deliveries_job_created", "job_id", "created_at"),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(32))
    url: Mapped[str] = mapped_column(Text)
    payload: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    response_status: Mapped[int | None]
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    delivered_at: Mapped[datetime | None]
