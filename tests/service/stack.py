"""A live zoopick for the client, pipeline and browser tests: uvicorn + one Celery worker on
both queues, PostgreSQL and Redis (private database and key prefix), a zoo of two tiny
random-weight timm models, a user key and an admin key."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.service.procs import Proc, start_api, start_worker, wait_worker_ready

ZOO = [("tiny-resnet", "test_resnet"), ("tiny-vit", "test_vit")]


@dataclass
class Stack:
    url: str
    key: str
    admin: str
    settings: object
    dir: Path
    procs: list[Proc] = field(default_factory=list)

    def api(self, key: str | None = None, timeout: float = 30) -> httpx.Client:
        return httpx.Client(
            base_url=self.url + "/api/v1",
            headers={"Authorization": f"Bearer {key or self.key}"},
            timeout=timeout,
        )

    def tenant(self, name: str) -> Stack:
        """The same server seen by a new tenant (its own key): tests sharing the server do not
        see each other's datasets and jobs."""
        from dataclasses import replace

        from zoopick.service.db.session import make_engine, make_sessionmaker
        from zoopick.service.security import create_api_key

        engine = make_engine(self.settings.database_url)
        try:
            with make_sessionmaker(engine).begin() as session:
                _, key = create_api_key(session, tenant=name, name=name)
        finally:
            engine.dispose()
        return replace(self, key=key)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(30)}" for p in self.procs)


@contextmanager
def live_stack(
    pg_url_factory, redis_url, data: Path, name: str, **overrides: object
) -> Iterator[Stack]:
    from zoopick.service.db import migrate
    from zoopick.service.db.session import make_engine, make_sessionmaker
    from zoopick.service.security import create_api_key
    from zoopick.service.settings import Settings

    url, prefix = redis_url
    settings = Settings(
        data_dir=data,
        database_url=pg_url_factory(),
        broker_url=url,
        redis_key_prefix=f"{prefix}{name}:",
        webhook_allow_networks=["127.0.0.1/32"],  # the webhook tests' receiver
        webhook_backoff_seconds=0.5,
        # the browser test's job that must still run when it is cancelled
        **{"max_epochs": 1000, **overrides},  # overrides: e.g. test_mlflow.py's server
    )
    migrate.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine).begin() as session:
        _, user = create_api_key(session, tenant=f"{name}-user", name="user")
        _, admin = create_api_key(session, tenant=f"{name}-ops", name="ops", admin=True)
    engine.dispose()
    procs: list[Proc] = []
    try:
        api, base = start_api(settings, data)
        procs.append(api)
        worker = start_worker(settings, "cpu,gpu", data)
        procs.append(worker)
        stack = Stack(base, user, admin, settings, data, procs)
        # the first registration imports timm in the API process: slow on a loaded machine
        with stack.api(admin, timeout=180) as client:
            for mid, arch in ZOO:
                body = {"id": mid, "arch": arch, "weights": "none", "num_classes": 10}
                body.update(input_size=[3, 32, 32], source="timm test model")
                resp = client.post("/zoo", json=body)
                assert resp.status_code == 201, resp.text
        wait_worker_ready(worker)
        yield stack
    finally:
        for p in procs:
            p.stop()
