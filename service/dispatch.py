"""Sending work to the Celery workers: dataset validation and a job's canvas.

A job is ``chord(group(score(job, m) for m in models), select(job) [-> finetune(job)])``. A job
that races its shortlist (``selection``) has no fine-tune in its canvas: the select task opens
the race and sends the first rung's tasks (:meth:`Dispatcher.race_steps`), each rung's last
task sends the next rung's, and the last rung sends the fine-tune (:meth:`Dispatcher.finetune`)
once a winner is known. Task
ids are derived from the job id, so the API can revoke a job's queued tasks without having kept
any Celery state. Tasks are sent by name: the API never imports task code (or torch).
"""

from __future__ import annotations

import logging
from functools import cached_property

from celery import Celery, chain, chord, group
from celery.canvas import Signature

from zoopick.service.db.models import Job, JobStatus
from zoopick.service.queue import (
    DELIVER_WEBHOOK,
    EXPORT_MODEL,
    FINETUNE,
    LOG_MLFLOW,
    RACE_STEP,
    SCORE,
    SELECT,
    VALIDATE,
    WORKFLOW_FAILED,
    make_celery,
)
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)


def task_prefix(job: Job, attempt: int = 0) -> str:
    """Task ids start with the job id; a re-queued job (attempt n) gets fresh ones."""
    return f"{job.id}-r{attempt}" if attempt else str(job.id)


def job_task_ids(job: Job, attempt: int = 0) -> list[str]:
    pre = task_prefix(job, attempt)
    ids = [f"{pre}-score-{i}" for i in range(len(job.models))] + [f"{pre}-select"]
    if job.finetune and not job.selection:  # a race sends its fine-tune itself
        ids.append(f"{pre}-finetune")
    return ids


SENDER_RESULT_RETRY = {
    "max_retries": 2,
    "interval_start": 0,
    "interval_step": 0.5,
    "interval_max": 1,
}
"""The result store's reconnection policy in a process that sends tasks (about 1 s in all)."""


class Dispatcher:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @cached_property
    def celery(self) -> Celery:
        """Built on first use, never at import (the embedded broker's folders are made
        then)."""
        self.settings.ensure_dirs()
        app = make_celery(self.settings)
        # a sender never reads results (nor subscribes to them: result_backend.py); during a
        # Redis outage Celery's default policy retries a result-backend call for ~20 s,
        # holding the request (an API answer) that long before its 503: fail fast
        opts = dict(app.conf.result_backend_transport_options or {})
        opts["retry_policy"] = SENDER_RESULT_RETRY
        app.conf.result_backend_transport_options = opts
        return app

    def _sig(self, name: str, *args: str, task_id: str | None = None) -> Signature:
        sig = self.celery.signature(name, args=args, immutable=True)
        return sig.set(task_id=task_id) if task_id else sig

    def validate_dataset(self, dataset_id: str) -> None:
        self._sig(VALIDATE, dataset_id).apply_async()

    def workflow(self, job: Job, attempt: int = 0) -> Signature:
        jid, pre = str(job.id), task_prefix(job, attempt)
        ids = job_task_ids(job, attempt)
        header = group(
            self._sig(SCORE, jid, model, task_id=ids[i]) for i, model in enumerate(job.models)
        )
        body: Signature = self._sig(SELECT, jid, task_id=f"{pre}-select")
        if job.finetune and not job.selection:
            body = chain(body, self._sig(FINETUNE, jid, task_id=f"{pre}-finetune"))
        workflow = chord(header, body)
        # a crashed or timed-out task never reaches its own error handling: settle the job here
        workflow.link_error(self._sig(WORKFLOW_FAILED, jid))
        return workflow

    def submit_job(self, job: Job) -> list[str]:
        self.workflow(job).apply_async()
        return job_task_ids(job)

    def race_steps(
        self, job: Job, rung: int, models: list[str] | tuple[str, ...], attempt: int = 0
    ) -> list[str]:
        """One task per candidate of a rung (gpu queue: they run in parallel on as many
        workers as there are); returns their ids."""
        jid, pre = str(job.id), task_prefix(job, attempt)
        shortlist = list((job.race or {}).get("shortlist", []))
        ids = []
        for model in models:
            place = shortlist.index(model) if model in shortlist else len(ids)
            task_id = f"{pre}-race-{rung}-{place}"
            sig = self._sig(RACE_STEP, jid, model, str(rung), task_id=task_id)
            sig.link_error(self._sig(WORKFLOW_FAILED, jid))
            sig.apply_async()
            ids.append(task_id)
        return ids

    def finetune(self, job: Job, attempt: int = 0) -> list[str]:
        """The fine-tune of a job whose race picked its model."""
        jid, pre = str(job.id), task_prefix(job, attempt)
        sig = self._sig(FINETUNE, jid, task_id=f"{pre}-finetune")
        sig.link_error(self._sig(WORKFLOW_FAILED, jid))
        sig.apply_async()
        return [f"{pre}-finetune"]

    def requeue(self, job: Job, attempt: int, racing: list[tuple[str, int]] = ()) -> list[str]:
        """Send a lost job's remaining work again, under fresh task ids; returns them.

        A job lost in training gets its fine-tuning task again (which resumes the run from its
        last checkpoint); one lost before gets its whole canvas again (scoring tasks skip the
        models already scored, so only the missing ones are computed).
        A racing job gets the tasks of its current rung's unsettled candidates (``racing``:
        (model, rung) pairs; each resumes its candidate's checkpoint).
        """
        if job.status == JobStatus.training.value:
            return self.finetune(job, attempt)
        if job.status == JobStatus.racing.value:
            ids: list[str] = []
            for model, rung in racing:
                ids += self.race_steps(job, rung, [model], attempt)
            return ids
        self.workflow(job, attempt).apply_async()
        return job_task_ids(job, attempt)

    def deliver_webhook(self, delivery_id: str, countdown: float | None = None) -> None:
        """Send (or, after ``countdown`` seconds, retry) one webhook delivery
        (``zoopick.service.webhooks``)."""
        self._sig(DELIVER_WEBHOOK, delivery_id).apply_async(countdown=countdown)

    def log_mlflow(self, job_id: str, countdown: float | None = None) -> None:
        """Log (or, after ``countdown`` seconds, try again to log) a finished job to MLflow
        (``zoopick.service.tracking``)."""
        self._sig(LOG_MLFLOW, job_id).apply_async(countdown=countdown)

    def export_model(self, job_id: str, fmt: str) -> None:
        """Make the job's model in ``fmt`` (``zoopick.service.exports``); a second request
        while one runs finds the file made, or makes it again (atomically)."""
        self._sig(EXPORT_MODEL, job_id, fmt).apply_async()

    def revoke(self, task_ids: list[str]) -> None:
        """Drop tasks still queued (never terminate running ones: they stop cooperatively).
        Best effort: a worker that is down misses the broadcast, which is why every task also
        checks the job's state before doing anything."""
        if not task_ids:
            return
        try:
            self.celery.control.revoke(task_ids)
        except Exception:  # noqa: BLE001 - the cancel flag in the database still holds
            log.warning("could not broadcast revoke for %d tasks", len(task_ids), exc_info=True)

    def broker_problem(self) -> str | None:
        """None when the broker answers, else why not."""
        try:
            with self.celery.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1, timeout=2)
        except Exception as exc:  # noqa: BLE001
            return f"broker unreachable: {exc}"
        return None
