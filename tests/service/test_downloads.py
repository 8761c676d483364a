"""The download routes over HTTP (the API app, PostgreSQL, Redis; no worker): ``HEAD``
answers the ``GET``'s headers without a body, a model file whose size is not the one recorded
is refused as damaged instead of sent with a digest it does not match, and a failed export's
error names no server path, even one recorded by an earlier version.

Jobs are written straight into the database, as the workers would leave them."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

from tests.service.test_api import API
from tests.service.test_dashboard import sign_in


def _finished_job(app, token: str, folder: Path, content: bytes) -> str:
    """A succeeded fine-tune job of ``token``'s tenant: its model file (``content``) in
    ``folder`` and recorded with its digest and size, and a training run whose log is there."""
    from zoopick.service import pipeline
    from zoopick.service.db.models import Job, JobStatus
    from zoopick.service.db.session import session_scope
    from zoopick.service.db.types import utcnow
    from zoopick.service.run_log import LogWriter
    from zoopick.service.security import authenticate
    from zoopick.training.config import FinetuneOptions

    path = folder / "model.safetensors"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    with session_scope(app.state.sessionmaker) as session:
        job = Job(
            id=uuid.uuid4(),
            tenant_id=authenticate(session, token).tenant_id,
            dataset_id=None,
            request={},
            models=["dl-model"],
            metrics=["sms"],
            select_by="sms",
            finetune=FinetuneOptions().model_dump(mode="json"),
            chosen_model="dl-model",
            status=JobStatus.succeeded.value,
            progress=1.0,
            finished_at=utcnow(),
        )
        session.add(job)
        session.flush()
        digest = hashlib.sha256(content).hexdigest()
        pipeline.add_artefact(session, job.id, "model", str(path), digest, len(content))
        pipeline.open_run(session, job, "dl-model", {}, 1, str(folder))
        job_id = str(job.id)
    log = LogWriter(folder)
    for i in range(5):
        log.write("stdout", f"epoch {i}")
    log.close()
    return job_id


def test_head_answers_the_downloads_headers_without_a_body(client, service_app, make_key, tmp_path):
    """``HEAD`` on the model and log downloads had been 405: a client could not ask a file's
    size, digest or name without fetching it."""
    tenant = make_key(f"head-{uuid.uuid4().hex[:6]}")
    job = _finished_job(service_app, tenant.token, tmp_path / "run", b"weights" * 1000)
    for route in ("model", "log"):
        url = f"{API}/jobs/{job}/{route}"
        got = client.get(url, headers=tenant.headers)
        head = client.head(url, headers=tenant.headers)
        assert got.status_code == 200 and got.content, (route, got.text)
        assert head.status_code == 200, (route, head.status_code, head.text)
        assert head.content == b"", route
        for name in ("content-type", "content-disposition", "content-length", "digest", "etag"):
            assert head.headers.get(name) == got.headers.get(name), (route, name)
    assert head.headers["content-disposition"] == f'attachment; filename="train-{job}.log"'
    model = client.head(f"{API}/jobs/{job}/model", headers=tenant.headers)
    assert model.headers["content-length"] == "7000"
    assert model.headers["digest"] == f"sha-256={hashlib.sha256(b'weights' * 1000).hexdigest()}"
    # HEAD is the GET's twin in refusals too: another tenant's job is not found either way
    other = make_key(f"head-{uuid.uuid4().hex[:6]}")
    assert client.head(f"{API}/jobs/{job}/model", headers=other.headers).status_code == 404


def test_a_model_file_whose_size_changed_is_refused_as_damaged(
    client, service_app, make_key, tmp_path
):
    """A truncated or replaced model file had been sent as 200 with the digest and ETag of the
    file the run wrote: one stat against the recorded size refuses it, naming no path."""
    from zoopick.service import pipeline
    from zoopick.service.db.session import session_scope

    tenant = make_key(f"damaged-{uuid.uuid4().hex[:6]}")
    folder = tmp_path / "storage" / "jobs" / "run"
    job = _finished_job(service_app, tenant.token, folder, b"w" * 4096)
    url = f"{API}/jobs/{job}/model"
    assert client.get(url, headers=tenant.headers).status_code == 200
    path = folder / "model.safetensors"
    for damaged in (b"w" * 100, b"x" * 5000):  # truncated, replaced by a longer file
        path.write_bytes(damaged)
        for method in ("GET", "HEAD"):
            resp = client.request(method, url, headers=tenant.headers)
            assert resp.status_code == 500, (method, resp.status_code)
            assert "etag" not in resp.headers and "digest" not in resp.headers
            if method == "GET":
                problem = resp.json()
                assert problem["type"].endswith(":model-file-damaged")
                assert "damaged" in problem["detail"] and "operators" in problem["detail"]
                assert str(tmp_path) not in resp.text and "/" not in problem["detail"]
    # the dashboard's download is the API's, its refusal an error page
    page = sign_in(service_app, tenant.token).get(f"/jobs/{job}/model")
    assert page.status_code == 500 and str(tmp_path) not in page.text
    # an export's file is checked the same way
    path.write_bytes(b"w" * 4096)
    onnx = folder / "export" / "model.onnx"
    onnx.parent.mkdir()
    onnx.write_bytes(b"o" * 10)
    with session_scope(service_app.state.sessionmaker) as session:
        pipeline.add_artefact(session, uuid.UUID(job), "model-onnx", str(onnx), "0" * 64, 11)
    resp = client.get(url, params={"format": "onnx"}, headers=tenant.headers)
    assert resp.status_code == 500 and resp.json()["type"].endswith(":model-file-damaged")
    assert client.get(url, headers=tenant.headers).status_code == 200  # the intact one


def test_an_export_error_recorded_with_paths_is_shown_without_them(
    client, service_app, make_key, tmp_path
):
    """An error file of an earlier version is the exception's plain text, server paths and all
    (``cannot read checkpoint /srv/.../model.safetensors``): it is cleaned on the way out."""
    from zoopick.service import exports

    tenant = make_key(f"legacy-{uuid.uuid4().hex[:6]}")
    folder = tmp_path / "storage" / "jobs" / "run"
    job = _finished_job(service_app, tenant.token, folder, b"w" * 64)
    model = folder / "model.safetensors"
    failed = exports.error_file(model, "onnx")
    failed.parent.mkdir(parents=True, exist_ok=True)
    failed.write_text(
        f"ZooError: cannot read checkpoint {model}: Error while deserializing header: "
        f"HeaderTooLarge (see {tmp_path}/storage/other.log)"
    )
    resp = client.get(f"{API}/jobs/{job}/model", params={"format": "onnx"}, headers=tenant.headers)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert str(tmp_path) not in resp.text and "storage" not in detail
    assert "cannot read checkpoint the fine-tuned model file" in detail
    assert "HeaderTooLarge" in detail and "retry=true" in detail


def test_a_model_in_a_store_that_is_down_answers_503_naming_no_store(
    client, service_app, make_key, tmp_path, monkeypatch
):
    """A model kept in an S3 store (issue 40) that cannot be reached: 503 with Retry-After (a
    problem clients retry on), naming neither the bucket nor the endpoint (the server's log
    does), rather than a 500 or a hang."""
    from tests.service.procs import free_port
    from zoopick.service import pipeline
    from zoopick.service.db.models import Job
    from zoopick.service.db.session import session_scope
    from zoopick.service.exports import store_key

    tenant = make_key(f"down-{uuid.uuid4().hex[:6]}")
    job = _finished_job(service_app, tenant.token, tmp_path / "run", b"w" * 64)
    with session_scope(service_app.state.sessionmaker) as session:
        row = session.get(Job, uuid.UUID(job))
        key = store_key(row.tenant_id, row.id, "model.safetensors")
        pipeline.add_artefact(session, row.id, "model", key, "0" * 64, 64)
    port = free_port()  # nothing listens there: a store that is down
    for name, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_MAX_ATTEMPTS": "1",
                        "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                        "AWS_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    bucket = f"down-{uuid.uuid4().hex[:6]}"
    monkeypatch.setattr(service_app.state.settings, "storage_url", f"s3://{bucket}/models")
    for method in ("GET", "HEAD"):
        resp = client.request(method, f"{API}/jobs/{job}/model", headers=tenant.headers)
        assert resp.status_code == 503, (method, resp.status_code, resp.text)
        assert int(resp.headers["Retry-After"]) > 0
    problem = client.get(f"{API}/jobs/{job}/model", headers=tenant.headers).json()
    assert problem["type"].endswith(":store-unavailable") and "later" in problem["detail"]
    assert bucket not in problem["detail"] and str(port) not in problem["detail"]
