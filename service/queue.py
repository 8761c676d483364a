"""The queue contract between the API and the workers: queues, task names, routes, broker options
and :func:`make_celery`, the one way to build a Celery app from the settings.

Three queues: ``cpu`` (dataset validation, selecting the winner, bookkeeping), ``gpu``
(scoring, fine-tuning) and ``webhooks`` (deliveries: a phase's webhook is not sent after the
tasks ahead of it on ``cpu``; every worker on ``cpu`` also consumes it, see
:func:`worker_queues`, and a worker of its own, ``zoopick worker --queues webhooks``, delivers
without waiting for a pool slot that another task holds; ``zoopick serve`` runs such a consumer
beside its local worker, which then consumes ``cpu`` and ``gpu`` only). Run one gpu worker
process per GPU with concurrency 1 and ``CUDA_VISIBLE_DEVICES`` set. Delivery is
at-least-once (``acks_late`` + reject on worker lost, prefetch 1); the tasks are written to be
re-run safely. The Redis visibility timeout is set above the longest hard time limit,
otherwise Redis would hand a still-running GPU task to a second worker. Nothing here imports
torch: forked pool children must not inherit CUDA state.

Both faces build their app here: the worker's (``zoopick.workers.celery_app``, from
``ZOOPICK_*``) includes the task code; the API's (``zoopick.service.dispatch``, from its
settings object) sends tasks by name and never imports task code. Building an app touches
neither disk nor network: the folders of the embedded broker are made when a worker starts or
the API first sends (``Settings.ensure_dirs``).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Queue

from zoopick.service.fsbroker import TRANSPORT
from zoopick.service.result_backend import backend_url
from zoopick.service.settings import Settings

CPU = "cpu"
GPU = "gpu"
WEBHOOKS = "webhooks"
QUEUES = (CPU, GPU, WEBHOOKS)

WORKER_APP = "zoopick.workers.celery_app"
"""What ``celery -A`` loads in a worker process."""
TASKS_MODULE = "zoopick.workers.tasks"

VALIDATE = "zoopick.validate_dataset"
SCORE = "zoopick.score_model"
SELECT = "zoopick.select_model"
FINETUNE = "zoopick.finetune"
RACE_STEP = "zoopick.race_step"
WORKFLOW_FAILED = "zoopick.workflow_failed"
DELIVER_WEBHOOK = "zoopick.deliver_webhook"
EXPORT_MODEL = "zoopick.export_model"
LOG_MLFLOW = "zoopick.log_mlflow"

ROUTES = {
    VALIDATE: {"queue": CPU},
    SCORE: {"queue": GPU},
    SELECT: {"queue": CPU},
    FINETUNE: {"queue": GPU},
    RACE_STEP: {"queue": GPU},
    WORKFLOW_FAILED: {"queue": CPU},
    DELIVER_WEBHOOK: {"queue": WEBHOOKS},
    EXPORT_MODEL: {"queue": CPU},
    LOG_MLFLOW: {"queue": CPU},
    "celery.chord_unlock": {"queue": CPU},  # polling join of result backends without counters
}


PRELOAD_ALIVE_TIMEOUT = 300.0
"""Seconds a pool process may take to start when it preloads the scoring libraries (Celery's
default, 4 s, would count a slow import as a failed start)."""


def broker_options(settings: Settings) -> dict[str, Any]:
    if settings.embedded_broker:
        folder = settings.broker_dir
        return {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "control_folder": str(folder / "control"),
            "processed_folder": str(folder / "processed"),
            "store_processed": False,
        }
    opts: dict[str, Any] = {"visibility_timeout": settings.visibility_timeout}
    if settings.redis_key_prefix:
        opts["global_keyprefix"] = settings.redis_key_prefix
    return opts


def make_celery(settings: Settings, *, include_tasks: bool = False) -> Celery:
    """A Celery app for ``settings``; ``include_tasks`` for a worker (it imports the task
    module when it starts), never for the API."""
    app = Celery(
        "zoopick",
        broker=settings.broker_url,
        backend=backend_url(settings.result_backend),
        include=[TASKS_MODULE] if include_tasks else [],
    )
    backend_opts: dict[str, Any] = {}
    if settings.redis_key_prefix and settings.result_backend.startswith(("redis", "rediss")):
        backend_opts["global_keyprefix"] = settings.redis_key_prefix
    app.conf.update(
        task_queues=[Queue(name) for name in QUEUES],
        task_default_queue=CPU,
        task_routes=ROUTES,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_allow_error_cb_on_chord_header=True,
        worker_prefetch_multiplier=1,
        task_soft_time_limit=settings.light_soft_time_limit,
        task_time_limit=settings.light_hard_time_limit,
        broker_transport_options=broker_options(settings),
        result_backend_transport_options=backend_opts,
        result_expires=7 * 24 * 3600,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        timezone="UTC",
    )
    if settings.embedded_broker:  # kombu's file transport, its messages written whole
        app.conf.broker_transport = TRANSPORT
    if settings.preload_scoring:  # a pool process imports torch before it reports ready
        app.conf.worker_proc_alive_timeout = PRELOAD_ALIVE_TIMEOUT
    return app


def worker_queues(queues: str, exact: bool = False) -> str:
    """The queues a worker asked for ``queues`` consumes: a ``cpu`` worker also takes the
    webhook deliveries (``cpu`` is where they ran before they had a queue of their own, so
    every deployment that runs one keeps delivering), unless ``exact`` (``serve``'s local
    worker, whose deliveries have a consumer of their own: one it took would wait for a pool
    process behind scoring)."""
    names = queues.split(",")
    if not exact and CPU in names and WEBHOOKS not in names:
        names.append(WEBHOOKS)
    return ",".join(names)


def worker_argv(
    queues: str,
    concurrency: int,
    pool: str = "prefork",
    loglevel: str = "info",
    hostname: str | None = None,
    exact: bool = False,
) -> list[str]:
    """The command line of a worker process on ``queues`` (``zoopick worker`` and the local
    worker of ``zoopick serve``; ``exact``: see :func:`worker_queues`); its settings come from
    the environment (:meth:`Settings.env`)."""
    import sys

    name = hostname or f"zoopick-{queues.replace(',', '-')}@%h"
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        WORKER_APP,
        "worker",
        "--queues",
        worker_queues(queues, exact),
        "--concurrency",
        str(concurrency),
        "--pool",
        pool,
        "--loglevel",
        loglevel,
        "--hostname",
        name,
        "--without-gossip",
        "--without-mingle",
    ]
