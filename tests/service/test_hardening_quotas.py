"""Quotas and rate limits that must hold under concurrency (issue 10, items 12 and 13), against
a real uvicorn on PostgreSQL + Redis (no worker: submitted jobs stay queued)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.service import procs
from tests.service.test_api import API


def start_service(new_pg_database, redis_url, tmp_path_factory, name: str, **overrides):
    """(api proc, base URL, settings, sessionmaker) of a uvicorn on a fresh database."""
    from zoopick.service.db import migrate
    from zoopick.service.db.session import make_engine, make_sessionmaker
    from zoopick.service.settings import Settings

    url, prefix = redis_url
    db = new_pg_database()
    migrate.upgrade(db)
    settings = Settings(
        data_dir=tmp_path_factory.mktemp(name),
        database_url=db,
        broker_url=url,
        redis_key_prefix=f"{prefix}{name}:",
        validate_inline=True,
        **overrides,
    )
    settings.ensure_dirs()
    api, base = procs.start_api(settings, settings.data_dir)
    return api, base, settings, make_sessionmaker(make_engine(db))


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
def service(new_pg_database, redis_url, tmp_path_factory):
    api, base, settings, factory = start_service(
        new_pg_database, redis_url, tmp_path_factory, "quotas"
    )
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
