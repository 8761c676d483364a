"""MLflow (``zoopick[mlflow]``, ``zoopick.service.tracking``): with
``ZOOPICK_MLFLOW_TRACKING_URI`` set, a finished job is logged by the worker to a real
``mlflow server`` (127.0.0.1, SQLite store, local artifact folder:
``tests/service/mlflow_server.py``, started with the live stack when this module was
collected) as one run holding its scores, fine-tune curve and model, read back with
``MlflowClient`` and compared with the job's API record; a redelivered logging makes no
second run; a server that is down leaves the job succeeded, with the warning on the job and
its page.

The jobs run on the shared live stack (``conftest.live_server``: uvicorn, a Celery worker,
PostgreSQL, Redis), which logs to that server whenever this module is collected.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.service import mlflow_server, procs
from tests.service.datafiles import npz_bytes
from tests.service.stack import ZOO, Stack

if mlflow_server.missing():
    pytest.skip(mlflow_server.missing(), allow_module_level=True)

EPOCHS = 2
TENANT = f"mlflow-{uuid.uuid4().hex[:6]}"


@dataclass
class MlflowStack:
    http: httpx.Client
    stack: Stack
    uri: str


@pytest.fixture(scope="module")
def mlflow_stack(live_server, request):
    """The shared live stack (its worker logs to the session's MLflow server), seen by a
    tenant of this module."""
    server = mlflow_server.take(request.config)
    assert live_server.settings.mlflow_tracking_uri == server.uri, (
        "the live stack was started without the MLflow server (mlflow_server.wanted)"
    )
    stack = live_server.tenant(TENANT)
    with stack.api() as http:
        yield MlflowStack(http, stack, server.uri)


def _dataset(http) -> str:
    resp = http.post("/datasets", files={"file": ("shades.npz", npz_bytes(seed=5), "x")})
    assert resp.status_code in (201, 202), resp.text
    ds = resp.json()["id"]
    procs.poll(lambda: http.get(f"/datasets/{ds}").json()["status"], lambda s: s == "ready", 60,
               what="the dataset")  # fmt: skip
    return ds


def _finished(http, job_id: str) -> dict:
    """The job once it ended and its MLflow logging settled (logged or given up)."""
    return procs.poll(
        lambda: http.get(f"/jobs/{job_id}").json(),
        lambda j: (
            j["status"] in ("succeeded", "failed", "cancelled")
            and (j.get("mlflow") or {}).get("status") in ("logged", "failed")
        ),
        120,
        what="the job and its MLflow logging",
    )


def _runs(client, job_id: str) -> list:
    experiment = client.get_experiment_by_name("zoopick")
    return client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`zoopick.job_id` = '{job_id}'"
    )


def test_a_finished_job_is_one_mlflow_run_with_its_scores_curve_and_model(mlflow_stack, tmp_path):
    from mlflow import MlflowClient

    from zoopick.service.db.models import Job
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
    from zoopick.service.dispatch import Dispatcher
    from zoopick.service.tracking import key_part

    http, stack = mlflow_stack.http, mlflow_stack.stack
    ds = _dataset(http)
    finetune = {"epochs": EPOCHS, "workers": 1, "compressor": "dense", "lr": 0.01,
                "batch_size": 4}  # fmt: skip
    body = {"dataset_id": ds, "models": [m for m, _ in ZOO], "metrics": ["sms", "logme"],
            "select_by": "logme", "finetune": finetune}  # fmt: skip
    resp = http.post("/jobs", json=body)
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    job = _finished(http, job_id)
    assert job["status"] == "succeeded", (job, stack.logs())
    assert job["mlflow"]["status"] == "logged", (job["mlflow"], stack.logs())

    client = MlflowClient(mlflow_stack.uri)
    [run] = _runs(client, job_id)
    run_id = run.info.run_id
    assert job["mlflow"]["run_id"] == run_id and job["mlflow"]["attempts"] == 1
    assert job["mlflow"]["url"] == (
        f"{mlflow_stack.uri}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    )
    assert run.info.run_name == job_id and run.info.status == "FINISHED"
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    assert tags["zoopick.tenant"] == TENANT and tags["mlflow.user"] == TENANT
    assert run.info.user_id == TENANT  # MLflow's User column, not only a tag
    assert tags["zoopick.dataset_id"] == ds and tags["zoopick.dataset_name"] == "shades.npz"
    assert tags["zoopick.status"] == "succeeded" and tags["zoopick.version"]
    assert tags["zoopick.chosen_model"] == job["chosen_model"]
    assert params["metrics"] == "sms,logme" and params["select_by"] == "logme"
    assert params["finetune.epochs"] == str(EPOCHS) and params["finetune.lr"] == "0.01"
    assert params["finetune.compressor"] == "dense" and params["finetune.batch_size"] == "4"
    [dataset] = run.inputs.dataset_inputs
    assert dataset.dataset.name == "shades.npz"

    # the ranking: every model's score per metric, its rank, the chosen model's scores
    assert len(job["ranking"]) == len(ZOO)
    for row in job["ranking"]:
        model = key_part(row["model"])
        assert metrics[f"rank/{model}"] == row["rank"]
        for metric, value in row["scores"].items():
            assert metrics[f"score/{metric}/{model}"] == value, (metric, model)
            if row["model"] == job["chosen_model"]:
                assert metrics[f"chosen/{metric}"] == value

    # the fine-tune curve: one point per epoch, step = epoch, the API's values
    epochs = job["training"]["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1))
    for key, field in (("train_loss", "loss"), ("train_accuracy", "train_accuracy"),
                       ("test_accuracy", "test_accuracy")):  # fmt: skip
        if epochs[0][field] is None:
            continue
        history = client.get_metric_history(run_id, key)
        assert [(m.step, m.value) for m in history] == [(e["epoch"], e[field]) for e in epochs]
    assert len(client.get_metric_history(run_id, "train_loss")) == EPOCHS
    # the sub-epoch points, at the optimizer step they were taken
    progress = job["training"]["progress"]
    assert progress["points"] and progress["steps"]
    steps = client.get_metric_history(run_id, "step/train_loss")
    expected = {round(p["x"] * progress["steps"]): p["loss"] for p in progress["points"]}
    assert {m.step: m.value for m in steps} == expected

    # the model: the file the API serves, and its config
    assert {a.path for a in client.list_artifacts(run_id, "model")} == {
        "model/model.safetensors",
        "model/model.json",
    }
    local = Path(client.download_artifacts(run_id, "model/model.safetensors", str(tmp_path)))
    served = http.get(f"/jobs/{job_id}/model")
    assert served.status_code == 200
    assert hashlib.sha256(local.read_bytes()).digest() == hashlib.sha256(served.content).digest()
    ranking = client.download_artifacts(run_id, "zoopick/ranking.json", str(tmp_path))
    assert job["chosen_model"] in Path(ranking).read_text()

    # the job's page links the run
    with procs.dashboard_client(stack.url, stack.key) as page:
        html = page.get(f"/jobs/{job_id}").text
    assert f'href="{job["mlflow"]["url"]}"' in html

    # a redelivered logging (the job's is settled) does nothing; one whose try died after
    # writing part of the run (left RUNNING) completes that run, with no second run and no
    # point twice
    dispatcher = Dispatcher(stack.settings)
    dispatcher.log_mlflow(job_id)
    client.update_run(run_id, status="RUNNING")
    engine = make_engine(stack.settings.database_url)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            row = session.get(Job, uuid.UUID(job_id))
            row.mlflow = {**row.mlflow, "status": "pending"}
    finally:
        engine.dispose()
    dispatcher.log_mlflow(job_id)
    again = procs.poll(lambda: http.get(f"/jobs/{job_id}").json()["mlflow"],
                       lambda m: m["status"] == "logged" and m["attempts"] == 2, 60,
                       what="the second logging")  # fmt: skip
    assert again["run_id"] == run_id
    [run] = _runs(client, job_id)
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run_id, "train_loss")) == EPOCHS


def _queued(dispatcher) -> int:
    with dispatcher.celery.connection_for_read() as conn:
        return conn.default_channel.queue_declare(queue="cpu", durable=True).message_count


def test_a_tracking_server_that_is_down_leaves_the_job_succeeded_with_a_warning(
    service_app, service_settings, client, make_key, caplog
):
    """The worker's two tries (``tracking.attempt``, all the ``zoopick.log_mlflow`` task
    does) against a port nothing listens on; the job ends marked, its task queued."""
    from tests.service.test_dashboard import sign_in
    from zoopick.service import pipeline, tracking
    from zoopick.service.db.models import Job, JobStatus
    from zoopick.service.db.session import session_scope
    from zoopick.service.dispatch import Dispatcher
    from zoopick.service.outbox import DISPATCHER_KEY
    from zoopick.service.security import get_or_create_tenant

    down = service_settings.model_copy(
        update={"mlflow_tracking_uri": f"http://127.0.0.1:{procs.free_port()}",
                "mlflow_max_attempts": 2, "mlflow_backoff_seconds": 0.5}
    )  # fmt: skip
    dispatcher = Dispatcher(down)  # the broker of service_settings, where no worker consumes
    owner = make_key(f"mlflow-down-{uuid.uuid4().hex[:6]}")
    factory = service_app.state.sessionmaker
    before = _queued(dispatcher)
    with session_scope(factory) as session:
        session.info[DISPATCHER_KEY] = dispatcher  # this deployment's settings
        tenant = get_or_create_tenant(session, owner.name)
        job = Job(tenant_id=tenant.id, request={}, models=["tiny-resnet"], metrics=["sms"],
                  select_by="sms")  # fmt: skip
        session.add(job)
        session.flush()
        jid = job.id
        assert pipeline.transition(session, jid, JobStatus.scoring)
        pipeline.upsert_scores(session, jid, "tiny-resnet", {"sms": 0.5}, {"sms": 0.1})
        assert pipeline.transition(session, jid, JobStatus.succeeded, chosen_model="tiny-resnet")
    assert _queued(dispatcher) == before + 1  # zoopick.log_mlflow, sent once it committed

    with caplog.at_level(logging.WARNING, logger="zoopick.service.tracking"):
        first = tracking.attempt(factory, jid, down)
        second = tracking.attempt(factory, jid, down)
    assert first.outcome == "retry" and first.retry_in == 0.5
    assert second.outcome == "failed" and second.retry_in is None
    assert tracking.attempt(factory, jid, down).outcome == "skipped"  # given up: no third
    assert f"could not log job {jid} to MLflow" in caplog.text

    job = client.get(f"/api/v1/jobs/{jid}", headers=owner.headers).json()
    assert job["status"] == "succeeded" and job["error"] is None, job
    assert job["mlflow"]["status"] == "failed" and job["mlflow"]["attempts"] == 2
    assert job["mlflow"]["error"] == (
        f"the MLflow tracking server at {down.mlflow_tracking_uri} did not answer "
        "(connection refused)"
    )
    assert job["mlflow"]["run_id"] is None
    html = sign_in(service_app, owner.token).get(f"/jobs/{jid}").text
    part = html[html.index('id="mlflow-run"') :]
    assert "not logged (2 tries)" in part and "connection refused" in part


def test_metric_keys_are_ones_mlflow_accepts_and_never_shared():
    from mlflow.utils.validation import _validate_metric_name

    from zoopick.service.tracking import key_part

    names = ["tiny-resnet", "timm/vit_base.augreg_in21k", "timm_vit_base.augreg_in21k", "a:b",
             "a b", "..", ".", "", "ü-net", "x" * 300, "x" * 301]  # fmt: skip
    keys = [f"score/sms/{key_part(n)}" for n in names]
    for key in keys:
        _validate_metric_name(key)  # MLflow's own check (raises)
    assert len(set(keys)) == len(names)
    assert key_part("tiny-resnet") == "tiny-resnet"  # safe names are kept as they are


def test_the_uri_is_refused_without_the_extra(monkeypatch, tmp_path):
    import importlib.util

    from pydantic import ValidationError

    from zoopick.service.settings import Settings

    assert Settings(data_dir=tmp_path, mlflow_tracking_uri=" ").mlflow_tracking_uri is None
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ValidationError, match=r"pip install 'zoopick\[mlflow\]'"):
        Settings(data_dir=tmp_path, mlflow_tracking_uri="http://mlflow.example:5000")


def test_a_cancelled_job_ends_its_run_killed(service_app, service_settings):
    """What a job that never scored a model logs (no curve, no model): KILLED."""
    from zoopick.service import tracking
    from zoopick.service.db.models import Job, JobStatus
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import get_or_create_tenant

    with session_scope(service_app.state.sessionmaker) as session:
        tenant = get_or_create_tenant(session, f"mlflow-{uuid.uuid4().hex[:6]}")
        job = Job(tenant_id=tenant.id, request={}, models=["a", "b/c"], metrics=["sms"],
                  select_by="sms", status=JobStatus.cancelled.value)  # fmt: skip
        session.add(job)
        session.flush()
        record = tracking.build(session, job, service_settings)
    assert record.status == "KILLED" and record.tags["zoopick.status"] == "cancelled"
    assert record.params["models"] == "a,b/c" and record.metrics == []
    assert record.artifacts == [] and record.dataset is None
    assert record.tags["zoopick.tenant"] == tenant.name


def test_the_sweep_resends_loggings_left_pending(service_app, service_settings):
    """A logging whose task was lost (broker down at the commit, a worker killed mid-try) is
    sent again by the recovery sweep, once per period; one still within its time is not."""
    from datetime import timedelta

    from zoopick.service import tracking
    from zoopick.service.db.models import Job, JobStatus
    from zoopick.service.db.session import session_scope
    from zoopick.service.db.types import utcnow
    from zoopick.service.security import get_or_create_tenant

    settings = service_settings.model_copy(update={"mlflow_tracking_uri": "http://127.0.0.1:9"})
    factory, dispatcher = service_app.state.sessionmaker, service_app.state.dispatcher
    old = utcnow() - timedelta(seconds=tracking.stale_after(settings) + 5)
    with session_scope(factory) as session:
        tenant = get_or_create_tenant(session, f"mlflow-{uuid.uuid4().hex[:6]}")
        jobs = {}
        for name, state, when in (("lost", "logging", old), ("fresh", "pending", utcnow()),
                                  ("done", "logged", old)):  # fmt: skip
            jobs[name] = Job(tenant_id=tenant.id, request={}, models=["a"], metrics=["sms"],
                             select_by="sms", status=JobStatus.succeeded.value,
                             mlflow={"status": state, "attempts": 1}, updated_at=when)  # fmt: skip
            session.add(jobs[name])
    assert tracking.resend_stale(factory, dispatcher, service_settings) == []  # not configured
    assert tracking.resend_stale(factory, dispatcher, settings) == [str(jobs["lost"].id)]
    with factory() as session:
        lost = session.get(Job, jobs["lost"].id)
        assert lost.mlflow["status"] == "pending" and lost.updated_at > old  # touched
    assert tracking.resend_stale(factory, dispatcher, settings) == []  # once per period


def test_messages_and_links_never_show_credentials():
    from zoopick.service.tracking_client import public_uri, run_url

    assert public_uri("https://ci:s3cret@mlflow.example:5000/p") == "https://mlflow.example:5000/p"
    assert public_uri("http://u:p@[::1]:5000") == "http://[::1]:5000"
    assert public_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert run_url("https://t@mlflow.example/", "3", "abc") == (
        "https://mlflow.example/#/experiments/3/runs/abc"
    )
    assert run_url("databricks", "3", "abc") is None
