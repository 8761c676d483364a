"""Settings defaults (embedded), the environment prefix, and the Celery configuration that
makes at-least-once delivery safe for long GPU tasks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from zoopick.service.queue import (
    CPU,
    DELIVER_WEBHOOK,
    FINETUNE,
    GPU,
    SCORE,
    SELECT,
    VALIDATE,
    WEBHOOKS,
    make_celery,
    worker_argv,
)
from zoopick.service.settings import EMBEDDED_BROKER, Settings


def test_defaults_are_embedded_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in [v for v in __import__("os").environ if v.startswith("ZOOPICK_")]:
        monkeypatch.delenv(var)
    s = Settings()
    data = tmp_path / ".zoopick" / "data"
    assert s.data_dir == data
    assert s.database_url == f"sqlite:///{data / 'zoopick.db'}"
    assert s.broker_url == EMBEDDED_BROKER and s.embedded_broker
    assert s.result_backend == f"file://{data / 'results'}"
    assert s.storage_dir == data / "storage" and s.cache_dir == data / "cache"


def test_environment_prefix(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOOPICK_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("ZOOPICK_DATABASE_URL", "postgresql+psycopg://u@db/zoopick")
    monkeypatch.setenv("ZOOPICK_BROKER_URL", "redis://redis:6379/0")
    monkeypatch.setenv("ZOOPICK_UPLOAD_MAX_BYTES", "1234")
    s = Settings()
    assert s.database_url == "postgresql+psycopg://u@db/zoopick"
    assert s.result_backend == "redis://redis:6379/0"  # follows a Redis broker
    assert s.upload_max_bytes == 1234 and not s.embedded_broker


def test_env_hands_every_setting_to_a_child(tmp_path, monkeypatch):
    """A child process started with ``env()`` reads the parent's settings field for field:
    values that differ from every default, a secret, a list, a bool; and a field the parent
    left unset is not taken from a stale variable of its environment."""
    monkeypatch.setenv("ZOOPICK_RAY_ADDRESS", "stale:1")  # parent: explicitly unset below
    parent = Settings(
        data_dir=tmp_path,
        ray_address=None,
        validate_inline=True,
        lease_seconds=7,
        max_epochs=1000,
        dataset_max_classes=3,
        rate_jobs="5/second",
        webhook_allow_networks=["127.0.0.1/32", "10.0.0.0/8"],
        session_secret="s3cret",
        heartbeat_seconds=0.25,
        ray_placement="SPREAD",
    )
    env = parent.env()
    assert "ZOOPICK_RAY_ADDRESS" not in env
    for var in [v for v in __import__("os").environ if v.startswith("ZOOPICK_")]:
        monkeypatch.delenv(var)
    for key, value in env.items():
        if key.startswith("ZOOPICK_"):
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path / "..")  # paths must not depend on the child's directory
    child = Settings()
    assert child.model_dump() == parent.model_dump()
    assert child.session_secret.get_secret_value() == "s3cret"
    assert child.validate_inline is True and child.lease_seconds == 7 and child.max_epochs == 1000


def test_soft_limits_must_be_below_hard_limits(tmp_path):
    with pytest.raises(ValidationError, match="score_soft_time_limit"):
        Settings(data_dir=tmp_path, score_soft_time_limit=100, score_hard_time_limit=100)


def test_the_training_backend_defaults_and_checks_have_one_home(tmp_path):
    """``training.backends.Backend`` holds the backend's defaults and its checks: the
    settings, ``zoopick train``'s flags and the Ray driver's flags take them from there."""
    import typer

    from zoopick.cli import app
    from zoopick.training import ray_driver
    from zoopick.training.backends import NO_ADDRESS, Backend

    assert Settings(data_dir=tmp_path).training_backend() == Backend()
    train = {p.name: p.default for p in typer.main.get_command(app).commands["train"].params}
    assert (train["backend"], train["placement"]) == (Backend.kind, Backend.placement)
    assert train["ray_start_timeout"] == Backend.start_timeout
    driver = ray_driver.arguments().parse_args(["--config", "c", "--address", "a"])
    assert (driver.placement, driver.max_failures, driver.start_timeout) == (
        Backend.placement,
        Backend.max_failures,
        Backend.start_timeout,
    )
    with pytest.raises(ValidationError) as refused:
        Settings(data_dir=tmp_path, train_backend="ray")
    assert NO_ADDRESS in str(refused.value)


def test_celery_delivery_settings(tmp_path):
    s = Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:6379/0", redis_key_prefix="p:")
    conf = make_celery(s).conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    opts = conf.broker_transport_options
    assert opts["visibility_timeout"] > max(s.score_hard_time_limit, s.train_hard_time_limit)
    assert opts["global_keyprefix"] == "p:"
    assert conf.result_backend_transport_options["global_keyprefix"] == "p:"
    routes = conf.task_routes
    assert routes[SCORE]["queue"] == routes[FINETUNE]["queue"] == GPU
    assert routes[VALIDATE]["queue"] == routes[SELECT]["queue"] == CPU


def test_webhook_deliveries_have_a_queue_every_cpu_worker_consumes(tmp_path):
    """A phase's webhook waited behind the tasks ahead of it (job.scoring delivered 65 s late
    on serve's worker): deliveries have a queue of their own, which is neither scoring's nor
    the cpu tasks', declared, and consumed by every worker that runs cpu work (the local
    worker, ``zoopick worker --queues cpu``) or by a worker of its own."""
    conf = make_celery(Settings(data_dir=tmp_path)).conf
    assert conf.task_routes[DELIVER_WEBHOOK]["queue"] == WEBHOOKS
    assert WEBHOOKS not in {conf.task_routes[SCORE]["queue"], conf.task_routes[SELECT]["queue"]}
    assert WEBHOOKS in {q.name for q in conf.task_queues}

    def consumed(queues: str, exact: bool = False) -> list[str]:
        argv = worker_argv(queues, 1, exact=exact)
        return argv[argv.index("--queues") + 1].split(",")

    assert consumed("cpu,gpu") == ["cpu", "gpu", WEBHOOKS]  # zoopick worker's default
    assert consumed("cpu") == ["cpu", WEBHOOKS] and consumed("gpu") == ["gpu"]
    assert consumed(WEBHOOKS) == [WEBHOOKS]
    # serve's local worker leaves them to its webhook consumer (test_serve_webhooks)
    assert consumed("cpu,gpu", exact=True) == ["cpu", "gpu"]


def test_task_time_limits_come_from_settings(tmp_path, monkeypatch):
    from zoopick.workers import tasks

    assert tasks.score_model.soft_time_limit == tasks._settings.score_soft_time_limit
    assert tasks.score_model.time_limit == tasks._settings.score_hard_time_limit
    assert tasks.finetune.time_limit == tasks._settings.train_hard_time_limit


def test_importing_the_workers_does_not_import_torch():
    """Forked pool children must not inherit CUDA state: nothing heavy at import time."""
    code = (
        "import sys, zoopick.workers.celery_app, zoopick.workers.tasks, zoopick.app.main; "
        "heavy = [m for m in ('torch', 'timm') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_triton_switch_travels_in_the_runs_config_not_its_environment(monkeypatch):
    """The deployment's ZOOPICK_COMM_TRITON reaches a run as ``FinetuneConfig.comm_triton``
    (set by the worker from its settings), so Ray's processes on other machines get it in the
    config they read, and the driver hands Ray's runtime environment only its own timeout
    (with an inputs hook, the store's variables too: tests/service/test_ray_inputs.py)."""
    from zoopick.training.config import FinetuneConfig, FinetuneOptions
    from zoopick.training.ray_driver import _worker_env

    monkeypatch.setenv("ZOOPICK_COMM_TRITON", "true")
    assert _worker_env(45) == {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "45"}
    placed = FinetuneConfig.for_run(
        FinetuneOptions(), zoo="z.json", model="m", data="d.npz", out="o", comm_triton=True
    )
    assert FinetuneConfig.from_json(placed.to_json()).comm_triton is True
    off = placed.model_copy(update={"comm_triton": False})
    assert FinetuneConfig.from_json(off.to_json()).comm_triton is False
