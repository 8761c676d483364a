"""Polling a finished job with a race and a fine-tune (issue 42): the view a client polls most
once its job is done. Built from real rows (``benchmarks/load/finetuned.py``: what a 40-epoch
fine-tune after a two-rung race leaves) on PostgreSQL.

The view reads the run, its epochs, the race's entries and the scores in one statement each;
once nothing under the job can change (``app.api.settled``), a poll answers the JSON it
answered before after the one statement that authenticates and reads the job, and a change to
the job's row (its MLflow logging, here) shows at the next poll."""

from __future__ import annotations

import threading
import uuid

import pytest
from sqlalchemy import event, update

from benchmarks.load import finetuned
from zoopick.service.db.models import Job, TrainingRun
from zoopick.service.db.session import session_scope
from zoopick.service.recovery import SWEEPER_THREAD


@pytest.fixture
def statements(service_app):
    """The SQL statements the app's engine runs for the test's requests: the in-process
    sweeper's (its own thread, on a timer) are not the poll's and are left out."""
    seen: list[str] = []

    def record(*args) -> None:
        if threading.current_thread().name != SWEEPER_THREAD:
            seen.append(args[2])

    event.listen(service_app.state.engine, "before_cursor_execute", record)
    yield seen
    event.remove(service_app.state.engine, "before_cursor_execute", record)


def finished_job(service_app, tenant_name: str) -> uuid.UUID:
    from zoopick.service.security import get_or_create_tenant

    tag = uuid.uuid4().hex[:6]
    models = [f"poll-{tag}-{i}" for i in range(6)]
    with session_scope(service_app.state.sessionmaker) as session:
        tenant = get_or_create_tenant(session, tenant_name)
        dataset_id = finetuned.zoo_and_dataset(session, tenant.id, models, num_classes=2)
        return finetuned.build(session, tenant.id, dataset_id, models)


def test_a_finished_jobs_view_is_built_once_and_follows_its_row(
    client, service_app, make_key, statements
):
    who = make_key(f"poller-{uuid.uuid4().hex[:6]}")
    job_id = finished_job(service_app, who.name)
    url = f"/api/v1/jobs/{job_id}"

    first = client.get(url, headers=who.headers)
    assert first.status_code == 200, first.text
    body = first.json()
    training, race = body["training"], body["race"]
    assert len(training["epochs"]) == finetuned.EPOCHS
    assert [e["epoch"] for e in training["epochs"]] == list(range(1, finetuned.EPOCHS + 1))
    assert training["epochs"][0]["iterations"] == finetuned.STEPS_PER_EPOCH  # an integer
    assert training["epochs"][0]["dense_bytes"] == 4.0e6
    assert training["progress"]["phase"] == "finished"
    assert [len(r["entries"]) for r in race["rungs"]] == [3, 1]
    held = {e["model"]: e["steps"] for r in race["rungs"] for e in r["entries"]}  # the last
    assert race["spent_steps"] == sum(held.values())  # from the same rows as the rungs
    assert [r["rank"] for r in body["ranking"]] == [1, 2, 3, 4, 5, 6]

    statements.clear()
    again = client.get(url, headers=who.headers)
    assert again.status_code == 200
    assert again.content == first.content
    # the key with the job, and nothing of the run, epochs, race or scores
    assert len(statements) == 1, statements

    with session_scope(service_app.state.sessionmaker) as session:
        session.execute(update(Job).where(Job.id == job_id).values(mlflow={"status": "logged"}))
    statements.clear()
    logged = client.get(url, headers=who.headers).json()
    assert logged["mlflow"]["status"] == "logged"
    assert len(statements) == 5, statements  # built again: the run, epochs, race, scores
    assert {k: v for k, v in logged.items() if k not in ("mlflow", "updated_at")} == {
        k: v for k, v in body.items() if k not in ("mlflow", "updated_at")
    }


def test_a_view_that_can_still_change_is_built_at_every_poll(
    client, service_app, make_key, statements
):
    who = make_key(f"poller-{uuid.uuid4().hex[:6]}")
    job_id = finished_job(service_app, who.name)
    with session_scope(service_app.state.sessionmaker) as session:  # its run not yet closed
        session.execute(
            update(TrainingRun)
            .where(TrainingRun.job_id == job_id)
            .values(status="running", finished_at=None)
        )
    url = f"/api/v1/jobs/{job_id}"
    assert client.get(url, headers=who.headers).json()["training"]["status"] == "running"
    with session_scope(service_app.state.sessionmaker) as session:  # closed by the task
        session.execute(
            update(TrainingRun).where(TrainingRun.job_id == job_id).values(status="succeeded")
        )
    statements.clear()
    assert client.get(url, headers=who.headers).json()["training"]["status"] == "succeeded"
    assert len(statements) == 5, statements
