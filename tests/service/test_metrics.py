"""``GET /metrics``: who may scrape it, and what it says, parsed with prometheus_client's own
text parser and checked against plain counts of the same rows."""

from __future__ import annotations

import uuid
from collections import defaultdict
from datetime import timedelta

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from zoopick.service.db.models import Job, JobStatus, Score, TrainingRun, WorkerHeartbeat
from zoopick.service.db.session import session_scope
from zoopick.service.db.types import utcnow
from zoopick.service.metrics import SCORING_BUCKETS, TRAINING_BUCKETS
from zoopick.service.security import get_or_create_tenant


def scrape(client, tenant) -> dict:
    resp = client.get("/metrics", headers=tenant.headers)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def samples(family, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == name}


def test_only_an_admin_key_may_scrape(client, alice):
    assert client.get("/metrics").status_code == 401
    resp = client.get("/metrics", headers=alice.headers)
    assert resp.status_code == 403 and "admin" in resp.json()["detail"]


def _seed(factory) -> tuple[uuid.UUID, str]:
    """A job in training with two scored models, a finished run and a live worker."""
    now = utcnow()
    worker = f"metrics-test@{uuid.uuid4().hex[:6]}/1"
    with session_scope(factory) as session:
        tenant = get_or_create_tenant(session, "metrics")
        job = Job(
            tenant_id=tenant.id,
            request={},
            models=["a", "b"],
            metrics=["sms", "logme"],
            select_by="sms",
            status=JobStatus.training.value,
        )
        session.add(job)
        session.flush()
        for model, metric, seconds, forward in [
            ("a", "sms", 0.2, 0.3),
            ("a", "logme", 0.1, 0.3),
            ("b", "sms", 40.0, 7.0),
            ("b", "logme", 1.0, 7.0),
        ]:
            session.add(
                Score(
                    job_id=job.id,
                    model_id=model,
                    metric=metric,
                    value=1.0,
                    seconds=seconds,
                    forward_seconds=forward,
                )
            )
        session.add(
            TrainingRun(
                job_id=job.id,
                model_id="a",
                config={},
                world_size=1,
                output_dir="/nowhere",
                started_at=now - timedelta(seconds=75),
                finished_at=now,
            )
        )
        session.add(WorkerHeartbeat(name=worker, hostname="metrics-test", pid=1, queues="cpu,gpu"))
        return job.id, worker


def _plain_histogram(durations: list[float], buckets) -> dict[str, float]:
    counts = {str(float(b)): float(sum(d <= b for d in durations)) for b in buckets}
    counts["+Inf"] = float(len(durations))
    return counts


def test_scrape_reports_jobs_queues_workers_durations_and_latency(client, admin, service_app):
    factory = service_app.state.sessionmaker
    _, worker = _seed(factory)
    # a request on a templated route with a random id: the raw path must not become a label
    random_id = str(uuid.uuid4())
    assert client.get(f"/api/v1/jobs/{random_id}", headers=admin.headers).status_code == 404
    client.get(f"/no/such/page/{random_id}")

    families = scrape(client, admin)

    # what a plain reading of the same tables says
    with factory() as session:
        statuses = session.scalars(select(Job.status)).all()
        per_model: dict[tuple, list[tuple[float, float | None]]] = defaultdict(list)
        for s in session.scalars(select(Score)):
            per_model[(s.job_id, s.model_id)].append((s.seconds, s.forward_seconds))
        runs = session.execute(
            select(TrainingRun.started_at, TrainingRun.finished_at).where(
                TrainingRun.finished_at.is_not(None)
            )
        ).all()
    jobs = samples(families["zoopick_jobs"], "zoopick_jobs")
    for state in JobStatus:
        assert jobs[(("state", state.value),)] == statuses.count(state.value)
    assert jobs[(("state", "training"),)] >= 1

    scoring = [
        sum(sec for sec, _ in rows) + max((f or 0.0) for _, f in rows)
        for rows in per_model.values()
    ]
    family = families["zoopick_scoring_duration_seconds"]
    buckets = samples(family, "zoopick_scoring_duration_seconds_bucket")
    got = {k[0][1]: v for k, v in buckets.items()}
    assert got == _plain_histogram(scoring, SCORING_BUCKETS)
    total = samples(family, "zoopick_scoring_duration_seconds_sum")[()]
    assert abs(total - sum(scoring)) < 1e-6
    assert got["0.5"] < got["60.0"]  # the seeded 0.6 s and 48 s models fall apart

    training = [(end - start).total_seconds() for start, end in runs]
    family = families["zoopick_training_duration_seconds"]
    got = {
        k[0][1]: v for k, v in samples(family, "zoopick_training_duration_seconds_bucket").items()
    }
    assert got == _plain_histogram(training, TRAINING_BUCKETS)

    up = samples(families["zoopick_worker_up"], "zoopick_worker_up")
    assert up[(("queues", "cpu,gpu"), ("worker", worker))] == 1.0
    assert samples(families["zoopick_workers_live"], "zoopick_workers_live")[()] >= 1

    assert samples(families["zoopick_broker_up"], "zoopick_broker_up")[()] == 1.0
    depth = samples(families["zoopick_queue_depth"], "zoopick_queue_depth")
    assert set(depth) == {(("queue", "cpu"),), (("queue", "gpu"),), (("queue", "webhooks"),)}
    assert all(v >= 0 for v in depth.values())

    latency = families["zoopick_http_request_duration_seconds"]
    counts = samples(latency, "zoopick_http_request_duration_seconds_count")
    routes = {dict(k)["route"] for k in counts}
    assert counts[(("method", "GET"), ("route", "/api/v1/jobs/{job_id}"), ("status", "4xx"))] >= 1
    assert "<unmatched>" in routes
    assert not any(random_id in r for r in routes)  # bounded label set


def test_metrics_can_be_opened_by_a_setting(service_settings):
    from fastapi.testclient import TestClient

    from zoopick.app.main import create_app

    settings = service_settings.model_copy(update={"metrics_public": True})
    with TestClient(create_app(settings)) as open_client:
        resp = open_client.get("/metrics")
        assert resp.status_code == 200
        names = {f.name for f in text_string_to_metric_families(resp.text)}
        assert {"zoopick_jobs", "zoopick_queue_depth", "zoopick_worker_up"} <= names
