"""The REST API against PostgreSQL and Redis (no worker consumes here: jobs stay queued).

Auth, problem details, tenant isolation on every endpoint, zoo registration, job submission
rules, idempotency, cancellation of a queued job and pagination. Upload tests are in
``test_uploads.py``.
"""

from __future__ import annotations

import re
import uuid

import pytest
import redis

from zoopick.service.db.models import Dataset, Job
from zoopick.service.db.session import session_scope
from zoopick.service.security import get_or_create_tenant

PROBLEM = "application/problem+json"
API = "/api/v1"


def assert_problem(resp, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith(PROBLEM)
    body = resp.json()
    assert {"type", "title", "status", "detail"} <= set(body)
    assert body["status"] == status
    for needle in needles:
        assert needle in body["detail"], body["detail"]
    return body


@pytest.fixture(scope="module")
def zoo(client, admin):
    """Two random-weight models registered through the API."""
    for mid, arch in (("tiny-resnet", "test_resnet"), ("tiny-vit", "test_vit")):
        resp = client.post(
            f"{API}/zoo",
            json={
                "id": mid,
                "arch": arch,
                "weights": "none",
                "num_classes": 10,
                "input_size": [3, 32, 32],
                "tags": ["test"],
            },
            headers=admin.headers,
        )
        assert resp.status_code in (201, 409), resp.text
    return ["tiny-resnet", "tiny-vit"]


def ready_dataset(app, tenant: str, status: str = "ready", error: str | None = None) -> str:
    """A dataset row as validation leaves it (the upload path is tested separately)."""
    with session_scope(app.state.sessionmaker) as session:
        owner = get_or_create_tenant(session, tenant)
        ds = Dataset(
            tenant_id=owner.id,
            name="made-in-test",
            format="npz",
            filename="d.npz",
            size_bytes=1,
            file_sha256="0" * 64,
            storage_path="/nonexistent/d.npz",
            status=status,
            error=error,
            classes=["a", "b"],
            counts={"a": 3, "b": 3},
            num_samples=6,
            digest="d" * 16,
        )
        session.add(ds)
        session.flush()
        return str(ds.id)


def submit(client, tenant, dataset_id, **extra):
    body = {"dataset_id": dataset_id, **extra}
    headers = dict(tenant.headers)
    if "key" in extra:
        headers["Idempotency-Key"] = body.pop("key")
    return client.post(f"{API}/jobs", json=body, headers=headers)


# -- health, docs, problems ----------------------------------------------------------------


def test_health_readiness_and_docs(client, service_app):
    from zoopick.service import liveness

    assert client.get("/healthz").json()["status"] == "ok"
    factory = service_app.state.sessionmaker
    liveness.beat(factory, "api-test/1", "api-test", 1, "cpu")  # a worker is running
    try:
        ready = client.get("/readyz")
    finally:
        liveness.forget(factory, "api-test/1")
    assert ready.status_code == 200, ready.text
    checks = ready.json()["checks"]
    assert {k: checks[k] for k in ("database", "broker")} == {"database": "ok", "broker": "ok"}
    assert checks["workers"].startswith("ok")
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {f"{API}/datasets", f"{API}/jobs/{{job_id}}/cancel", f"{API}/zoo"} <= set(paths)
    # any API call may meet a bad key, the failed-authentication limit or a full pool
    undocumented = [
        (method, path, code)
        for path, ops in paths.items()
        if path.startswith(API)
        for method, op in ops.items()
        for code in ("401", "429", "503")
        if code not in op["responses"]
    ]
    assert undocumented == []


def test_readyz_is_not_ready_until_a_worker_has_been_seen(service_settings, new_pg_database):
    """Issue 22: /readyz said 200 while the local worker of ``serve`` did not exist yet."""
    from fastapi.testclient import TestClient

    from zoopick.app.main import create_app
    from zoopick.service import liveness
    from zoopick.service.db import migrate

    url = new_pg_database()
    migrate.upgrade(url)
    with TestClient(create_app(service_settings.model_copy(update={"database_url": url}))) as c:
        body = assert_problem(c.get("/readyz"), 503, "no worker has been seen")
        assert body["checks"]["database"] == "ok" and body["checks"]["broker"] == "ok"
        liveness.beat(c.app.state.sessionmaker, "seen/1", "seen", 1, "cpu,gpu")
        ready = c.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"]["workers"] == "ok (1 live worker(s))"


def test_readyz_names_an_unreachable_broker(service_settings):
    from fastapi.testclient import TestClient

    from zoopick.app.main import create_app

    settings = service_settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    with TestClient(create_app(settings)) as c:
        body = assert_problem(c.get("/readyz"), 503, "broker unreachable")
        assert body["checks"]["database"] == "ok"


def test_unknown_route_and_bad_body_are_problems(client, alice):
    assert_problem(client.get(f"{API}/nothing", headers=alice.headers), 404, "no such endpoint")
    body = assert_problem(
        client.post(f"{API}/jobs", json={"models": 3}, headers=alice.headers), 422, "dataset_id"
    )
    assert body["errors"]
    resp = client.post(
        f"{API}/jobs",
        content=b"{not json",
        headers={**alice.headers, "content-type": "application/json"},
    )
    assert_problem(resp, 422)
    assert_problem(client.get(f"{API}/jobs?page_size=0", headers=alice.headers), 422)
    assert_problem(client.get(f"{API}/jobs?status=done", headers=alice.headers), 422, "status")


# -- auth ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/datasets", "/jobs", "/zoo", f"/jobs/{uuid.UUID(int=1)}", f"/datasets/{uuid.UUID(int=2)}"],
)
def test_missing_or_bad_key_is_401(client, path):
    resp = client.get(API + path)
    assert_problem(resp, 401, "missing API key")
    assert resp.headers["www-authenticate"] == "Bearer"
    assert_problem(client.get(API + path, headers={"Authorization": "Bearer zp_wrong"}), 401)
    assert_problem(client.get(API + path, headers={"Authorization": "Basic dXNlcjpwdw=="}), 401)


def test_revoked_key_is_401(client, service_app, make_key):
    from sqlalchemy import update

    from zoopick.service.db.models import ApiKey
    from zoopick.service.db.types import utcnow
    from zoopick.service.security import hash_token

    carol = make_key("carol")
    assert client.get(f"{API}/jobs", headers=carol.headers).status_code == 200
    with session_scope(service_app.state.sessionmaker) as session:
        session.execute(
            update(ApiKey)
            .where(ApiKey.token_hash == hash_token(carol.token))
            .values(revoked_at=utcnow())
        )
    assert_problem(client.get(f"{API}/jobs", headers=carol.headers), 401, "revoked")


def test_only_the_hash_of_a_key_is_stored(service_app, alice):
    from sqlalchemy import select

    from zoopick.service.db.models import ApiKey

    with service_app.state.sessionmaker() as session:
        stored = [tuple(r) for r in session.execute(select(ApiKey.token_hash, ApiKey.prefix))]
    assert all(alice.token not in h for h, _ in stored)
    assert any(alice.token.startswith(p) for _, p in stored)


# -- zoo -------------------------------------------------------------------------------------


def test_zoo_registration_rules(client, admin, alice, zoo):
    good = {"id": "x-model", "arch": "test_resnet", "weights": "none", "num_classes": 10}
    assert_problem(client.post(f"{API}/zoo", json=good, headers=alice.headers), 403, "admin")
    dup = {**good, "id": "tiny-resnet"}
    assert_problem(client.post(f"{API}/zoo", json=dup, headers=admin.headers), 409, "exists")
    bad_arch = {**good, "arch": "no_such_net"}
    assert_problem(
        client.post(f"{API}/zoo", json=bad_arch, headers=admin.headers), 422, "no_such_net"
    )
    rel = {**good, "weights": "ckpt/m.safetensors"}
    assert_problem(client.post(f"{API}/zoo", json=rel, headers=admin.headers), 422, "absolute")
    listed = client.get(f"{API}/zoo", headers=alice.headers).json()["items"]
    assert {"tiny-resnet", "tiny-vit"} <= {m["id"] for m in listed}
    one = client.get(f"{API}/zoo/tiny-vit", headers=alice.headers).json()
    assert one["overrides"] == {"input_size": [3, 32, 32]}
    assert_problem(client.get(f"{API}/zoo/nope", headers=alice.headers), 404)


# -- jobs ------------------------------------------------------------------------------------


def test_submit_job_is_queued_on_the_broker(client, service_app, service_settings, alice, zoo):
    ds = ready_dataset(service_app, "alice")
    resp = submit(client, alice, ds, models=zoo, metrics=["sms", "isms"], select_by="isms")
    assert resp.status_code == 202, resp.text
    job = resp.json()
    assert resp.headers["location"] == f"{API}/jobs/{job['id']}"
    assert int(resp.headers["retry-after"]) >= 1
    assert job["status"] == "queued" and job["progress"] == 0
    assert job["models"] == zoo and job["ranking"] == [] and job["training"] is None

    # the canvas really went to Redis: the scoring tasks wait on the gpu queue
    r = redis.Redis.from_url(service_settings.broker_url)
    assert r.llen(f"{service_settings.redis_key_prefix}gpu") >= len(zoo)
    with service_app.state.sessionmaker() as session:
        row = session.get(Job, uuid.UUID(job["id"]))
        assert row.task_ids == [f"{row.id}-score-0", f"{row.id}-score-1", f"{row.id}-select"]

    shown = client.get(f"{API}/jobs/{job['id']}", headers=alice.headers).json()
    assert shown["id"] == job["id"] and shown["links"]["cancel"].endswith("/cancel")


def test_models_all_and_default_metrics(client, service_app, alice, zoo):
    ds = ready_dataset(service_app, "alice")
    job = submit(client, alice, ds).json()
    assert set(zoo) <= set(job["models"])
    assert job["metrics"] == ["fsms", "logme", "sms", "isms"] and job["select_by"] == "fsms"


@pytest.mark.parametrize(
    ("metrics", "chosen"), [(["knn", "fsms"], "fsms"), (["knn", "logme"], "knn"), (["sms"], "sms")]
)
def test_select_by_defaults_to_fsms_else_the_first_metric(
    client, service_app, alice, zoo, metrics, chosen
):
    """A job naming its metrics but no select_by is ranked by fsms when it asked for it, else
    by its first metric (it used to get 422 for not including the old default)."""
    ds = ready_dataset(service_app, "alice")
    res = submit(client, alice, ds, metrics=metrics)
    assert res.status_code == 202, res.text
    assert res.json()["select_by"] == chosen


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"metrics": ["sms", "nope"]}, 422, "'nope'"),
        ({"models": ["tiny-resnet", "ghost"]}, 422, "'ghost'"),
        ({"models": []}, 422, "at least one"),
        ({"metrics": ["sms"], "select_by": "logme"}, 422, "select_by"),
        ({"finetune": {"epochs": 10_000}}, 422, "epochs"),
        ({"finetune": {"density": 2}}, 422, "density"),
        ({"finetune": {"compressor": "bogus"}}, 422, "unknown comm hook 'bogus'"),
        ({"finetune": {"hook_options": {"tems": 2}}}, 422, "no option(s) 'tems'"),
        ({"finetune": {"compressor": "spardl", "hook_options": {"teams": 0}}}, 422, "teams"),
        ({"bogus": 1}, 422, "bogus"),
    ],
)
def test_bad_submissions_name_the_problem(client, service_app, alice, zoo, body, status, needle):
    ds = ready_dataset(service_app, "alice")
    assert_problem(submit(client, alice, ds, **body), status, needle)


def test_a_refused_finetune_creates_no_job(client, service_app, alice, zoo):
    """A bad hook is refused before anything is stored or queued (it used to be accepted and
    to fail only after every model was scored)."""
    ds = ready_dataset(service_app, "alice")
    before = client.get("/api/v1/jobs", headers=alice.headers).json()["items"]
    assert_problem(submit(client, alice, ds, finetune={"compressor": "bogus"}), 422, "bogus")
    after = client.get("/api/v1/jobs", headers=alice.headers).json()["items"]
    assert [j["id"] for j in after] == [j["id"] for j in before]


def test_unknown_or_unready_dataset(client, service_app, alice, zoo):
    assert_problem(submit(client, alice, str(uuid.uuid4())), 422, "unknown dataset")
    pending = ready_dataset(service_app, "alice", status="validating")
    assert_problem(submit(client, alice, pending), 409, "validating")
    broken = ready_dataset(service_app, "alice", status="invalid", error="class 'x' has no images")
    assert_problem(submit(client, alice, broken), 409, "class 'x' has no images")


def test_idempotency_key_returns_the_same_job(client, service_app, alice, bob, zoo):
    ds = ready_dataset(service_app, "alice")
    first = submit(client, alice, ds, models=zoo, key="k-1")
    again = submit(client, alice, ds, models=zoo, key="k-1")
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert again.headers["location"] == first.headers["location"]
    assert_problem(submit(client, alice, ds, models=zoo[:1], key="k-1"), 422, "Idempotency-Key")
    # the same request with repeats (the job runs each model and metric once) is the same job
    repeats = submit(client, alice, ds, models=[*zoo, *zoo], key="k-1").json()
    assert repeats["id"] == first.json()["id"]
    with_metrics = submit(client, alice, ds, models=zoo, metrics=["logme", "logme"], key="k-m")
    again = submit(client, alice, ds, models=zoo, metrics=["logme"], key="k-m")
    assert again.json()["id"] == with_metrics.json()["id"]
    # naming the select_by the job resolved to when the first body named none: the same job
    named = submit(client, alice, ds, models=zoo, metrics=["logme"], select_by="logme", key="k-m")
    assert named.json()["id"] == with_metrics.json()["id"]
    other = submit(client, alice, ds, models=zoo, key="k-2")
    assert other.json()["id"] != first.json()["id"]
    # keys are per tenant: bob's k-1 is his own job
    ds_b = ready_dataset(service_app, "bob")
    assert submit(client, bob, ds_b, models=zoo, key="k-1").json()["id"] != first.json()["id"]


def test_a_dataset_deleted_while_its_job_is_submitted_is_unknown_not_a_500(
    client, service_app, alice, zoo, monkeypatch
):
    """A deletion that commits after the submission read the dataset and before it inserts
    the job (an outside probe raced DELETE /datasets against POST /jobs: a 500 from the
    foreign key, or a job left on a deleted dataset): the submission reads it again under
    the tenant's lock and answers 422, and no job is made."""
    from zoopick.service import jobs as use_cases

    ds = ready_dataset(service_app, "alice")
    resolve = use_cases._resolve

    def resolve_then_delete(session, tenant_id, body, settings):
        columns = resolve(session, tenant_id, body, settings)
        with session_scope(service_app.state.sessionmaker) as other:  # the other request
            other.delete(other.get(Dataset, uuid.UUID(ds)))
        return columns

    monkeypatch.setattr(use_cases, "_resolve", resolve_then_delete)
    before = client.get(f"{API}/jobs", headers=alice.headers).json()["items"]
    assert_problem(submit(client, alice, ds, models=zoo), 422, "unknown dataset", ds)
    assert client.get(f"{API}/jobs", headers=alice.headers).json()["items"] == before


def test_cancel_a_queued_job(client, service_app, alice, zoo):
    ds = ready_dataset(service_app, "alice")
    job = submit(client, alice, ds, models=zoo).json()
    resp = client.post(f"{API}/jobs/{job['id']}/cancel", headers=alice.headers)
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert body["status"] == "cancelled" and body["cancel_requested"] is True
    assert body["finished_at"] is not None
    assert_problem(
        client.post(f"{API}/jobs/{job['id']}/cancel", headers=alice.headers), 409, "cancelled"
    )
    listed = client.get(f"{API}/jobs?status=cancelled", headers=alice.headers).json()["items"]
    assert job["id"] in {j["id"] for j in listed}
    assert all(j["status"] == "cancelled" for j in listed)


def test_a_job_poll_runs_two_statements_and_keeps_401_before_404(
    client, service_app, alice, bob, zoo, monkeypatch
):
    """The most frequent request: the key and the job in one statement, the scores in a
    second (issue 10, item 14), in one trip to the thread pool (issue 21, item 14: each trip
    wakes a thread and then the event loop, and each wake-up may wait its turn on cores
    shared with a local worker). A bad key is 401 whatever the id; another tenant's job, or
    an id that is not one, is 404."""
    import anyio.to_thread
    from sqlalchemy import event

    ds = ready_dataset(service_app, "alice")
    job = submit(client, alice, ds, models=zoo).json()
    url = f"{API}/jobs/{job['id']}"
    assert client.get(url, headers=alice.headers).status_code == 200  # last use recorded
    seen: list[str] = []

    def count(conn, cursor, statement, *args) -> None:
        seen.append(statement)

    trips: list[object] = []
    run_sync = anyio.to_thread.run_sync

    async def counted(func, *args, **kwargs):
        trips.append(func)
        return await run_sync(func, *args, **kwargs)

    event.listen(service_app.state.engine, "before_cursor_execute", count)
    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    try:
        polled = client.get(url, headers=alice.headers)
    finally:
        monkeypatch.undo()
        event.remove(service_app.state.engine, "before_cursor_execute", count)
    assert polled.status_code == 200 and polled.json()["id"] == job["id"]
    assert len(seen) == 2, seen
    assert len(trips) == 1, trips
    assert "api_keys" in seen[0] and "jobs" in seen[0]
    bad = {"Authorization": "Bearer zp_not-a-key"}
    assert_problem(client.get(url, headers=bad), 401)
    assert_problem(client.get(f"{API}/jobs/not-an-id", headers=bad), 401)
    assert client.get(url, headers=bob.headers).json()["type"].endswith("job-not-found")
    assert_problem(client.get(f"{API}/jobs/not-an-id", headers=bob.headers), 404)
    assert_problem(client.get(f"{API}/datasets/{ds}", headers=bob.headers), 404)
    assert client.get(f"{API}/datasets/{ds}", headers=alice.headers).status_code == 200


OPTION_CHECKS = ("validate", "check_world", "options_model")
"""``training.comm_options``' functions that validating a ``FinetuneOptions`` calls."""


def counting_option_checks(monkeypatch) -> dict[str, int]:
    """Wrap the fine-tune options' checks with counters (in this process, where the
    TestClient runs the API): how often each ran since."""
    from zoopick.training import comm_options

    calls = dict.fromkeys(OPTION_CHECKS, 0)
    for name in OPTION_CHECKS:
        real = getattr(comm_options, name)

        def counted(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(comm_options, name, counted)
    return calls


def test_a_poll_validates_no_fine_tune_option(client, service_app, make_key, zoo, monkeypatch):
    """A job's options are validated where they enter (its submission), not again on every
    ``GET /jobs/{id}`` or list (issue 42: each poll ran ``check_world`` twice and
    ``validate`` once)."""
    poller = make_key(f"poller-{uuid.uuid4().hex[:8]}")
    ds = ready_dataset(service_app, poller.name)
    calls = counting_option_checks(monkeypatch)
    finetune = {"epochs": 1, "workers": 2, "compressor": "spardl", "hook_options": {"teams": 2}}
    job = submit(client, poller, ds, models=zoo, finetune=finetune).json()
    assert calls["validate"] >= 1 and calls["check_world"] >= 1  # the counters count
    for name in OPTION_CHECKS:
        calls[name] = 0
    polled = client.get(f"{API}/jobs/{job['id']}", headers=poller.headers)
    listed = client.get(f"{API}/jobs", headers=poller.headers)
    assert polled.status_code == 200, polled.text
    assert polled.json()["finetune"] == job["finetune"]
    assert polled.json()["finetune"]["hook_options"] == {"teams": 2}
    assert listed.status_code == 200, listed.text
    assert [j["finetune"] for j in listed.json()["items"]] == [job["finetune"]]
    assert calls == dict.fromkeys(OPTION_CHECKS, 0)


@pytest.mark.parametrize(
    ("column", "stored"),
    [
        ("finetune", {"compressor": "retired-hook"}),  # a hook since removed
        ("finetune", {"compressor": "spardl", "hook_options": {"retired_option": 1}}),
        ("finetune", {"compressor": "spardl", "workers": 3, "hook_options": {"teams": 2}}),
        ("finetune", {"density": 2.0}),  # a range since narrowed
        ("selection", {"shortlist": 100, "budget_epochs": 3.0, "validation_fraction": 0.2}),
    ],
    ids=["hook", "hook-option", "world", "range", "selection"],
)
def test_a_job_whose_stored_options_todays_rules_refuse_is_still_shown(
    client, service_app, make_key, zoo, column, stored
):
    """Stored options are read as they were stored: a rule tightened since the job was
    submitted does not make its view, or the list, a 500 (issue 42)."""
    from zoopick.training.config import FinetuneOptions
    from zoopick.training.race import SelectionOptions

    frank = make_key(f"frank-{uuid.uuid4().hex[:8]}")
    ds = ready_dataset(service_app, frank.name)
    job = submit(client, frank, ds, models=zoo, finetune={"epochs": 1}).json()
    if column == "finetune":
        options = {**job["finetune"], **stored}
        model = FinetuneOptions
    else:
        options, model = stored, SelectionOptions
    with pytest.raises(ValueError):  # today's rules refuse it
        model.model_validate(options)
    with session_scope(service_app.state.sessionmaker) as session:
        setattr(session.get(Job, uuid.UUID(job["id"])), column, options)  # written directly
    polled = client.get(f"{API}/jobs/{job['id']}", headers=frank.headers)
    assert polled.status_code == 200, polled.text
    assert polled.json()[column] == options
    assert polled.json()["links"]["model"].endswith("/model")
    listed = client.get(f"{API}/jobs", headers=frank.headers)
    assert listed.status_code == 200, listed.text
    assert [j[column] for j in listed.json()["items"]] == [options]


def test_model_download_of_a_scoring_only_job_is_404(client, service_app, alice, zoo):
    ds = ready_dataset(service_app, "alice")
    job = submit(client, alice, ds, models=zoo).json()
    assert_problem(client.get(f"{API}/jobs/{job['id']}/model", headers=alice.headers), 404)
    ft = submit(client, alice, ds, models=zoo, finetune={"epochs": 1}).json()
    assert ft["links"]["model"].endswith("/model")
    assert_problem(client.get(f"{API}/jobs/{ft['id']}/model", headers=alice.headers), 409, "queued")


def test_dataset_in_use_cannot_be_deleted(client, service_app, alice, zoo):
    ds = ready_dataset(service_app, "alice")
    job = submit(client, alice, ds, models=zoo).json()
    assert_problem(client.delete(f"{API}/datasets/{ds}", headers=alice.headers), 409, "job")
    client.post(f"{API}/jobs/{job['id']}/cancel", headers=alice.headers)
    assert client.delete(f"{API}/datasets/{ds}", headers=alice.headers).status_code == 204
    assert_problem(client.get(f"{API}/datasets/{ds}", headers=alice.headers), 404)
    kept = client.get(f"{API}/jobs/{job['id']}", headers=alice.headers).json()
    assert kept["dataset_id"] is None and kept["status"] == "cancelled"


# -- isolation and pagination -------------------------------------------------------------------


def test_tenant_isolation_on_every_endpoint(client, service_app, alice, bob, zoo):
    ds = ready_dataset(service_app, "alice")
    job = submit(client, alice, ds, models=zoo).json()
    jid = job["id"]
    for method, path in [
        ("GET", f"/datasets/{ds}"),
        ("DELETE", f"/datasets/{ds}"),
        ("GET", f"/jobs/{jid}"),
        ("POST", f"/jobs/{jid}/cancel"),
        ("GET", f"/jobs/{jid}/model"),
    ]:
        assert_problem(client.request(method, API + path, headers=bob.headers), 404)
    assert_problem(submit(client, bob, ds, models=zoo), 422, "unknown dataset")
    bob_jobs = client.get(f"{API}/jobs?page_size=100", headers=bob.headers).json()["items"]
    assert jid not in {j["id"] for j in bob_jobs}
    bob_sets = client.get(f"{API}/datasets?page_size=100", headers=bob.headers).json()["items"]
    assert ds not in {d["id"] for d in bob_sets}
    # still alice's, untouched by bob's attempts
    assert client.get(f"{API}/jobs/{jid}", headers=alice.headers).json()["status"] == "queued"
    assert client.get(f"{API}/datasets/{ds}", headers=alice.headers).status_code == 200
    # not-a-uuid ids are simply not found
    assert_problem(client.get(f"{API}/jobs/xyz", headers=alice.headers), 404)


def test_pagination_walks_every_job_once(client, service_app, make_key, zoo):
    dave = make_key("dave")
    ds = ready_dataset(service_app, "dave")
    made = [submit(client, dave, ds, models=zoo[:1]).json()["id"] for _ in range(5)]
    for jid in made[:2]:  # stay under the active-job limit and vary the statuses
        client.post(f"{API}/jobs/{jid}/cancel", headers=dave.headers)
    seen, token, pages = [], None, 0
    while True:
        url = f"{API}/jobs?page_size=2" + (f"&page_token={token}" if token else "")
        page = client.get(url, headers=dave.headers).json()
        assert len(page["items"]) <= 2
        seen += [j["id"] for j in page["items"]]
        pages += 1
        token = page["next_page_token"]
        if not token:
            break
    assert pages == 3
    assert seen == list(reversed(made))  # newest first, each exactly once
    assert_problem(client.get(f"{API}/jobs?page_token=garbage", headers=dave.headers), 400)
    queued = client.get(f"{API}/jobs?status=queued", headers=dave.headers).json()["items"]
    assert {j["id"] for j in queued} == set(made[2:])


def test_active_job_limit_is_429(client, service_settings, make_key, zoo):
    from fastapi.testclient import TestClient

    from zoopick.app.main import create_app

    erin = make_key("erin")
    settings = service_settings.model_copy(update={"max_active_jobs_per_tenant": 1})
    with TestClient(create_app(settings)) as c:
        ds = ready_dataset(c.app, "erin")
        assert submit(c, erin, ds, models=zoo[:1]).status_code == 202
        resp = submit(c, erin, ds, models=zoo[:1])
        assert_problem(resp, 429, "limit")
        assert "retry-after" in resp.headers


def test_bad_input_never_gives_a_500(service_app, alice, admin):
    from fastapi.testclient import TestClient

    c = TestClient(service_app, raise_server_exceptions=False)
    h = alice.headers
    ds = ready_dataset(service_app, "alice")
    multipart = {**h, "content-type": "multipart/form-data; boundary=x"}
    as_json = {**h, "content-type": "application/json"}
    zoo = {"arch": "test_resnet", "weights": "none", "num_classes": 10}
    ah = admin.headers
    cases = [
        ("POST", "/jobs", {"json": {"dataset_id": "nope"}}),
        ("POST", "/jobs", {"json": []}),
        ("POST", "/jobs", {"json": {"dataset_id": ds, "models": "some"}}),
        ("POST", "/jobs", {"json": {"dataset_id": ds, "metrics": [1, 2]}}),
        ("POST", "/jobs", {"json": {"dataset_id": ds, "finetune": {"workers": 0}}}),
        ("POST", "/jobs", {"json": {"dataset_id": ds}, "headers": {**h, "Idempotency-Key": ""}}),
        ("POST", "/jobs", {"content": b"\xff\xfe", "headers": as_json}),
        ("GET", "/jobs?page_token=%00%ff", {}),
        ("GET", "/jobs?page_token=eyJjIjogIngiLCAiaSI6ICJ5In0", {}),
        ("GET", "/jobs/" + "9" * 300, {}),
        ("GET", "/jobs/%00/model", {}),
        ("POST", "/datasets", {"content": b"--x\r\nbroken", "headers": multipart}),
        ("POST", "/datasets", {"files": {"file": ("a.npz", b"", "x")}}),
        ("POST", "/datasets", {"files": {"file": ("../../etc/a.npz", b"garbage", "x")}}),
        ("POST", "/datasets", {"files": {"file": ("a.tar.gz", b"garbage", "x")}}),
        ("POST", "/zoo", {"json": {**zoo, "id": "../x"}, "headers": ah}),
        ("POST", "/zoo", {"json": {**zoo, "id": "ok2", "interpolation": "weird"}, "headers": ah}),
        ("PUT", "/jobs", {}),
    ]  # fmt: skip
    for method, path, kw in cases:
        kw = {"headers": h, **kw}
        resp = c.request(method, API + path, **kw)
        assert 400 <= resp.status_code < 500, (method, path, resp.status_code, resp.text)
        assert resp.headers["content-type"].startswith(PROBLEM), (method, path)


def test_the_api_docs_pages_name_only_assets_this_server_serves(client):
    """``/docs`` was blank offline: Swagger UI's script and style came from a CDN (ReDoc's
    too, for ``/redoc``). Each page names only this server's paths, and each is served with
    its type from the installed package."""
    kinds = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    for page, named in (
        ("/docs", ("/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css")),
        ("/redoc", ("/docs/assets/redoc.standalone.js",)),
    ):
        resp = client.get(page)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
        html = resp.text
        assert "http:" not in html and "https:" not in html and "cdn" not in html, html
        urls = re.findall(r'(?:src|href|spec-url)="([^"]*)"', html)
        urls += re.findall(r"url: '([^']*)'", html)
        assert set(named) | {"/static/favicon.svg", "/openapi.json"} == set(urls), urls
        for url in urls:
            served = client.get(url)
            assert served.status_code == 200, url
            suffix = url[url.rfind(".") :]
            kind = kinds.get(suffix, "application/json")
            assert served.headers["content-type"].startswith(kind), (url, served.headers)
            assert len(served.content) > 300, url  # the file, not an empty answer
    assert "SwaggerUIBundle" in client.get("/docs/assets/swagger-ui-bundle.js").text
    assert client.get("/docs/oauth2-redirect").status_code == 200  # as FastAPI's own
