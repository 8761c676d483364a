"""The Celery tasks: thin over the service core (``zoopick.service.pipeline``: a job's state in
the database) and the two libraries.

Every task starts by reading the job row and does nothing if the job already finished or a
cancel was requested (settling it as cancelled), so a duplicate delivery or a task that a
revoke broadcast missed is harmless. The heavy libraries (torch, timm) are imported inside the
tasks, never at import time: prefork children must not inherit CUDA state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path
from typing import Any, TypeVar

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_init, worker_process_init, worker_ready, worker_shutdown
from celery.worker.request import Request
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from zoopick.service import datasets as store
from zoopick.service import (
    dbretry,
    exports,
    liveness,
    pipeline,
    ray_inputs,
    recovery,
    run_checkpoints,
    run_log,
    storage,
    tracking,
    webhooks,
    zoo_catalog,
)
from zoopick.service import race as races
from zoopick.service.db.models import TERMINAL, Dataset, Job, JobStatus, ZooModel
from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
from zoopick.service.queue import (
    DELIVER_WEBHOOK,
    EXPORT_MODEL,
    FINETUNE,
    LOG_MLFLOW,
    PRELOAD_ALIVE_TIMEOUT,
    RACE_STEP,
    SCORE,
    SELECT,
    VALIDATE,
    WORKFLOW_FAILED,
)
from zoopick.service.settings import Settings, get_settings
from zoopick.training.backends import Backend
from zoopick.training.config import (
    CHECKPOINT,
    FINAL_CONFIG,
    FINAL_WEIGHTS,
    EpochRecord,
    FinetuneConfig,
    FinetuneOptions,
    RunEvent,
)
from zoopick.training.race import SelectionOptions
from zoopick.workers import training_runner

log = logging.getLogger(__name__)

T = TypeVar("T")

_settings = get_settings()


@cache
def _factory(pid: int) -> sessionmaker[Session]:
    """One engine per process (keyed by pid: a forked child builds its own)."""
    return make_sessionmaker(make_engine(_settings.database_url))


def factory() -> sessionmaker[Session]:
    return _factory(os.getpid())


def settings() -> Settings:
    return _settings


def _db(what: str, work: Callable[[], T]) -> T:
    """``work()`` (database work in its own transaction) retried with backoff through a
    database outage of up to ``ZOOPICK_TASK_DB_RETRY_SECONDS`` (``service.dbretry``): the
    task pauses instead of failing its job."""
    return dbretry.retrying(work, what=what, budget_seconds=settings().task_db_retry_seconds)


def owner_id(task: Any) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{task.request.id}"


def _open_job(session: Session, job_id: uuid.UUID) -> Job | None:
    """The job if work on it should go on; settles a requested cancel on the way."""
    job = session.get(Job, job_id)
    if job is None or job.status in TERMINAL:
        return None
    if job.cancel_requested:
        pipeline.finish_cancelled(session, job_id)
        return None
    return job


# -- recovery of lost jobs ------------------------------------------------------------------


@worker_init.connect
def prepare_folders(**_: Any) -> None:
    """The data folders (and the embedded broker's) exist before the worker connects; never
    made at import (importing a module has no effect on disk)."""
    settings().ensure_dirs()


@worker_ready.connect
def sweep_on_start(**_: Any) -> None:
    """A worker (re)starting is the moment jobs of a dead worker are most likely found lost:
    sweep once, in a thread so the worker starts consuming at once (see
    ``zoopick.service.recovery``)."""

    def run() -> None:
        try:
            recovery.sweep_once(settings())  # logs what it does
        except Exception:  # noqa: BLE001 - a sweep must never take the worker down
            log.warning("sweep for lost jobs at worker start failed", exc_info=True)

    threading.Thread(target=run, name="zoopick-sweep", daemon=True).start()


# -- heartbeats -------------------------------------------------------------------------------

_heartbeat: liveness.Heartbeat | None = None
_stalled = False


def _heartbeat_name() -> str:
    return f"{socket.gethostname()}/{os.getpid()}"


def _queues(consumer: Any) -> str:
    """The queues this worker consumes, e.g. ``cpu,gpu``."""
    try:
        return ",".join(sorted(consumer.app.amqp.queues.consume_from))
    except Exception:  # noqa: BLE001 - only shown to operators
        return ""


def _pool_pids(consumer: Any) -> Callable[[], list[int]]:
    """The prefork pool's process ids (Celery's own ``inspect stats`` reads them the same way);
    none for a pool without processes, which then never counts as stalled."""

    def pids() -> list[int]:
        processes = getattr(getattr(consumer.pool, "_pool", None), "_pool", None) or []
        return [p.pid for p in processes if p.pid]

    return pids


@worker_ready.connect
def start_heartbeat(sender: Any = None, **_: Any) -> None:
    """The worker's main process beats while it can run tasks (see
    ``zoopick.service.liveness``): a worker whose pool no longer gets its tasks stops beating
    even though all its processes live."""
    global _heartbeat
    cfg = settings()
    if sender is None:  # not a worker's consumer: nothing to check
        return
    grace = cfg.heartbeat_timeout_seconds
    if cfg.preload_scoring:  # a new pool process imports torch before it takes a task
        grace = max(grace, PRELOAD_ALIVE_TIMEOUT)
    check = liveness.DispatchCheck(_pool_pids(sender), cfg.heartbeat_timeout_seconds, grace)

    def problem() -> str | None:
        found = check.problem()
        sender.call_soon(check.loop_tick)  # the event loop runs it by the next check
        return found

    def on_problem(_: str) -> None:
        sender.call_soon(_give_back_and_stop, sender)

    _heartbeat = liveness.Heartbeat(
        factory(),
        _heartbeat_name(),
        socket.gethostname(),
        os.getpid(),
        _queues(sender),
        cfg.heartbeat_seconds,
        problem,
        on_problem,
    ).start()


def _give_back_and_stop(consumer: Any) -> None:
    """In the worker's event loop, once it found itself stalled: stop taking tasks, hand
    every task it reserved but did not start back to the broker (the file broker and Redis
    re-queue a rejected message at once), stop beating and shut down warmly (tasks running in
    the pool finish). A worker that cannot run tasks must not hold them; ``zoopick serve``
    restarts its local worker, and in distributed mode the other workers (or a restarted one)
    run them."""
    from celery.worker import state

    try:
        consumer.task_consumer.cancel()  # or a shutting-down worker reserves them again
    except Exception:  # noqa: BLE001 - give back what it holds anyway
        log.warning("could not stop consuming", exc_info=True)
    active = set(state.active_requests)
    waiting = [r for r in list(state.reserved_requests) if r not in active]
    for request in waiting:
        try:
            request.reject(requeue=True)
        except Exception:  # noqa: BLE001 - the sweepers recover what could not be given back
            log.warning("could not give task %s back", request.id, exc_info=True)
        state.task_ready(request)
    global _stalled
    _stalled = True  # its heartbeat row stays, going stale: /readyz reports the stall
    if _heartbeat is not None:
        _heartbeat.stop()
    log.error("gave %d reserved task(s) back; shutting this stalled worker down", len(waiting))
    os.kill(os.getpid(), signal.SIGTERM)


@worker_shutdown.connect
def stop_heartbeat(**_: Any) -> None:
    """A worker stopping cleanly removes its row (it is gone, not stalled); one that stopped
    itself for a stall leaves it to go stale."""
    if _heartbeat is not None and not _stalled:
        _heartbeat.stop()
        try:
            liveness.forget(factory(), _heartbeat_name())
        except Exception:  # noqa: BLE001 - shutting down anyway
            log.debug("could not remove the heartbeat row", exc_info=True)


@worker_process_init.connect
def prepare_pool_process(**_: Any) -> None:
    """A pool process connects to the database when it starts, so its first task's time limit
    is not spent on that; with ``ZOOPICK_PRELOAD_SCORING`` it also imports the scoring
    libraries (after the fork: no CUDA state is inherited)."""
    try:
        with factory()() as session:
            session.execute(text("SELECT 1"))
    except Exception:  # noqa: BLE001 - the first task connects (or reports) instead
        log.warning("could not connect to the database", exc_info=True)
    if settings().preload_scoring:
        import timm.data  # noqa: F401

        import zoopick.selection.extract  # noqa: F401
        import zoopick.selection.rank  # noqa: F401


# -- datasets ---------------------------------------------------------------------------------


@shared_task(name=VALIDATE, bind=True)
def validate_dataset(self, dataset_id: str) -> str:
    did = uuid.UUID(dataset_id)

    def counted() -> int:
        with session_scope(factory()) as session:
            return liveness.count_delivery(session, f"validate:{did}")

    count = _db(f"validating {did}", counted)
    error = liveness.died_too_often(count, settings(), "validating")
    if error is not None:
        return _db(
            f"validating {did}", lambda: store.fail_validation(factory(), did, settings(), error)
        )

    def touch() -> None:
        with session_scope(factory()) as session:
            recovery.touch_validation(session, did)

    # a long load keeps the dataset's progress fresh: only a dead validation looks lost
    with liveness.Renewal(touch, settings().recovery_grace_seconds / 4):
        return _db(f"validating {did}", lambda: store.validate(factory(), did, settings()))


# -- scoring ----------------------------------------------------------------------------------


def score_one(entry: Any, dataset_path: str, metrics: list[str], cfg: Settings) -> Any:
    """Forward pass + every metric for one model (``selection.rank.score_model``); returns
    its ``ModelResult``. The images come decoded from validation's copy
    (``store.for_scoring``): a job of N models decodes its dataset once, and a model the
    feature cache holds decodes nothing."""
    from zoopick.selection.rank import score_model

    dataset = store.for_scoring(dataset_path, cfg)
    return score_model(
        entry,
        dataset,
        metrics,
        cache_dir=cfg.cache_dir,
        shared_cache=store.feature_cache(dataset_path, cfg),  # the store's, behind cache_dir
        batch_size=cfg.score_batch_size,
        max_logits_bytes=cfg.max_logits_bytes,
        preprocess_cache_bytes=cfg.preprocess_cache_bytes,
    )


class ScoreRequest(Request):
    """A scoring task's request in the worker's main process: a hard time limit costs the model,
    not the job.

    A model normally stops at its soft limit (``SoftTimeLimitExceeded``, caught in
    :func:`score_model`). One stuck where that exception cannot reach it (in native code, or a
    process that stopped running) is killed at the hard limit; Celery would then record the
    task as failed, which fails the job's whole chord. Here (the pool reports the hard limit
    to ``on_failure``, then to ``on_timeout``) the model's error is recorded instead and the
    message handed back: its next delivery finds the model settled and returns at once, so
    the chord goes on with the other models."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False):
        from billiard.exceptions import TimeLimitExceeded

        exc = getattr(exc_info.exception, "exc", exc_info.exception)  # unwrap the pool's
        if not isinstance(exc, TimeLimitExceeded) or self.acknowledged:
            return super().on_failure(exc_info, send_failed_event, return_ok)
        from celery.worker import state

        state.task_ready(self)
        limit = settings().score_hard_time_limit
        log.error("scoring task %s exceeded its hard time limit (%s s)", self.id, limit)
        try:
            job_id, model_id = self.args[0], self.args[1]
            with session_scope(factory()) as session:
                _model_failed(
                    session,
                    uuid.UUID(job_id),
                    model_id,
                    f"scoring exceeded the hard time limit of {limit} s "
                    "(ZOOPICK_SCORE_HARD_TIME_LIMIT); its process was killed",
                )
        except Exception:  # noqa: BLE001 - the re-delivery counts it as a worker death
            log.warning("could not record the hard time limit of %s", self.id, exc_info=True)
        self.reject(requeue=True)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        from celery.worker import state

        if soft or state.should_terminate or not self.acknowledged:
            return super().on_timeout(soft, timeout)
        # the hard limit: settled by on_failure, which the pool called first


@shared_task(
    name=SCORE,
    bind=True,
    soft_time_limit=_settings.score_soft_time_limit,
    time_limit=_settings.score_hard_time_limit,
    Request=ScoreRequest,
)
def score_model(self, job_id: str, model_id: str) -> str:
    jid = uuid.UUID(job_id)
    cfg = settings()
    what = f"job {jid}: scoring {model_id}"
    # the model's lease is the message's (its task id), not the process's: a message Celery
    # delivers again after its worker died takes its own lease back at once, while a re-sent
    # canvas (fresh task ids) waits for a live first task
    owner = self.request.id
    started = _db(what, lambda: _start_scoring(jid, model_id, cfg, owner))
    if started == HELD:  # another live task scores this model: settled when it ends
        raise self.retry(countdown=held_countdown(cfg), max_retries=None)
    if isinstance(started, str):
        return started
    entry, metrics, path = started

    def renew() -> None:
        with session_scope(factory()) as session:
            pipeline.renew_lease(session, jid, pipeline.scoring_owner(jid),
                                 cfg.recovery_grace_seconds)  # fmt: skip
            pipeline.renew_model_lease(session, jid, model_id, owner, cfg.recovery_grace_seconds)

    try:
        # the job's lease and this model's stay live through a long forward pass (the
        # sweeper's proof of life: a model whose lease lapsed lost its task)
        with liveness.Renewal(renew, cfg.recovery_grace_seconds / 4):
            result = score_one(entry, path, metrics, cfg)
    except SoftTimeLimitExceeded:  # this model is too slow: skip it, score the others
        log.warning("job %s: scoring model %s hit its time limit", jid, model_id)
        error = (
            f"scoring exceeded the time limit of {cfg.score_soft_time_limit} s "
            "(ZOOPICK_SCORE_SOFT_TIME_LIMIT)"
        )
        _db(what, lambda: _settle_model_error(jid, model_id, error))
        return "model failed"
    except Exception as exc:  # a broken zoo entry: skip this model, score the others
        log.warning("job %s: scoring model %s failed", jid, model_id, exc_info=True)
        error = f"scoring failed: {exc}"
        _db(what, lambda: _settle_model_error(jid, model_id, error))
        return "model failed"
    return _db(what, lambda: _record_scores(jid, model_id, result))


HELD = "held"
""":func:`_start_scoring`'s answer when another live task holds the model's lease (a re-sent
job's canvas reaching a model its first task still scores): the task comes back later rather
than score the model twice, and then finds it settled (or its lease lapsed: it scores it)."""


def held_countdown(cfg: Settings) -> float:
    """Seconds before a task whose model another live task scores looks again: a quarter of
    the lease (the holder's renewal period), at most 5 s, so selection waits little once the
    holder is done."""
    return max(1.0, min(5.0, cfg.recovery_grace_seconds / 4))


def _start_scoring(
    jid: uuid.UUID, model_id: str, cfg: Settings, owner: str
) -> str | tuple[Any, list, str]:
    """One transaction: the job moves to ``scoring``, this task takes the model's lease and
    this start is counted; returns what to score (zoo entry, metrics, dataset path), or the
    task's answer when there is nothing to do (:data:`HELD`: not yet)."""
    with session_scope(factory()) as session:
        job = _open_job(session, jid)
        if job is None:
            return "skipped"
        pipeline.transition(session, jid, JobStatus.scoring)
        if model_id in pipeline.scored_models(session, job) or model_id in (
            job.model_errors or {}
        ):  # a re-delivered message, or a re-queued job: this model is settled
            pipeline.update_scoring_progress(session, job)
            return "already settled"
        lease = cfg.recovery_grace_seconds
        if not pipeline.claim_model_lease(session, jid, model_id, owner, lease):
            return HELD  # not counted: this start computes nothing
        count = liveness.count_delivery(session, f"score:{jid}:{model_id}")
        error = liveness.died_too_often(count, cfg, "scoring")
        if error is not None:  # this model kills its worker: skip it, score the others
            _model_failed(session, jid, model_id, error)
            return "model failed"
        row = session.get(ZooModel, model_id)
        ds = session.get(Dataset, job.dataset_id) if job.dataset_id else None
        if row is None or ds is None:
            what = f"zoo model {model_id!r}" if row is None else "the dataset"
            pipeline.fail(session, jid, f"{what} was deleted before it could be scored")
            return "failed"
        # renewed while the model is scored, as the model's own lease: once that lapses
        # (its task died), or the job's lapses with no progress, the sweeper sends the job's
        # unsettled work again (``service.recovery``)
        pipeline.claim_lease(session, jid, pipeline.scoring_owner(jid), lease)
        return zoo_catalog.to_entry(row), list(job.metrics), ds.storage_path


def _settle_model_error(jid: uuid.UUID, model_id: str, error: str) -> None:
    with session_scope(factory()) as session:
        _model_failed(session, jid, model_id, error)


def _record_scores(jid: uuid.UUID, model_id: str, result: Any) -> str:
    """One transaction: the model's scores upserted (a re-run writes the same rows)."""
    with session_scope(factory()) as session:
        job = session.get(Job, jid)
        if job is None:
            return "deleted"
        pipeline.upsert_scores(
            session,
            jid,
            model_id,
            result.scores,
            result.seconds,
            cached=result.cached,
            parts=result.parts,
        )
        pipeline.release_model_lease(session, jid, model_id)
        pipeline.update_scoring_progress(session, job)
        if job.cancel_requested:  # checked between models
            pipeline.finish_cancelled(session, jid)
    return "scored"


def _model_failed(session: Session, jid: uuid.UUID, model_id: str, error: str) -> None:
    """Settle one model of the job as failed with ``error`` (``jobs.model_errors``); the job
    goes on with the others and fails only when no model could be scored
    (:func:`select_model`)."""
    pipeline.record_model_error(session, jid, model_id, error)
    pipeline.release_model_lease(session, jid, model_id)
    job = session.get(Job, jid)
    if job is not None:
        pipeline.update_scoring_progress(session, job)


# -- selection --------------------------------------------------------------------------------


@shared_task(name=SELECT, bind=True)
def select_model(self, job_id: str) -> str:
    """After every model is scored: pick the winner, then finish or hand over to training."""
    jid = uuid.UUID(job_id)
    return _db(f"job {jid}: selection", lambda: _select(jid))


def _select(jid: uuid.UUID) -> str:
    with session_scope(factory()) as session:
        job = _open_job(session, jid)
        if job is None:
            return "skipped"
        errors = dict(job.model_errors or {})
        scored = pipeline.scored_models(session, job)
        missing = [m for m in job.models if m not in scored and m not in errors]
        if missing:
            pipeline.fail(session, jid, f"models left unscored: {', '.join(missing)}")
            return "failed"
        # scoring is over: its shared lease must not hold off the race's or the fine-tune's
        pipeline.release_lease(session, jid, pipeline.scoring_owner(jid))
        pipeline.combine_zoo_scores(session, job)  # NCTI: normalised over the scored zoo
        chosen = pipeline.choose(session, job)
        if chosen is None:
            why = "; ".join(f"{m}: {e}" for m, e in errors.items())
            pipeline.fail(session, jid, f"no model could be scored ({why})" if why else
                          "no model could be scored")  # fmt: skip
            return "failed"
        if job.selection:
            ranked = [r["model"] for r in pipeline.ranking(session, job)]
            if len(ranked) >= 2:
                try:
                    models = races.start(session, job, ranked)
                except races.RaceRefused as exc:  # the dataset changed since submission
                    pipeline.fail(session, jid, f"the race cannot run: {exc}")
                    return "failed"
                session.commit()
                if models:
                    session.refresh(job)
                    _dispatcher().race_steps(job, 0, models)
                return f"racing {len(models)}"
        if job.finetune:
            moved = pipeline.transition(
                session,
                jid,
                JobStatus.training,
                chosen_model=chosen,
                progress=pipeline.SCORING_SHARE_WITH_TRAINING,
            )
        else:
            moved = pipeline.transition(session, jid, JobStatus.succeeded, chosen_model=chosen)
    return f"chose {chosen}" if moved else "skipped"


# -- fine-tuning ------------------------------------------------------------------------------


def run_dir(cfg: Settings, job_id: uuid.UUID) -> Path:
    """Fixed per job, so a re-delivered training task resumes from the last epoch."""
    return cfg.storage_dir / "jobs" / str(job_id) / "train"


@shared_task(
    name=FINETUNE,
    bind=True,
    soft_time_limit=_settings.train_soft_time_limit,
    time_limit=_settings.train_hard_time_limit,
)
def finetune(self, job_id: str) -> str:
    jid = uuid.UUID(job_id)
    cfg = settings()
    owner = owner_id(self)
    with session_scope(factory()) as session:
        job = _open_job(session, jid)
        if job is None or job.status != JobStatus.training.value:
            return "skipped"
        if not pipeline.claim_lease(session, jid, owner, cfg.lease_seconds):
            # another delivery is training this job right now; come back when its lease
            # would have expired (it either finished by then or died)
            raise self.retry(countdown=cfg.lease_seconds, max_retries=None)
        row = session.get(ZooModel, job.chosen_model)
        ds = session.get(Dataset, job.dataset_id) if job.dataset_id else None
        if row is None or ds is None:
            pipeline.fail(session, jid, "the chosen model or the dataset was deleted")
            return "failed"
        out = run_dir(cfg, jid)
        options = FinetuneOptions.stored(job.finetune or {})
        winner = race_dir(cfg, jid, job.chosen_model) / CHECKPOINT if job.race else None
        won = run_checkpoints.race_key(job.tenant_id, jid, row.id) if job.race else None
        storage_path = ds.storage_path
        tenant, saved = job.tenant_id, run_checkpoints.stored_key(job.tenant_id, jid)
    # the zoo's checkpoint and the dataset are fetched from the store (once per machine; on
    # Ray by each worker, on its node) with no transaction open: the claimed lease is
    # committed, so no other delivery starts too
    files = storage.open_store(cfg.storage_url)
    local = cfg.train_backend == "local"
    try:
        data = _run_inputs(row, storage_path, out.parent, cfg, local)
        # a run lost on another machine continues from its checkpoint in the store (the
        # local backend's: Ray Train keeps its own in its storage path)
        fetched = local and run_checkpoints.fetch(files, saved, out)
        seed = None  # a Ray run's: the store's key of the winner's checkpoint, which each
        if won is not None and not local:  # of its workers fetches on its own machine
            seed = won if storage.retrying(lambda: files.exists(won)) else None
        elif winner is not None and won is not None and not (out / CHECKPOINT).exists():
            # the race's winner trained on another machine: its checkpoint from the store
            run_checkpoints.fetch(files, won, winner.parent)
    except storage.StoreUnavailable as exc:  # tried again already: fail naming the store
        log.error("job %s: %s", jid, exc)
        with session_scope(factory()) as session:
            pipeline.release_lease(session, jid, owner)
            pipeline.fail(session, jid, f"the run's files could not be fetched: {exc}")
        return "failed"
    except Exception:
        with session_scope(factory()) as session:  # another delivery may try at once
            pipeline.release_lease(session, jid, owner)
        raise
    run_cfg = FinetuneConfig.for_run(
        options,
        model=row.id,
        out=str(out),
        resume=(out / CHECKPOINT).exists(),  # a re-delivered task continues the same run
        # the race winner's training is where this run starts: no step is thrown away (a
        # Ray run's workers name their own copies: ray_inputs.place)
        init_from=str(winner) if local and winner is not None and winner.is_file() else None,
        dataset_limits=dataclasses.asdict(cfg.dataset_limits()),  # what validated it
        comm_triton=cfg.comm_triton,  # the deployment's switch, wherever the run is
        **data,
    )
    if won is not None and seed is None and run_cfg.init_from is None and not run_cfg.resume:
        log.warning("job %s: the race winner's checkpoint is in neither this machine's folder "
                    "nor the store: its fine-tune starts from the zoo's weights", jid)  # fmt: skip
    if fetched:  # another machine's run: its files' names become this machine's
        run_checkpoints.rebase(out, run_cfg.model_dump(mode="json"))
        run_log.restore(files, run_log.stored_key(tenant, jid), out)  # its log goes on
    with session_scope(factory()) as session:
        job = session.get(Job, jid)
        if job is None or job.status != JobStatus.training.value:  # deleted, cancelled
            pipeline.release_lease(session, jid, owner)
            return "skipped"
        run = pipeline.open_run(
            session,
            job,
            row.id,
            config=run_cfg.model_dump(mode="json"),
            world_size=options.max_workers,
            out=str(out),
            backend=cfg.train_backend,
        )
        run_id, epochs = run.id, options.epochs
        # the log in the store too: an API on another machine reads it there
        logs = run_log.Pusher(
            storage.open_store(cfg.storage_url), run_log.stored_key(job.tenant_id, jid), out
        )

    def renew(session: Session) -> bool:
        logs.maybe()
        return pipeline.renew_lease(session, jid, owner, cfg.lease_seconds)

    def on_record(record: EpochRecord) -> None:
        with session_scope(factory()) as session:
            pipeline.record_epoch(session, run_id, record)
            share = pipeline.SCORING_SHARE_WITH_TRAINING
            if epochs is not None:  # else the recipe's length: the progress events move it
                done = min(record.epoch, epochs) / max(1, epochs)
                pipeline.set_progress(session, jid, share + (1 - share) * done * 0.99)

    def on_event(event: RunEvent) -> None:
        with session_scope(factory()) as session:
            pipeline.record_run_event(session, run_id, event)

    def timed_out(session: Session) -> None:
        pipeline.finish_run(session, jid, "failed", "training exceeded its time limit")
        pipeline.fail(
            session, jid, f"training exceeded the time limit of {cfg.train_soft_time_limit} s"
        )

    # a Ray run keeps its checkpoints under the job's prefix (deleted with it), and each of its
    # workers fetches the dataset, the zoo checkpoint and the race winner's from the store on
    # its own machine
    backend = cfg.training_backend(storage.tenant_key(tenant, "jobs", str(jid), "train"))
    if not local:
        inputs = ray_inputs.document(cfg, row, storage_path, init_from=seed)
        backend = dataclasses.replace(backend, inputs=inputs)
    # each checkpoint the trainer writes goes to the store too, from a thread of its own, and
    # the log with it: a machine that resumes from it has the lost run's lines up to there
    uploads = run_checkpoints.Uploader(files, saved, out, on_put=lambda _: logs.now())
    if local:
        uploads.start()
    try:
        result = training_runner.follow_run(
            lambda: training_runner.spawn(run_cfg, backend),
            factory(),
            jid,
            renew=renew,
            on_time_limit=timed_out,
            on_record=on_record,
            on_event=on_event,
            poll=min(5.0, cfg.lease_seconds / 4),  # renewed well before it runs out
            log=out,
        )
    finally:
        uploads.close()
    if result.lease_lost:
        # the job, its running run and its folder are the new task's now: settle nothing
        return "lease lost"
    logs.final()
    with session_scope(factory()) as session:
        job = session.get(Job, jid)
        if result.stopped:
            pipeline.finish_run(session, jid, "cancelled", None)
            if job is not None and job.cancel_requested:
                pipeline.finish_cancelled(session, jid)
            return "cancelled"
        if result.returncode != 0:
            error = result.error or f"trainer exited with code {result.returncode}"
            pipeline.finish_run(session, jid, "failed", error)
            pipeline.fail(session, jid, f"training failed: {error}")
            return "failed"
        weights = out / FINAL_WEIGHTS
        if not weights.is_file():
            pipeline.finish_run(session, jid, "failed", "no model file written")
            pipeline.fail(session, jid, f"training finished without writing {weights.name}")
            return "failed"
        if job is None:  # deleted while it trained (its rows went with it)
            return "job deleted"
    # the model is kept in the store (what the API serves, wherever it runs), outside any
    # transaction: its retries may take a while, and hold no database connection meanwhile
    try:
        kept = storage.retrying(lambda: exports.keep(files, job, "safetensors", weights))
    except storage.StoreUnavailable as exc:
        log.error("job %s: %s", jid, exc)
        with session_scope(factory()) as session:
            pipeline.finish_run(session, jid, "failed", str(exc))
            pipeline.fail(session, jid, f"the fine-tuned model could not be stored: {exc}")
        return "failed"
    with session_scope(factory()) as session:
        pipeline.add_artefact(session, jid, "model", kept.key, kept.sha256, kept.size)
        pipeline.record_recipe(session, run_id, out / FINAL_CONFIG)
        pipeline.finish_run(session, jid, "succeeded", None)
        pipeline.transition(session, jid, JobStatus.succeeded)
        pipeline.release_lease(session, jid, owner)
    return "trained"


# -- the race: stage 2 of a two-stage selection -------------------------------------------


def _dispatcher() -> Any:
    from zoopick.service.dispatch import Dispatcher

    return Dispatcher(settings())


def race_dir(cfg: Settings, job_id: uuid.UUID, model_id: str) -> Path:
    """A candidate's run folder on this machine, fixed per (job, model): every rung resumes it
    (from the store's copy, ``run_checkpoints.race_key``, where another machine ran the last)."""
    folder = run_checkpoints.candidate_folder(model_id)
    return cfg.storage_dir / "jobs" / str(job_id) / "race" / folder


@shared_task(
    name=RACE_STEP,
    bind=True,
    soft_time_limit=_settings.train_soft_time_limit,
    time_limit=_settings.train_hard_time_limit,
)
def race_step(self, job_id: str, model_id: str, rung: str) -> str:
    """Train one shortlisted model to its rung's step count (resuming its checkpoint), validate
    it, then move the race on if it was the rung's last candidate."""
    jid, level = uuid.UUID(job_id), int(rung)
    cfg = settings()
    owner = owner_id(self)
    shared = f"race:{jid}"  # every candidate's task renews the job's lease: proof of life
    with session_scope(factory()) as session:
        job = _open_job(session, jid)
        if job is None or job.status != JobStatus.racing.value:
            return "skipped"
        entry = races.claim(session, jid, model_id, level, owner, cfg.lease_seconds)
        if entry is None:  # settled, or another live task trains it: maybe move on
            outcome = "already settled"
        else:
            pipeline.claim_lease(session, jid, shared, cfg.lease_seconds)
            row = session.get(ZooModel, model_id)
            ds = session.get(Dataset, job.dataset_id) if job.dataset_id else None
            if row is None or ds is None:
                races.settle(session, entry.id, "failed", error="the model or dataset was deleted")
                outcome = "failed"
            else:
                out = race_dir(cfg, jid, model_id)
                selection = SelectionOptions.stored(job.selection)
                options, start = races.race_options(job), races.rung_start(job, level)
                entry_id, steps = entry.id, entry.target_steps
                saved = run_checkpoints.race_key(job.tenant_id, jid, row.id)
                where = run_checkpoints.candidate_prefix(job.tenant_id, jid, row.id)
                backend = _rung_backend(cfg, where, row, ds.storage_path)
                storage_path = ds.storage_path
                outcome = "train"
    # committed: the entry's claim and the job's lease. Its input files are fetched from the
    # store with no transaction open (seconds to minutes, or a store's outage), the leases
    # renewed meanwhile
    if outcome == "train":
        files = partial(_rung_files, row, storage_path, out, cfg, backend, saved)
        fetched = _rung_inputs(jid, entry_id, owner, shared, cfg, files)
        if isinstance(fetched, str):
            outcome = fetched
        else:
            inputs, restored = fetched
            run_cfg = FinetuneConfig.for_run(
                options,
                model=row.id,
                out=str(out),
                resume=(out / CHECKPOINT).exists(),
                max_steps=steps,
                decay_from=start,
                validation_fraction=selection.validation_fraction,
                dataset_limits=dataclasses.asdict(cfg.dataset_limits()),
                comm_triton=cfg.comm_triton,
                **inputs,
            )
            if restored:  # the store's checkpoint, written on another machine: placed here
                run_checkpoints.rebase(out, run_cfg.model_dump(mode="json"))
            outcome = _run_rung(jid, entry_id, run_cfg, owner, shared, cfg, saved, backend)
    with session_scope(factory()) as session:
        job = session.get(Job, jid)
        if job is None:
            return outcome
        if job.cancel_requested:
            pipeline.finish_cancelled(session, jid)
            return "cancelled"
        step = races.advance(session, job, level)
        if step.action == "failed":
            pipeline.fail(session, jid, f"the race failed: {step.error}")
        session.commit()
        session.refresh(job)
        if step.action == "next":
            _dispatcher().race_steps(job, step.rung, step.models)
        elif step.action == "chosen" and job.finetune:
            _dispatcher().finetune(job)
        elif step.action == "wait":
            races.set_race_progress(session, job)
    return f"{outcome}; {step.action}"


def _rung_backend(cfg: Settings, where: str, row: ZooModel, storage_path: str) -> Backend:
    """Where a candidate's rung runs: the deployment's backend. On Ray, the candidate's run
    keeps its checkpoints in its folder of the store, ``where`` (Ray Train's storage,
    ``<where>/ray``: every rung continues the run there, whichever gpu worker and nodes take
    it), and its workers fetch the dataset and the zoo checkpoint on their own machines
    (``ray_inputs``)."""
    backend = cfg.training_backend(where)
    if backend.kind == "local":
        return backend
    inputs = ray_inputs.document(cfg, row, storage_path)
    return dataclasses.replace(backend, inputs=inputs)


def _rung_files(row: ZooModel, storage_path: str, out: Path, cfg: Settings, backend: Backend,
                saved: str) -> tuple[dict[str, Any], bool]:  # fmt: skip
    """The rung's input files as ``FinetuneConfig.for_run`` takes them (the zoo manifest, its
    checkpoint fetched here, and the dataset) and whether the candidate's checkpoint was
    fetched from the store (``saved``). The local backend's trainer reads them on this
    machine: fetched here, and so is the candidate's last checkpoint where this folder has
    none (the last rung ran on another machine). A Ray run's workers fetch the zoo checkpoint
    and the dataset on their own nodes (``ray_inputs.place`` names their copies in the
    config) and continue the candidate's run from Ray's storage: none is fetched here."""
    local = backend.kind == "local"
    inputs = _run_inputs(row, storage_path, out, cfg, local)
    if not local:
        return inputs, False
    return inputs, run_checkpoints.fetch(storage.open_store(cfg.storage_url), saved, out)


def _run_inputs(row: ZooModel, storage_path: str, folder: Path, cfg: Settings,
                local: bool) -> dict[str, Any]:  # fmt: skip
    """A run's zoo manifest (in ``folder``) and dataset as ``FinetuneConfig.for_run`` takes
    them. The local backend's trainer reads them on this machine: the zoo checkpoint and the
    dataset are fetched here (the dataset's images decoded once). A Ray run's workers fetch
    both on their own nodes (``ray_inputs.place``): nothing is fetched here."""
    if not local:
        return ray_inputs.unplaced(row, storage_path, folder)
    manifest = zoo_catalog.write_manifest([row], folder / "zoo.json")
    return {"zoo": str(manifest), **store.run_data(storage_path, cfg)}


def _rung_inputs(jid: uuid.UUID, entry_id: int, owner: str, shared: str, cfg: Settings,
                 fetch: Callable[[], T]) -> T | str:  # fmt: skip
    """``fetch()`` (the rung's files from the store, no transaction open) with the entry's
    lease and the job's renewed meanwhile, as while the rung trains: a long fetch is no dead
    candidate to the sweeper. A store that stayed unavailable through its retries settles the
    entry as failed, naming the store: ``"failed"`` (the rung never starts again from scratch
    over a stored checkpoint it could not read); ``"lease lost"`` where a sweeper gave the
    candidate to a new task meanwhile (the entry is that task's now: settled by it). Other
    errors pass, the claim left to its lease (the task's failure fails the job:
    ``workflow_failed``)."""
    lost = threading.Event()

    def renew() -> None:
        with session_scope(factory()) as session:
            if not races.renew(session, entry_id, owner, cfg.lease_seconds):
                lost.set()
                return
            pipeline.claim_lease(session, jid, shared, cfg.lease_seconds)

    try:
        with liveness.Renewal(renew, min(5.0, cfg.lease_seconds / 4)):
            fetched = fetch()
    except storage.StoreUnavailable as exc:  # tried again already: fail naming the store
        log.error("job %s: %s", jid, exc)
        if lost.is_set():
            return "lease lost"
        with session_scope(factory()) as session:
            error = f"the rung's files could not be fetched: {exc}"
            races.settle(session, entry_id, "failed", error=error)
        return "failed"
    return "lease lost" if lost.is_set() else fetched


def _run_rung(jid: uuid.UUID, entry_id: int, run_cfg: FinetuneConfig, owner: str, shared: str,
              cfg: Settings, saved: str, backend: Backend) -> str:  # fmt: skip
    """One candidate's rung on ``backend``; the entry is settled with what the trainer counted
    (steps, validation accuracy) or why it failed. The candidate's checkpoint goes through the
    store (``saved``): with the local backend a rung whose folder has none here resumes the
    store's (the last rung ran on another machine), and each one the trainer writes is put
    there; on Ray the run continues from its own storage and its last checkpoint comes back
    to this folder. The rung's last is put there before the entry is settled: the winner's
    fine-tune starts from it (the store's checkpoint, where this folder had none, was fetched
    with the rung's files: ``_rung_files``)."""
    import time

    last: list[EpochRecord] = []
    started = time.monotonic()
    out = Path(run_cfg.out)
    files = storage.open_store(cfg.storage_url)

    def reached(steps: int) -> None:
        """How far the rung has got, for the API, the dashboard and the job's progress."""
        with session_scope(factory()) as session:
            races.record_reached(session, entry_id, owner, steps)
            job = session.get(Job, jid)
            if job is not None:
                races.set_race_progress(session, job)

    def on_record(record: EpochRecord) -> None:
        last.append(record)
        if record.steps is not None:
            reached(record.steps)

    def on_event(event: RunEvent) -> None:
        if event.event == "resumed":
            log.info("job %s: %s resumes its checkpoint of epoch %s", jid, run_cfg.model,
                     event.epoch)  # fmt: skip
        # progress lines say the step reached within an epoch: epochs before it were whole
        if event.event == "progress" and event.epoch and event.steps and event.step is not None:
            reached((event.epoch - 1) * event.steps + event.step)

    def renew(session: Session) -> bool:
        if not races.renew(session, entry_id, owner, cfg.lease_seconds):
            return False  # a sweeper gave the candidate to a new task
        pipeline.claim_lease(session, jid, shared, cfg.lease_seconds)
        return True

    def timed_out(session: Session) -> None:
        races.settle(session, entry_id, "failed", error="the rung exceeded its time limit")

    uploads = run_checkpoints.Uploader(files, saved, out)
    if backend.kind == "local":
        uploads.start()
    try:
        result = training_runner.follow_run(
            lambda: training_runner.spawn(run_cfg, backend),
            factory(),
            jid,
            renew=renew,
            on_time_limit=timed_out,
            on_record=on_record,
            on_event=on_event,
            poll=min(5.0, cfg.lease_seconds / 4),  # renewed well before it runs out
        )
    finally:
        uploads.close()
    if not result.lease_lost:
        uploads.check()  # the rung's last checkpoint, before the entry says it is done
    seconds = time.monotonic() - started
    if result.lease_lost:
        # the entry belongs to the task the sweeper sent (it resumes the checkpoint):
        # settling it here would cancel a candidate nobody cancelled
        return "lease lost"
    with session_scope(factory()) as session:
        if result.stopped:
            races.settle(session, entry_id, "cancelled", seconds=seconds)
            return "cancelled"
        record = last[-1] if last else None
        if result.returncode != 0 or record is None or record.val_accuracy is None:
            error = result.error or f"trainer exited with code {result.returncode}"
            races.settle(session, entry_id, "failed", seconds=seconds, error=error)
            return "failed"
        races.settle(session, entry_id, "done", record=record, seconds=seconds)
    return "trained"


# -- the canvas' error callback ---------------------------------------------------------------


@shared_task(name=WORKFLOW_FAILED, bind=True)
def workflow_failed(self, job_id: str, *args: Any) -> str:
    """Called when a task of the job's canvas failed, crashed, timed out or was revoked. The
    tasks record their own errors; this settles the cases where none could (a killed worker,
    a hard time limit, a revoked task in the chord)."""
    jid = uuid.UUID(job_id)
    return _db(f"job {jid}: settling a failed task", lambda: _settle_failed_workflow(jid))


def _settle_failed_workflow(jid: uuid.UUID) -> str:
    with session_scope(factory()) as session:
        job = session.get(Job, jid)
        if job is None or job.status in TERMINAL:
            return "settled"
        if job.cancel_requested:
            pipeline.finish_cancelled(session, jid)
            return "cancelled"
        pipeline.fail(session, jid, "a task of this job crashed or exceeded its hard time limit")
    return "failed"


# -- webhooks ---------------------------------------------------------------------------------


@shared_task(name=DELIVER_WEBHOOK, bind=True)
def deliver_webhook(self, delivery_id: str) -> str:
    """One try of a webhook delivery (``zoopick.service.webhooks``); a failed try sends the
    next one with a doubled countdown, after this try is logged."""
    with session_scope(factory()) as session:
        outcome = webhooks.deliver(session, uuid.UUID(delivery_id), settings())
    if outcome.done:
        return "done"
    _dispatcher().deliver_webhook(delivery_id, countdown=outcome.retry_in)
    return f"retry in {outcome.retry_in:g} s"


# -- MLflow -----------------------------------------------------------------------------------


@shared_task(name=LOG_MLFLOW, bind=True)
def log_mlflow(self, job_id: str) -> str:
    """One try of logging a finished job to MLflow (``zoopick.service.tracking.attempt``); a
    failed try sends the next one with a doubled countdown, up to ``mlflow_max_attempts``."""
    result = tracking.attempt(factory(), uuid.UUID(job_id), settings())
    if result.retry_in is not None:
        _dispatcher().log_mlflow(job_id, countdown=result.retry_in)
        return f"retry in {result.retry_in:g} s"
    if result.logged is not None:
        return f"logged as run {result.logged.run_id}"
    return result.outcome


# -- model export -----------------------------------------------------------------------------


@shared_task(name=EXPORT_MODEL, bind=True)
def export_model(self, job_id: str, fmt: str) -> str:
    """The job's fine-tuned model as ``fmt`` (``timm`` or ``onnx``), made from the store's
    model, kept in the store beside it and recorded as an artefact; a failure is written where
    the API reads it (``service.exports.record_failure``: in words that name no server path,
    and saying whether the stored model file is damaged, which is the server's fault and not
    the request's). A store still unavailable after :func:`storage.retrying` records no
    failure: the export is settled and the client's next request sends it again."""
    from zoopick.selection.zoo import ZooError

    jid = uuid.UUID(job_id)
    cfg = settings()
    files = storage.open_store(cfg.storage_url)
    try:
        with session_scope(factory()) as session:
            job = session.get(Job, jid)
            model = exports.artefact(session, job, "safetensors", files) if job else None
            if model is None or fmt not in exports.FORMATS[1:]:
                return "no model"
            marks = exports.Markers.of(files, model)
            if exports.artefact(session, job, fmt, files) is not None:
                marks.settle(fmt)  # a request sent it again meanwhile
                return "exported"
            row = session.get(ZooModel, job.chosen_model)
            dataset = session.get(Dataset, job.dataset_id) if job.dataset_id else None
            entry = zoo_catalog.to_entry(row) if row is not None else None
            classes = list(dataset.classes or []) if dataset is not None else []
            session.expunge(model)
            session.expunge(job)
    except storage.StoreUnavailable as exc:  # its marker expires (PENDING_SECONDS)
        log.error("export of job %s as %s: %s", job_id, fmt, exc)
        return "store unavailable"
    scratch = exports.anchor(model, cfg.storage_dir)  # made here, then moved to the store
    folder = exports.export_dir(scratch)
    folder.mkdir(parents=True, exist_ok=True)
    weights = str(scratch)
    try:
        try:
            if entry is None:
                raise ValueError(f"zoo model {job.chosen_model!r} is no longer in the zoo")
            if not classes:
                raise ValueError("the job's dataset was deleted: its class names are unknown")
            # the trainer's file on this machine: in place, or a copy of the store's object
            local = exports.local_file(files, model)
            if local is None:
                copy = folder / exports.STORED_NAME["safetensors"]
                local = storage.retrying(lambda: files.get_to_file(model.path, copy))
            weights = str(local)
            out = _export(entry, weights, classes, fmt, folder)
        except storage.StoreUnavailable as exc:  # the server's trouble for a while: no
            log.error("export of job %s as %s: %s", job_id, fmt, exc)  # failure recorded
            return "store unavailable"
        except ZooError as exc:  # the trainer's file cannot be read: the server's fault
            log.exception(
                "export of job %s as %s: its model file %s is damaged", job_id, fmt, weights
            )
            marks.record_failure(fmt, exports.MODEL_FILE_DAMAGED, _unreadable(exc), weights)
            return "failed"
        except Exception as exc:  # noqa: BLE001 - the reason is the API's answer to the user
            log.exception("export of job %s as %s failed", job_id, fmt)
            # the log keeps the text as it is; the tenant's copy names no server path
            text = f"{type(exc).__name__}: {exc}".replace(weights, str(scratch))
            marks.record_failure(fmt, exports.EXPORT_FAILED, text, scratch)
            return "failed"
        try:
            kept = storage.retrying(lambda: exports.keep(files, job, fmt, out))
        except storage.StoreUnavailable as exc:  # the next request sends it again
            log.error("export of job %s as %s: %s", job_id, fmt, exc)
            return "store unavailable"
        with session_scope(factory()) as session:
            pipeline.add_artefact(session, jid, exports.KIND[fmt], kept.key, kept.sha256, kept.size)
        return "exported"
    finally:  # after the outcome is where the API reads it
        with contextlib.suppress(storage.StoreUnavailable):  # else it expires
            marks.settle(fmt)


def _unreadable(exc: BaseException) -> str:
    """Why the trainer's file could not be read, for the tenant: the reader's own words (a
    ``ZooError`` wraps them with the file's path) after the file's neutral name."""
    from zoopick.service.exports import MODEL_FILE

    cause = exc.__cause__ or exc
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    why = lines[0] if lines else type(cause).__name__
    return f"{MODEL_FILE} cannot be read ({why})"


def _export(entry: Any, weights: str, classes: list[str], fmt: str, folder: Path) -> Path:
    from zoopick.training import export

    model = export.load_finetuned(entry.arch, weights, len(classes))
    data_config = entry.data_config(model)
    if fmt == "onnx":
        return export.onnx_file(model, data_config, folder / "model.onnx")
    export.timm_folder(model, data_config, classes, folder / export.TIMM_FOLDER)
    return export.tar_folder(folder / export.TIMM_FOLDER, folder / "timm.tar")
