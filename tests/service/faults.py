"""A private zoopick deployment to inject real faults into (issue 43), and what a fault check
reads from it. Shared by the fault tests (``tests/service/test_faults.py``: short recovery
settings, a few seconds a fault) and the fault benchmark (``benchmarks/faults/run.py``: the
default settings, recovery times measured), so both start, break and read the same thing.

A deployment is an API (uvicorn, with its sweeper thread) and real Celery workers (one per
entry of ``queues``: ``("cpu,gpu",)`` is one worker on both queues, ``("cpu", "gpu")`` two)
on the given settings' PostgreSQL database and Redis key space, with a zoo of tiny
random-weight timm models registered through the API.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.service.datafiles import npz_bytes
from tests.service.procs import Proc, start_api, start_worker, wait_worker_ready

ENDED = ("succeeded", "failed")
OUTAGE_PROBES = [
    ("GET", "/api/v1/jobs"),
    ("GET", "/api/v1/datasets"),
    ("GET", "/api/v1/zoo"),
    ("GET", "/api/v1/webhook"),
    ("POST", "/api/v1/datasets"),
    ("GET", "/metrics"),
    ("GET", "/readyz"),
    ("GET", "/jobs"),  # a dashboard page, signed in
]
"""What the issue's probe found answering 500 or resetting during a database outage."""


@dataclass
class Deployment:
    settings: Any
    api: Proc
    workers: dict[str, Proc]
    """Each worker by its queues (``"cpu,gpu"``, ``"cpu"``, ``"gpu"``)."""
    base: str
    key: str
    dir: Path
    retired: list[Proc] = field(default_factory=list)
    """Killed workers (their logs stay readable)."""

    def http(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(
            base_url=self.base + "/api/v1",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=timeout,
        )

    def kill_worker(self, queues: str) -> None:
        """SIGKILL to the worker's whole process group (its pool children too), as a machine
        or an OOM killer ends it: nothing is handed back to the broker."""
        worker = self.workers.pop(queues)
        with suppress(ProcessLookupError):
            os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
        worker.stop()  # closes its log
        kept = worker.log.with_name(f"{worker.log.stem}-killed-{len(self.retired)}.log")
        worker.log = worker.log.rename(kept)  # the new worker's log takes the old name
        self.retired.append(worker)

    def start_worker(self, queues: str, timeout: float = 180) -> None:
        """A new worker on ``queues``, once it is ready."""
        self.workers[queues] = start_worker(self.settings, queues, self.dir)
        wait_worker_ready(self.workers[queues], timeout=timeout)

    def forget_keys(self) -> int:
        """Delete every Redis key of the deployment (queues, unacknowledged messages, results,
        chord counters): what a Redis restarted without persistence has lost."""
        return forget_keys(self.settings.broker_url, self.settings.redis_key_prefix)

    def logs(self, lines: int = 40) -> str:
        procs = [self.api, *self.workers.values(), *self.retired]
        return "\n".join(f"--- {p.name} ({p.log.name})\n{p.tail(lines)}" for p in procs)


def forget_keys(redis_url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    return len(keys)


@contextmanager
def deployment(
    settings: Any, zoo: Sequence[tuple], queues: Sequence[str] = ("cpu,gpu",)
) -> Iterator[Deployment]:
    """Start the API and a worker per entry of ``queues`` on ``settings`` (its database
    migrated already), register ``zoo`` ((id, timm test arch[, input side in px, 32 unless
    given]): a larger side makes a tiny model slower to score), and yield once every worker
    is ready; stop them all and delete the key space at the end."""
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
    from zoopick.service.security import create_api_key

    folder = Path(settings.data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        _, key = create_api_key(session, tenant="faults", name="faults")
        _, admin = create_api_key(session, tenant="ops", name="ops", admin=True)
    engine.dispose()
    workers = {q: start_worker(settings, q, folder) for q in queues}
    dep = Deployment(settings, None, workers, "", key, folder)  # type: ignore[arg-type]
    try:
        dep.api, dep.base = start_api(settings, folder)
        with httpx.Client(
            base_url=dep.base + "/api/v1",
            headers={"Authorization": f"Bearer {admin}"},
            timeout=180,  # the first registration imports timm in the API process
        ) as client:
            for mid, arch, *size in zoo:
                side = size[0] if size else 32
                body = {"id": mid, "arch": arch, "weights": "none", "num_classes": 10,
                        "input_size": [3, side, side]}  # fmt: skip
                resp = client.post("/zoo", json=body)
                assert resp.status_code == 201, resp.text
        for worker in workers.values():
            wait_worker_ready(worker, timeout=180)
        yield dep
    finally:
        procs = [p for p in (dep.api, *dep.workers.values()) if p is not None]
        with ThreadPoolExecutor(len(procs)) as pool:  # each waits for its own shutdown
            list(pool.map(Proc.stop, procs))
        forget_keys(settings.broker_url, settings.redis_key_prefix)


def wait(fn: Callable[[], Any], done: Callable[[Any], bool], timeout: float,
         interval: float = 0.25) -> tuple[Any, bool]:  # fmt: skip
    """(last value, whether ``done`` held before ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if done(value):
            return value, True
        if time.monotonic() > deadline:
            return value, False
        time.sleep(interval)


def upload(http: httpx.Client, images_per_class: int, seed: int = 0) -> str:
    """A random 3-class 32 px npz uploaded; its id (``seed`` makes its content its own, so
    the feature cache knows nothing of it)."""
    data = npz_bytes(n_per_class=images_per_class, classes=3, size=32, seed=seed)
    resp = http.post("/datasets", files={"file": ("d.npz", data, "application/octet-stream")})
    assert resp.status_code in (201, 202), resp.text
    return resp.json()["id"]


def ready_dataset(http: httpx.Client, images_per_class: int, seed: int = 0) -> str:
    ds = upload(http, images_per_class, seed)
    _, ok = wait(lambda: http.get(f"/datasets/{ds}").json()["status"], lambda s: s == "ready",
                 300)  # fmt: skip
    assert ok, "the dataset never became ready"
    return ds


def submit_all(http: httpx.Client, dataset_id: str, metrics: list[str]) -> str:
    """A job scoring every zoo model on the dataset by ``metrics`` (selecting by the first);
    its id."""
    body = {"dataset_id": dataset_id, "models": "all", "metrics": metrics,
            "select_by": metrics[0]}  # fmt: skip
    resp = http.post("/jobs", json=body)
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def view(http: httpx.Client, job_id: str) -> dict:
    """The job as polled; an answer that is not the job (a 503 while a dependency comes back,
    a reset) counts as not ended."""
    try:
        resp = http.get(f"/jobs/{job_id}")
    except httpx.TransportError:
        return {"status": "unreachable"}
    return resp.json() if resp.status_code == 200 else {"status": f"http {resp.status_code}"}


def mid_scoring(j: dict) -> bool:
    """Ended, or some models scored and not all."""
    s = j.get("scoring") or {}
    return j["status"] in ENDED or 0 < s.get("done", 0) < s.get("total", 0)


def score_rows(database_url: str, job_id: str) -> list[tuple[str, str]]:
    """The job's score rows, as (model, metric), one per row (a duplicate shows twice)."""
    from sqlalchemy import select

    from zoopick.service.db.models import Score
    from zoopick.service.db.session import make_engine, make_sessionmaker

    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            rows = session.execute(
                select(Score.model_id, Score.metric).where(Score.job_id == uuid.UUID(job_id))
            )
            return [tuple(r) for r in rows]
    finally:
        engine.dispose()


def ended_well(
    http: httpx.Client,
    job_id: str,
    fault_end: float,
    limit: float,
    expected: set[tuple[str, str]],
    rows: Callable[[], list[tuple[str, str]]],
    logs: Callable[[], str],
    said: str = "",
) -> dict:
    """The job succeeds within ``limit`` s of ``fault_end`` (a test's assertion), with no
    model error, a chosen model among ``expected``'s and every (model, metric) score row of
    ``expected`` once (``rows()``: the job's rows as stored); the job as last seen. ``logs()``
    and ``said`` go into the messages."""
    job, ended = wait(lambda: view(http, job_id), lambda j: j["status"] in ENDED, limit, 0.25)
    took = time.monotonic() - fault_end
    print(f"\n{job_id}: {job['status']} {took:.1f} s after the fault (bound {limit:.0f} s), "
          f"recoveries {job.get('recoveries')}{said}")  # fmt: skip
    assert ended, f"not ended {took:.0f} s after the fault: {job}\n{logs()}"
    assert job["status"] == "succeeded", f"{job}\n{logs()}"
    assert job["model_errors"] == {}
    assert job["chosen_model"] in {m for m, _ in expected}
    found = rows()
    assert sorted(found) == sorted(expected), f"score rows not once each: {sorted(found)}"
    return job


def signed_in(base: str, key: str) -> httpx.Client:
    """A dashboard session (the login form's cookie), as a browser holds it."""
    browser = httpx.Client(base_url=base, timeout=10, follow_redirects=False)
    page = browser.get("/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    signed = browser.post("/login", data={"api_key": key, "csrf": csrf, "next": "/jobs"})
    assert signed.status_code == 303, signed.text
    return browser


def probe_outage(base: str, key: str, browser: httpx.Client) -> dict[str, str]:
    """Each of ``OUTAGE_PROBES`` once: ``"503"`` when it answered as an outage must (503,
    Retry-After, the database named), else what it did."""
    seen: dict[str, str] = {}
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base, timeout=15) as api:
        for method, path in OUTAGE_PROBES:
            try:
                if path == "/jobs":
                    resp = browser.get(path)
                elif method == "POST":
                    files = {"file": ("d.npz", b"not an npz", "application/octet-stream")}
                    resp = api.post(path, files=files, headers=auth)
                else:
                    resp = api.request(method, path, headers=auth)
            except httpx.TransportError as exc:
                seen[f"{method} {path}"] = f"reset: {type(exc).__name__}"
                continue
            good = (
                resp.status_code == 503
                and "retry-after" in resp.headers
                and "database" in resp.text
            )
            seen[f"{method} {path}"] = "503" if good else f"{resp.status_code}: {resp.text[:80]}"
    return seen
