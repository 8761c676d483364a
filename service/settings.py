"""Service settings, read from ``ZOOPICK_*`` environment variables.

Every default is *embedded*: SQLite in a data folder and a broker that lives in files of that
folder, so ``zoopick serve`` runs with no external service. Pointing ``ZOOPICK_DATABASE_URL`` at
PostgreSQL and ``ZOOPICK_BROKER_URL`` at Redis runs the same code distributed. Relative paths
are resolved once, here, so the API and a worker started from another directory agree.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from zoopick.training.backends import Backend, Kind, Placement

EMBEDDED_BROKER = "filesystem://"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZOOPICK_", extra="ignore")

    data_dir: Path = Field(
        Path(".zoopick/data"), description="Folder for the embedded database, broker, storage."
    )
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default sqlite:///<data_dir>/zoopick.db."
    )
    broker_url: str | None = Field(
        None, description="Celery broker; default: files under <data_dir>/broker (no server)."
    )
    result_backend: str | None = Field(
        None, description="Celery result backend (chords need one); default follows the broker."
    )
    redis_key_prefix: str = Field(
        "",
        description="Prefix for every Redis key of broker and results (isolates tenants of "
        "one Redis, and test runs).",
    )
    storage_dir: Path | None = Field(None, description="Uploads and artefacts; <data_dir>/storage.")
    storage_url: str | None = Field(
        None,
        description="Where files that outlive a machine are kept (uploaded datasets with their "
        "decoded images and thumbnails, fine-tuned models and their exports so far): a local "
        "folder (a path or file:// URL; default <storage_dir>, today's folder) or "
        "s3://bucket/prefix on any S3-compatible store, its credentials, endpoint and "
        "region read from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION.",
    )
    cache_dir: Path | None = Field(None, description="Feature cache; default <data_dir>/cache.")
    object_cache_max_bytes: int = Field(
        20 * 1024**3,
        gt=0,
        description="Bytes of a machine's local copies of objects of a remote store (a dataset, "
        "its decoded images) kept in <data_dir>/objects for its workers to read as files; the "
        "copies used least recently are removed past it.",
    )
    zoo_manifest: Path | None = Field(
        None, description="Zoo manifest (JSON/YAML) synced into the database at start."
    )
    session_secret: SecretStr | None = Field(
        None,
        description="Key that signs dashboard session cookies; default: a random key kept in "
        "<data_dir>/session.key (set it when several hosts serve the dashboard).",
    )

    # uploads
    upload_max_bytes: int = Field(
        2 * 1024**3,
        gt=0,
        description="Largest upload body (a dataset file and its form fields), counted as it "
        "streams in (413 beyond).",
    )
    body_max_bytes: int = Field(
        1024**2,
        gt=0,
        description="Largest JSON or form body (jobs, zoo entries, dashboard forms); uploads "
        "stream under upload_max_bytes instead.",
    )
    validate_inline: bool = Field(
        False,
        description="Validate uploads in the request instead of on the cpu queue (tests, or a "
        "deployment without workers).",
    )

    # datasets: what validating one upload may cost a worker, checked before allocation
    # (zoopick.selection.limits.DatasetLimits; every rejection names the limit)
    dataset_max_member_bytes: int = Field(
        64 * 1024**2, gt=0, description="Uncompressed bytes of one archive member (image)."
    )
    dataset_max_total_bytes: int = Field(
        1024**3,
        gt=0,
        description="Uncompressed bytes of all images of an archive, or all arrays of an npz.",
    )
    dataset_max_compression_ratio: float = Field(
        100.0, gt=1, description="Uncompressed / compressed size of a zip member or a tar.gz."
    )
    dataset_max_members: int = Field(
        200_000, gt=0, description="Entries of an archive, or images of an npz."
    )
    dataset_max_pixels: int = Field(
        4096 * 4096, gt=0, description="Pixels of one image (from its header, before decoding)."
    )
    dataset_max_classes: int = Field(
        2000, ge=2, description="Classes of a dataset (metric memory grows with it)."
    )
    dataset_max_class_name_chars: int = Field(
        200, ge=1, description="Characters of one class name (listed with the dataset)."
    )
    dataset_min_per_class: int = Field(2, ge=1, description="Images every class must have.")
    dataset_max_cpu_seconds: float = Field(
        120.0,
        gt=0,
        description="CPU seconds validating one upload may spend (inflating, decoding): the "
        "backstop for files cheap in bytes and costly in work.",
    )

    # jobs
    max_models_per_job: int = Field(
        64, gt=0, description="Most zoo models one job may score (422 beyond)."
    )
    max_active_jobs_per_tenant: int = Field(
        16, gt=0, description="Most unfinished jobs of one tenant at once (429 beyond)."
    )
    max_epochs: int = Field(
        100,
        gt=0,
        description="Most epochs of each training stage of a job: finetune.epochs, and a "
        "race's selection.budget_epochs (summed over its candidates and rungs); a job that "
        "races and then fine-tunes may train up to twice this.",
    )
    max_train_workers: int = Field(
        8, gt=0, description="Most data-parallel workers of one fine-tune (finetune.workers)."
    )
    max_batch_size: int = Field(
        1024,
        gt=0,
        description="Largest finetune.batch_size (images per worker and step; evaluation "
        "takes twice as many): a worker's memory grows with it.",
    )
    score_max_per_class: int | None = Field(
        None, gt=0, description="Score on a deterministic per-class subsample of this size."
    )
    score_batch_size: int = Field(
        64, gt=0, description="Images per forward pass when scoring a model."
    )
    max_logits_bytes: int = Field(
        1 << 30,
        gt=0,
        description="Most bytes of float32 source logits (images x the head's outputs x 4) "
        "scoring one model may produce: a model over it is skipped with its error before its "
        "forward pass, not the worker's memory (zoopick.selection.extract's max_logits_bytes).",
    )
    preprocess_cache_bytes: int = Field(
        4 << 30,
        ge=0,
        description="Budget of a scoring process's in-memory cache of decoded, resized "
        "images (one byte a pixel), shared by the models of one data config "
        "(zoopick.selection.extract.preprocess's cache_bytes); 0 keeps nothing.",
    )
    preload_scoring: bool = Field(
        False,
        description="Import the scoring libraries (torch, timm, the metrics) in each worker "
        "pool process when it starts, not in its first scoring task: that task then starts at "
        "once, and its time limit measures the scoring alone.",
    )
    retry_after_seconds: int = Field(
        2,
        ge=1,
        description="The Retry-After the API sends with a 202 or 503 that asks to come back "
        "(an export being made, a busy database).",
    )
    shutdown_grace_seconds: float = Field(
        30.0,
        gt=0,
        description="How long the API, once told to stop (SIGTERM, Ctrl-C), lets in-flight "
        "requests finish: it stops accepting at once, and at this deadline cancels what is "
        "left (a client still trickling an upload is cut, its partial file removed) and "
        "exits. A process manager's own stop timeout should be longer.",
    )
    page_size_default: int = Field(20, gt=0, description="Items of a list page by default.")
    page_size_max: int = Field(100, gt=0, description="Most items a list page may ask for.")

    # where fine-tunes run (zoopick.training.backends: Backend holds the defaults and the checks)
    train_backend: Kind = Field(
        Backend.kind,
        description="local: torchrun on the gpu worker's own machine; ray: Ray Train on the "
        "cluster at ZOOPICK_RAY_ADDRESS (a pool of GPU machines).",
    )
    ray_address: str | None = Field(
        None, description="The Ray cluster's head, HOST:PORT (with ZOOPICK_TRAIN_BACKEND=ray)."
    )
    ray_placement: Placement = Field(
        Backend.placement, description="How Ray places a run's workers on the cluster's machines."
    )
    ray_max_failures: int = Field(
        Backend.max_failures,
        ge=0,
        description="Worker or node losses a ray run survives (resuming each time).",
    )
    ray_start_timeout_seconds: int = Field(
        Backend.start_timeout,
        ge=1,
        description="How long one start of a ray run's workers waits for machines (a start "
        "that times out counts as a failure; an elastic run then starts with fewer).",
    )
    comm_triton: bool = Field(
        False,
        description="Fine-tunes on CUDA select with the fused Triton kernels "
        "(training.comm.triton_kernels) instead of torch.topk; off until they are measured "
        "faster (benchmarks/comm/README.md). The worker writes it into each run's config "
        "(FinetuneConfig.comm_triton), so a run on another machine (Ray) gets it too.",
    )

    # workers: time limits (seconds) and the job lease
    score_soft_time_limit: int = Field(
        1800,
        gt=0,
        description="Seconds one model's scoring may take: past it the model is skipped "
        "with the reason in the job's model_errors, and the job goes on.",
    )
    score_hard_time_limit: int = Field(
        1900,
        gt=0,
        description="Seconds after which a scoring task that did not stop at the soft limit "
        "is killed (its model skipped likewise); above the soft limit.",
    )
    train_soft_time_limit: int = Field(
        6 * 3600, gt=0, description="Seconds a fine-tune (or a race rung) may run: then failed."
    )
    train_hard_time_limit: int = Field(
        6 * 3600 + 300,
        gt=0,
        description="Seconds after which a training task that did not stop is killed.",
    )
    light_soft_time_limit: int = Field(
        600,
        gt=0,
        description="Seconds a light task (dataset validation, bookkeeping, webhooks, "
        "exports) may run.",
    )
    light_hard_time_limit: int = Field(
        660, gt=0, description="Seconds after which a light task is killed."
    )
    task_db_retry_seconds: float = Field(
        120,
        ge=0,
        description="How long a task waits, retrying with backoff, for a database that stopped "
        "answering before it gives up (the task then fails as before): a short database "
        "outage or restart costs a task a pause, not its work or its job.",
    )
    lease_seconds: int = Field(
        120,
        gt=0,
        description="A training job's lease: renewed while its worker lives; once it runs "
        "out, another worker (or the sweeper) may take the job over.",
    )

    # recovery of lost jobs (zoopick.service.recovery): the API sweeps every interval, a worker at
    # start
    sweep_interval_seconds: int = Field(
        60, ge=0, description="How often the API process sweeps for lost jobs; 0: never."
    )
    stall_seconds: int | None = Field(
        None,
        gt=0,
        description="An unfinished job with no progress for this long is lost; default: the "
        "longest hard time limit (no task can legitimately run longer). Below that, a job "
        "whose scoring task is merely slow counts as lost too.",
    )
    recovery_attempts: int = Field(
        2, ge=0, description="Times a lost job is re-queued before it is failed."
    )
    recovery_grace_seconds: int = Field(
        60,
        gt=0,
        description="A scoring task's lease on its job and on the model it scores (renewed "
        "every quarter of it while the task runs: a model whose lease lapsed lost its task and "
        "is sent again at the next sweep, however long the job's other models take), and how "
        "long a job being scored or selected, or a dataset being validated, may show no live "
        "lease and no progress, while a worker on its queue is up and runs "
        "nothing else, before the sweeper counts its tasks lost (a dead worker's, or lost by "
        "the broker) and sends them again; a job, while other work keeps the workers busy, "
        "once the broker no longer holds its task messages either. Recovery then takes at "
        "most this plus "
        "sweep_interval_seconds plus the re-sent work: 60 + 60 + under 60 s fits the stated "
        "3 minutes.",
    )

    # rate limits (``limits`` notation: "60/minute", "1000/hour") and storage quotas
    rate_uploads: str = Field("60/minute", description="Dataset uploads per API key.")
    rate_jobs: str = Field("120/minute", description="Job submissions per API key.")
    rate_auth_failures: str = Field(
        "60/minute", description="Failed authentications per client address."
    )
    quota_bytes: int = Field(
        20 * 1024**3, gt=0, description="Bytes of datasets a tenant may keep stored."
    )
    quota_datasets: int = Field(200, gt=0, description="Datasets a tenant may keep stored.")

    # integrations: Prometheus scrapes (zoopick.app.metrics) and webhooks
    # (zoopick.service.webhooks, zoopick.service.netguard)
    metrics_public: bool = Field(
        False,
        description="Let anyone who reaches the API scrape /metrics; default: an admin API key "
        "only (queue depths and worker names describe the deployment).",
    )
    webhook_allow_networks: list[str] = Field(
        default_factory=list,
        description="Networks (CIDR, e.g. 10.0.0.0/8, 127.0.0.1/32) webhooks may be sent to "
        "although they are loopback, private, link-local, multicast, reserved or in another "
        "of IANA's special-purpose blocks; default: none (JSON list in the environment).",
    )
    webhook_max_attempts: int = Field(
        6, ge=1, description="Tries of one webhook delivery before it is given up."
    )
    webhook_backoff_seconds: float = Field(
        2.0, gt=0, description="Wait before the second try; doubled before each next one."
    )
    webhook_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="Time one webhook try may take, from connecting to the receiver's status "
        "line (its body is not read).",
    )

    # MLflow (zoopick[mlflow]): each finished job logged as one run (zoopick.service.tracking)
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking server (http://host:5000, databricks, ...) that every job "
        "is logged to once it finishes: scores, fine-tune curve, model. Needs zoopick[mlflow].",
    )
    mlflow_experiment: str = Field(
        "zoopick", min_length=1, max_length=500, description="MLflow experiment of the runs."
    )
    mlflow_timeout_seconds: float = Field(
        10.0, gt=0, description="Timeout of one request to the tracking server."
    )
    mlflow_max_attempts: int = Field(
        3, ge=1, description="Tries of logging one job before it is given up (on the job)."
    )
    mlflow_backoff_seconds: float = Field(
        30.0, gt=0, description="Wait before the second try; doubled before each next one."
    )

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _mlflow_installed(cls, value: str | None) -> str | None:
        if value is None:
            return None
        import importlib.util

        if importlib.util.find_spec("mlflow") is None:
            raise ValueError(
                "ZOOPICK_MLFLOW_TRACKING_URI is set but MLflow is not installed: "
                "pip install 'zoopick[mlflow]' (or unset it)"
            )
        return value

    @field_validator("webhook_allow_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        import ipaddress

        for net in value:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"not a network: {net!r} (e.g. '10.0.0.0/8')") from None
        return value

    @field_validator("rate_uploads", "rate_jobs", "rate_auth_failures")
    @classmethod
    def _rate(cls, value: str) -> str:
        from limits import parse

        try:
            parse(value)
        except ValueError:
            raise ValueError(f"not a rate limit: {value!r} (e.g. '60/minute')") from None
        return value

    # the API process' database connections: at most this many requests hold a session at
    # once, the others wait for one without holding a thread (zoopick.app.api.deps)
    db_pool_size: int = Field(10, ge=1, description="Database connections kept per API process.")
    db_max_overflow: int = Field(
        10, ge=0, description="Connections an API process may open beyond the pool under load."
    )
    db_pool_timeout_seconds: float = Field(
        30.0, gt=0, description="Longest wait for a free database connection."
    )

    # a task that kills its worker, and workers that stop running tasks
    max_deliveries: int = Field(
        3,
        ge=1,
        description="Starts of one dataset's validation (or one model's scoring) whose worker "
        "died before the work is failed instead of run again.",
    )
    heartbeat_seconds: float = Field(5.0, gt=0, description="Worker pool heartbeat interval.")
    heartbeat_timeout_seconds: float = Field(
        30.0, gt=0, description="A worker not seen for this long is stopped or stalled."
    )

    @field_validator(
        "database_url",
        "broker_url",
        "result_backend",
        "storage_dir",
        "storage_url",
        "cache_dir",
        "zoo_manifest",
        "score_max_per_class",
        "stall_seconds",
        "ray_address",
        "mlflow_tracking_uri",
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """``ZOOPICK_ZOO_MANIFEST=`` (as compose writes an unset variable) means unset."""
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        if self.database_url is None:
            self.database_url = f"sqlite:///{self.data_dir / 'zoopick.db'}"
        if self.broker_url is None:
            self.broker_url = EMBEDDED_BROKER
        if self.result_backend is None:
            if self.broker_url.startswith(("redis://", "rediss://")):
                self.result_backend = self.broker_url
            else:
                self.result_backend = f"file://{self.data_dir / 'results'}"
        self.storage_dir = (self.storage_dir or self.data_dir / "storage").expanduser().resolve()
        self.cache_dir = (self.cache_dir or self.data_dir / "cache").expanduser().resolve()
        self.storage_url = _storage_url(self.storage_url, self.storage_dir)
        if self.zoo_manifest is not None:
            self.zoo_manifest = self.zoo_manifest.expanduser().resolve()
        for soft, hard in (
            ("score_soft_time_limit", "score_hard_time_limit"),
            ("train_soft_time_limit", "train_hard_time_limit"),
            ("light_soft_time_limit", "light_hard_time_limit"),
        ):
            if getattr(self, soft) >= getattr(self, hard):
                raise ValueError(f"{soft} must be below {hard}")
        self.training_backend()  # ValueError: e.g. the ray backend without an address
        return self

    def dataset_limits(self) -> Any:
        """These settings as ``zoopick.selection.limits.DatasetLimits`` (imported here, not at
        module import: the selection package pulls in torch)."""
        from zoopick.selection.limits import DatasetLimits

        return DatasetLimits(
            max_member_bytes=self.dataset_max_member_bytes,
            max_total_bytes=self.dataset_max_total_bytes,
            max_compression_ratio=self.dataset_max_compression_ratio,
            max_members=self.dataset_max_members,
            max_pixels=self.dataset_max_pixels,
            max_classes=self.dataset_max_classes,
            max_class_name_chars=self.dataset_max_class_name_chars,
            min_per_class=self.dataset_min_per_class,
            max_cpu_seconds=self.dataset_max_cpu_seconds,
        )

    @property
    def embedded_broker(self) -> bool:
        return self.broker_url == EMBEDDED_BROKER

    @property
    def broker_dir(self) -> Path:
        """Where the embedded (file-system) broker keeps its messages."""
        return self.data_dir / "broker"

    @property
    def visibility_timeout(self) -> int:
        """Redis re-delivers an unacknowledged task after this long; it must exceed every hard
        time limit, or a long GPU task would run twice at once."""
        return max(self.score_hard_time_limit, self.train_hard_time_limit) + 600

    @property
    def stall_timeout(self) -> int:
        """Seconds without progress after which an unfinished job counts as lost."""
        return self.stall_seconds or max(
            self.score_hard_time_limit, self.train_hard_time_limit, self.light_hard_time_limit
        )

    def training_backend(self, run_key: str | None = None) -> Backend:
        """Where this deployment's fine-tunes run. ``run_key``: the run's folder in the store
        (the job's, or a race candidate's), where a ``ray`` run keeps its checkpoints (Ray
        Train's storage), so a re-delivered run, or a candidate's next rung, continues from
        them wherever it starts again; with an S3 store the Ray nodes share no folder with
        the gpu worker for them."""
        place = None
        if self.train_backend == "ray" and run_key:
            from zoopick.service.storage import open_store

            local = open_store(self.storage_url).local_path(run_key)
            place = str(local) if local is not None else f"{self.storage_url.rstrip('/')}/{run_key}"
        return Backend(
            kind=self.train_backend,
            ray_address=self.ray_address,
            placement=self.ray_placement,
            max_failures=self.ray_max_failures,
            start_timeout=self.ray_start_timeout_seconds,
            storage=place,
        )

    def env(self) -> dict[str, str]:
        """This process' environment plus the ``ZOOPICK_*`` variables that make a child process
        (a local worker, a test's server) read exactly these settings with
        :func:`get_settings`: the one way settings reach both faces.

        Every field is written, defaults included, as the value it has after validation
        (resolved paths, the filled-in database and broker URLs), so a child never falls back
        to a default of its own or to a stale variable; a field that is unset (None) removes
        its variable."""
        import json
        import os

        env = dict(os.environ)
        for name in type(self).model_fields:
            key = f"ZOOPICK_{name.upper()}"
            value = getattr(self, name)
            if value is None:
                env.pop(key, None)
            elif isinstance(value, SecretStr):
                env[key] = value.get_secret_value()
            elif isinstance(value, bool):
                env[key] = "true" if value else "false"
            elif isinstance(value, list | dict):
                env[key] = json.dumps(value)
            else:
                env[key] = str(value)
        return env

    def ensure_dirs(self) -> None:
        for path in (self.data_dir, self.storage_dir, self.cache_dir):
            path.mkdir(parents=True, exist_ok=True)
        if self.embedded_broker:
            for sub in ("queue", "control", "processed"):
                (self.broker_dir / sub).mkdir(parents=True, exist_ok=True)
        if self.result_backend.startswith("file://"):
            Path(self.result_backend.removeprefix("file://")).mkdir(parents=True, exist_ok=True)


def _storage_url(value: str | None, storage_dir: Path) -> str:
    """``ZOOPICK_STORAGE_URL`` as one canonical URL: ``file:///abs/path`` (a plain path, relative
    ones resolved here like the other folders; unset: ``storage_dir``, where today's files are)
    or ``s3://bucket[/prefix]``. Anything else is refused here, naming the setting, rather than
    when the first model is saved."""
    if value is None:
        return storage_dir.as_uri()
    if value.startswith("s3://"):
        bucket = value.removeprefix("s3://").split("/", 1)[0]
        if not bucket:
            raise ValueError(f"ZOOPICK_STORAGE_URL {value!r} names no bucket (s3://bucket/prefix)")
        return value.rstrip("/")
    if value.startswith("file://"):
        value = value.removeprefix("file://")
    elif "://" in value:
        raise ValueError(
            f"ZOOPICK_STORAGE_URL {value!r}: a local folder or s3://bucket/prefix is expected"
        )
    return Path(value).expanduser().resolve().as_uri()


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings from the environment: what a worker, the CLI and
    ``create_app()`` without arguments use (tests and ``zoopick serve`` may pass their own
    object to ``create_app``, and hand it to child processes with :meth:`Settings.env`)."""
    return Settings()
