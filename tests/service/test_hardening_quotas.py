"""Quotas and rate limits that must hold under concurrency (issue 10, items 12 and 13), against
a real uvicorn on PostgreSQL + Redis (no worker: submitted jobs stay queued)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.service import procs
from tests.service.test_api import API


def start_service(isolated_settings, name: str, extra=None, **overrides):
    """(api proc, base URL, settings, sessionmaker) of a uvicorn on a fresh database."""
    from zoopick.service.db.session import make_engine, make_sessionmaker

    settings = isolated_settings(name, validate_inline=True, **overrides)
    api, base = procs.start_api(settings, settings.data_dir, extra)
    return api, base, settings, make_sessionmaker(make_engine(settings.database_url))


def new_key(factory, tenant: str) -> dict[str, str]:
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import create_api_key

    with session_scope(factory) as session:
        _, token = create_api_key(session, tenant=tenant, name=f"{tenant}-k")
    return {"Authorization": f"Bearer {token}"}


def ready_dataset_and_model(factory, tenant: str) -> str:
    from zoopick.service.db.models import Dataset, ZooModel
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import get_or_create_tenant

    with session_scope(factory) as session:
        owner = get_or_create_tenant(session, tenant)
        if session.get(ZooModel, "quota-net") is None:
            session.add(ZooModel(id="quota-net", arch="test_resnet", weights="none", num_classes=3))
        ds = Dataset(
            tenant_id=owner.id, name="q", format="npz", filename="q.npz", size_bytes=1,
            file_sha256="0" * 64, storage_path="/nonexistent/q.npz", status="ready",
            classes=["a", "b"], counts={"a": 2, "b": 2}, num_samples=4, digest="q" * 16,
        )  # fmt: skip
        session.add(ds)
        session.flush()
        return str(ds.id)


@pytest.fixture(scope="module")
def service(isolated_settings):
    api, base, settings, factory = start_service(isolated_settings, "quotas")
    try:
        yield base, settings, factory
    finally:
        api.stop()


def test_active_job_limit_holds_under_40_concurrent_submits(service):
    base, settings, factory = service
    headers = new_key(factory, "racer")
    ds = ready_dataset_and_model(factory, "racer")
    body = {"dataset_id": ds, "models": ["quota-net"], "metrics": ["sms"], "select_by": "sms"}

    def submit(_: int) -> int:
        with httpx.Client(base_url=base + API, timeout=60) as c:
            return c.post("/jobs", json=body, headers=headers).status_code

    with ThreadPoolExecutor(40) as pool:
        codes = list(pool.map(submit, range(40)))
    limit = settings.max_active_jobs_per_tenant
    assert codes.count(202) == limit, codes
    assert codes.count(429) == 40 - limit, codes
    with httpx.Client(base_url=base + API, timeout=60) as c:
        listed = c.get("/jobs", params={"page_size": 100}, headers=headers).json()["items"]
    assert len(listed) == limit
    assert uuid.UUID(listed[0]["id"])


LIMITED = {
    "ZOOPICK_RATE_UPLOADS": "3/minute",
    "ZOOPICK_RATE_JOBS": "2/minute",
    "ZOOPICK_RATE_AUTH_FAILURES": "4/minute",
    "ZOOPICK_QUOTA_DATASETS": "4",
    "ZOOPICK_QUOTA_BYTES": "300000",
}


@pytest.fixture(scope="module")
def limited(isolated_settings):
    api, base, settings, factory = start_service(isolated_settings, "limited", LIMITED)
    try:
        yield base, settings, factory
    finally:
        api.stop()


def _upload(c, headers, data: bytes, name: str = "d.npz"):
    return c.post("/datasets", files={"file": (name, data, "x")}, headers=headers)


def test_uploads_and_job_submissions_are_rate_limited_per_key(limited):
    from tests.service.datafiles import npz_bytes
    from tests.service.test_api import assert_problem

    base, _, factory = limited
    one, two = new_key(factory, "rl-one"), new_key(factory, "rl-two")
    with httpx.Client(base_url=base + API, timeout=60) as c:
        codes = [_upload(c, one, npz_bytes()).status_code for _ in range(3)]
        assert codes == [201, 201, 201]
        resp = _upload(c, one, npz_bytes())
        assert_problem(resp, 429, "ZOOPICK_RATE_UPLOADS")
        assert 1 <= int(resp.headers["retry-after"]) <= 60
        assert _upload(c, two, npz_bytes()).status_code == 201  # per key

        ds = ready_dataset_and_model(factory, "rl-one")
        body = {"dataset_id": ds, "models": ["quota-net"], "metrics": ["sms"], "select_by": "sms"}
        assert [c.post("/jobs", json=body, headers=one).status_code for _ in range(2)] == [
            202,
            202,
        ]
        resp = c.post("/jobs", json=body, headers=one)
        assert_problem(resp, 429, "ZOOPICK_RATE_JOBS")
        assert "retry-after" in resp.headers


def test_failed_authentication_is_rate_limited(limited):
    from tests.service.test_api import assert_problem

    base, _, factory = limited
    good = new_key(factory, "rl-auth")
    with httpx.Client(base_url=base + API, timeout=60) as c:
        for _ in range(4):
            assert c.get("/jobs", headers={"Authorization": "Bearer zp_guess"}).status_code == 401
        resp = c.get("/jobs", headers={"Authorization": "Bearer zp_guess"})
        assert_problem(resp, 429, "ZOOPICK_RATE_AUTH_FAILURES")
        assert int(resp.headers["retry-after"]) >= 1
        # guessing from this address is blocked, whatever the key
        assert c.get("/jobs", headers=good).status_code == 429


def test_storage_quota_names_the_quota_and_invalid_uploads_are_not_kept(isolated_settings):
    from tests.service.datafiles import not_a_dataset_zip_bytes, npz_bytes
    from tests.service.test_api import assert_problem

    extra = {"ZOOPICK_QUOTA_DATASETS": "2", "ZOOPICK_QUOTA_BYTES": "20000"}
    api, base, settings, factory = start_service(isolated_settings, "quota", extra)
    try:
        q = new_key(factory, "quota-t")
        with httpx.Client(base_url=base + API, timeout=60) as c:
            small = npz_bytes(n_per_class=2, classes=2, size=8)
            assert _upload(c, q, small).status_code == 201
            big = npz_bytes(n_per_class=30, classes=3, size=16)  # over the bytes left
            assert len(big) > 20000
            assert_problem(_upload(c, q, big), 413, "ZOOPICK_QUOTA_BYTES")
            # an invalid upload is refused and its file deleted: it takes no room
            assert _upload(c, q, not_a_dataset_zip_bytes(), "x.zip").status_code == 422
            assert _upload(c, q, small).status_code == 201
            assert_problem(_upload(c, q, small), 413, "ZOOPICK_QUOTA_DATASETS")
        # each kept dataset is its file (and the thumbnails and manifest its validation
        # made), no more
        stored = settings.storage_dir.glob("tenants/*/datasets/**/*")
        made = ("thumbs", "manifest.json")
        files = [p for p in stored if p.is_file() and not set(made) & set(p.parts)]
        assert len(files) == 2
    finally:
        api.stop()
