"""Fault recovery (issue 43): how long a job or a dataset takes to finish after a fault.

Each scenario starts a private deployment (an API with its sweeper and one Celery worker on
both queues; its own PostgreSQL database and Redis key space on the local servers, as
``tests/service/stack.py`` does), puts work in flight, injects one fault, and measures the
seconds from the fault's end to the job's (or dataset's) end, at the service's **default**
recovery settings unless ``--set NAME=VALUE`` overrides one. Scenarios (``--scenarios``):

``worker-killed-scoring``
    the worker's whole process group is killed (SIGKILL) once the job has scored at least one
    model and not all; a new worker starts at once. The fault ends when the new worker is
    ready.
``queue-lost-scoring``
    mid-scoring, every key of the deployment's Redis key space is deleted (its queues, its
    unacknowledged messages, its results and chord counters): what a Redis restarted without
    persistence loses, without cutting the connections (emulated; a real restart also drops
    them, which ``tests/service/test_outage.py`` covers). The fault ends at the deletion.
``worker-killed-validation``
    the worker's process group is killed while a dataset is ``validating``; a new worker
    starts at once; the dataset must end ``ready`` (or ``failed`` saying why).
``database-stopped-scoring``
    the deployment's PostgreSQL (a server of the benchmark's own, ``private_pg``: the
    machine's shared one is never stopped) is stopped (a fast shutdown) mid-scoring for
    ``--outage`` seconds (10), then started again. During the outage the API is asked
    every operation of ``OUTAGE_PROBES`` (the issue's list, a signed-in dashboard page
    included): each must answer 503 with ``Retry-After`` naming the database, never a 500 or
    a reset. The fault ends when the server is started again.
``serve-killed-scoring``
    README's one-machine set-up: ``zoopick serve`` on embedded defaults (SQLite, its local
    worker, the file-system broker, one data folder) is killed (SIGKILL to its process
    group; its local worker follows it, as with any death of serve) once the job has scored
    at least one model and not all, and started again on the same folder. The fault ends
    when the new serve answers ``/readyz``.

A run that has not ended after ``--timeout`` seconds is reported ``stuck`` (the issue's goal
is an end within 180 s of the fault's end). After each job ends, the scores are counted
against models x metrics (a re-sent task must not write a row twice).

Writes ``<out>.json`` and ``<out>.md``. Example (about 3-10 minutes a repeat on 2 cores)::

    python benchmarks/faults/run.py --repeats 2 --out benchmarks/results/faults
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.faults.private_pg import PrivateCluster  # noqa: E402
from tests.service.datafiles import npz_bytes  # noqa: E402
from tests.service.procs import (  # noqa: E402
    Proc,
    start_api,
    start_serve,
    start_worker,
    wait_http,
    wait_worker_ready,
)

SCENARIOS = (
    "worker-killed-scoring",
    "queue-lost-scoring",
    "worker-killed-validation",
    "database-stopped-scoring",
    "serve-killed-scoring",
)
GOAL_SECONDS = 180.0
"""The issue's bound: a job or dataset ends within 3 minutes of the fault's end."""
METRICS = ["logme", "leep"]
ZOO = [(f"fault-{arch}-{i}", arch) for i in range(3) for arch in ("test_resnet", "test_vit")]
"""Six tiny random-weight models: scoring takes some seconds a model, so a fault lands mid-way."""
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
    worker: Proc
    base: str
    key: str
    dir: Path

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base + "/api/v1",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=60,
        )

    def kill_worker(self) -> None:
        """SIGKILL to the worker's whole process group (its pool children too)."""
        with suppress(ProcessLookupError):
            os.killpg(self.worker.proc.pid, signal.SIGKILL)
        self.worker.proc.wait()

    def restart_worker(self) -> None:
        self.worker = start_worker(self.settings, "cpu,gpu", self.dir)
        wait_worker_ready(self.worker, timeout=180)


def _database(pg_admin: str) -> str:
    """A new, migrated PostgreSQL database; its SQLAlchemy URL."""
    import psycopg
    from sqlalchemy.engine import make_url

    from zoopick.service.db import migrate

    name = f"zoopick_faults_{secrets.token_hex(4)}"
    with psycopg.connect(pg_admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    admin = make_url(pg_admin.replace("postgresql://", "postgresql+psycopg://", 1))
    url = admin.set(database=name).render_as_string(hide_password=False)
    migrate.upgrade(url)
    return url


@contextmanager
def deployment(
    args: argparse.Namespace, overrides: dict[str, str], pg_admin: str | None = None
) -> Iterator[Deployment]:
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
    from zoopick.service.security import create_api_key
    from zoopick.service.settings import Settings

    folder = Path(tempfile.mkdtemp(prefix="zoopick-faults-"))
    settings = Settings(
        data_dir=folder,
        database_url=_database(pg_admin or args.pg),
        broker_url=args.redis,
        redis_key_prefix=f"zoopick-faults-{secrets.token_hex(4)}:",
        **overrides,
    )
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        _, key = create_api_key(session, tenant="faults", name="faults")
        _, admin = create_api_key(session, tenant="ops", name="ops", admin=True)
    engine.dispose()
    api, base = start_api(settings, folder)
    worker = start_worker(settings, "cpu,gpu", folder)
    dep = Deployment(settings, api, worker, base, key, folder)
    try:
        with httpx.Client(
            base_url=base + "/api/v1", headers={"Authorization": f"Bearer {admin}"}, timeout=180
        ) as client:
            for mid, arch in ZOO:
                body = {"id": mid, "arch": arch, "weights": "none", "num_classes": 10,
                        "input_size": [3, 32, 32]}  # fmt: skip
                resp = client.post("/zoo", json=body)
                assert resp.status_code == 201, resp.text
        wait_worker_ready(worker, timeout=180)
        yield dep
    finally:
        dep.api.stop()
        dep.worker.stop()
        _forget_keys(args.redis, settings.redis_key_prefix)


def _forget_keys(redis_url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    return len(keys)


def _wait(fn: Callable[[], Any], done: Callable[[Any], bool], timeout: float,
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


def _upload(http: httpx.Client, images_per_class: int) -> str:
    data = npz_bytes(n_per_class=images_per_class, classes=3, size=32)
    resp = http.post("/datasets", files={"file": ("d.npz", data, "application/octet-stream")})
    assert resp.status_code in (201, 202), resp.text
    return resp.json()["id"]


def _ready_dataset(http: httpx.Client, images_per_class: int) -> str:
    ds = _upload(http, images_per_class)
    _, ok = _wait(lambda: http.get(f"/datasets/{ds}").json()["status"], lambda s: s == "ready",
                  300)  # fmt: skip
    assert ok, "the dataset never became ready"
    return ds


def _score_rows(database_url: str, job_id: str) -> int:
    from sqlalchemy import func, select

    from zoopick.service.db.models import Score
    from zoopick.service.db.session import make_engine, make_sessionmaker

    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            return session.scalar(
                select(func.count()).select_from(Score).where(Score.job_id == uuid.UUID(job_id))
            )
    finally:
        engine.dispose()


def _submit_all(http: httpx.Client, images_per_class: int) -> str:
    ds = _ready_dataset(http, images_per_class)
    body = {"dataset_id": ds, "models": "all", "metrics": METRICS, "select_by": "logme"}
    resp = http.post("/jobs", json=body)
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def _view(http: httpx.Client, job_id: str) -> dict:
    """The job as polled; an answer that is not the job (a 503 while a dependency comes back)
    counts as not ended."""
    try:
        resp = http.get(f"/jobs/{job_id}")
    except httpx.TransportError:
        return {"status": "unreachable"}
    return resp.json() if resp.status_code == 200 else {"status": f"http {resp.status_code}"}


def _mid_scoring(j: dict) -> bool:
    s = j.get("scoring") or {}
    return j["status"] in ("succeeded", "failed") or 0 < s.get("done", 0) < s.get("total", 0)


def scoring_fault(
    dep: Deployment, args: argparse.Namespace, inject: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """A job of every zoo model; once it has scored some and not all, ``inject()`` (which
    returns what it saw); then the seconds from its return to the job's end."""
    with dep.http() as http:
        job_id = _submit_all(http, args.images_per_class)
        before, _ = _wait(lambda: _view(http, job_id), _mid_scoring, 300, interval=0.1)
        if before["status"] in ("succeeded", "failed"):
            return {"outcome": "fault missed (the job ended first)"}
        done_at_fault = before["scoring"]["done"]
        seen = inject()
        fault_end = time.monotonic()
        final, ended = _wait(lambda: _view(http, job_id),
                             lambda j: j["status"] in ("succeeded", "failed"),
                             args.timeout, interval=0.5)  # fmt: skip
        seconds = time.monotonic() - fault_end
        rows = _score_rows(dep.settings.database_url, job_id)
    return {
        "outcome": final["status"] if ended else "stuck",
        "recovery_s": round(seconds, 1) if ended else None,
        "waited_s": round(seconds, 1),
        "scored_at_fault": f"{done_at_fault}/{len(ZOO)}",
        "error": final.get("error"),
        "score_rows": rows,
        "score_rows_expected": len(ZOO) * len(METRICS),
        **seen,
    }


def _kill_and_restart(dep: Deployment) -> dict[str, Any]:
    dep.kill_worker()
    dep.restart_worker()
    return {}


def _lose_keys(dep: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    return {"keys_deleted": _forget_keys(args.redis, dep.settings.redis_key_prefix)}


def _signed_in(base: str, key: str) -> httpx.Client:
    """A dashboard session (the login form's cookie), as a browser holds it."""
    import re

    browser = httpx.Client(base_url=base, timeout=10, follow_redirects=False)
    page = browser.get("/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    signed = browser.post("/login", data={"api_key": key, "csrf": csrf, "next": "/jobs"})
    assert signed.status_code == 303, signed.text
    return browser


def _probe(base: str, key: str, browser: httpx.Client) -> dict[str, str]:
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


def _stop_database(
    dep: Deployment, cluster: PrivateCluster, outage: float
) -> dict[str, Any]:
    browser = _signed_in(dep.base, dep.key)
    start = time.monotonic()
    cluster.stop()
    time.sleep(1.0)  # the API's pooled connections find the server gone
    answers = _probe(dep.base, dep.key, browser)
    browser.close()
    time.sleep(max(0.0, outage - (time.monotonic() - start)))
    cluster.start()
    return {
        "outage_s": round(time.monotonic() - start, 1),
        "outage_answers_ok": all(v == "503" for v in answers.values()),
        "outage_answers": {k: v for k, v in answers.items() if v != "503"} or "all 503",
    }


def validation_fault(dep: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    with dep.http() as http:
        ds = _upload(http, args.validation_images_per_class)

        def status() -> str:
            return http.get(f"/datasets/{ds}").json()["status"]

        seen, _ = _wait(status, lambda s: s != "uploaded", 120, interval=0.05)
        if seen != "validating":
            return {"outcome": f"fault missed (the dataset was {seen})"}
        dep.kill_worker()
        dep.restart_worker()
        fault_end = time.monotonic()
        final, ended = _wait(status, lambda s: s in ("ready", "failed"), args.timeout, 0.5)
        seconds = time.monotonic() - fault_end
    return {
        "outcome": final if ended else "stuck",
        "recovery_s": round(seconds, 1) if ended else None,
        "waited_s": round(seconds, 1),
    }


def serve_fault(args: argparse.Namespace) -> dict[str, Any]:
    """``serve-killed-scoring``: the embedded serve killed mid-scoring, started again on the
    same data folder."""
    from zoopick.service.settings import Settings
    from zoopick.service_cli import KEY_FILE

    folder = Path(tempfile.mkdtemp(prefix="zoopick-faults-serve-"))
    data = folder / "data"
    env = {"ZOOPICK_DATA_DIR": str(data), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(ROOT)}  # fmt: skip

    def start(n: int) -> tuple[Proc, str]:
        (folder / f"run{n}").mkdir()
        serve, port = start_serve(folder / f"run{n}", **env)
        base = f"http://127.0.0.1:{port}"
        wait_http(serve, base + "/readyz", timeout=180)
        return serve, base

    serve, base = start(1)
    try:
        key = (data / KEY_FILE).read_text().strip()
        http = httpx.Client(base_url=base + "/api/v1", timeout=60,
                            headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        for mid, arch in ZOO:  # the local key is an admin's
            body = {"id": mid, "arch": arch, "weights": "none", "num_classes": 10,
                    "input_size": [3, 32, 32]}  # fmt: skip
            assert http.post("/zoo", json=body).status_code == 201
        job_id = _submit_all(http, args.images_per_class)
        before, _ = _wait(lambda: _view(http, job_id), _mid_scoring, 300, interval=0.1)
        http.close()
        if before["status"] in ("succeeded", "failed"):
            return {"outcome": "fault missed (the job ended first)"}
        with suppress(ProcessLookupError):
            os.killpg(serve.proc.pid, signal.SIGKILL)
        serve.proc.wait()
        serve, base = start(2)
        fault_end = time.monotonic()
        with httpx.Client(base_url=base + "/api/v1", timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as http:  # fmt: skip
            final, ended = _wait(lambda: _view(http, job_id),
                                 lambda j: j["status"] in ("succeeded", "failed"),
                                 args.timeout, interval=0.5)  # fmt: skip
        seconds = time.monotonic() - fault_end
        rows = _score_rows(Settings(data_dir=data).database_url, job_id)
    finally:
        serve.stop()
    return {
        "outcome": final["status"] if ended else "stuck",
        "recovery_s": round(seconds, 1) if ended else None,
        "waited_s": round(seconds, 1),
        "scored_at_fault": f"{before['scoring']['done']}/{len(ZOO)}",
        "error": final.get("error"),
        "score_rows": rows,
        "score_rows_expected": len(ZOO) * len(METRICS),
    }


def run_scenario(name: str, args: argparse.Namespace, overrides: dict[str, str]) -> dict:
    if name == "serve-killed-scoring":
        return serve_fault(args)
    if name == "database-stopped-scoring":
        cluster = PrivateCluster()
        cluster.start()
        try:
            with deployment(args, overrides, pg_admin=cluster.url) as dep:
                return scoring_fault(dep, args, lambda: _stop_database(dep, cluster, args.outage))
        finally:
            cluster.remove()
    with deployment(args, overrides) as dep:
        if name == "worker-killed-validation":
            return validation_fault(dep, args)
        if name == "worker-killed-scoring":
            return scoring_fault(dep, args, lambda: _kill_and_restart(dep))
        return scoring_fault(dep, args, lambda: _lose_keys(dep, args))


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == name]
        times = [r["recovery_s"] for r in mine if r.get("recovery_s") is not None]
        ended = [r for r in mine if r["outcome"] in ("succeeded", "ready")]
        out.append({
            "scenario": name,
            "runs": len(mine),
            "ended_well": len(ended),
            "stuck": sum(r["outcome"] == "stuck" for r in mine),
            "median_s": round(statistics.median(times), 1) if times else None,
            "max_s": max(times) if times else None,
            "within_goal": all(
                r.get("recovery_s") is not None and r["recovery_s"] <= GOAL_SECONDS
                for r in mine
            ),
            "duplicate_rows": any(
                r.get("score_rows", 0) > r.get("score_rows_expected", 1 << 30) for r in mine
            ),
            "outage_503": None if not any("outage_answers_ok" in r for r in mine)
            else all(r.get("outage_answers_ok") for r in mine),
        })  # fmt: skip
    return out


def markdown(report: dict) -> str:
    commits = ", ".join(f"`{c}`" for c in dict.fromkeys(r["commit"] for r in report["runs"]))
    lines = [
        "# Fault recovery (`benchmarks/faults/run.py`)",
        "",
        f"Commit{'s' if len(commits) > 1 else ''} {commits} (each run's in its details), "
        f"{report['machine']}; settings overridden: "
        f"{report['overrides'] or 'none (the defaults)'}; timeout {report['timeout_s']:.0f} s; "
        f"goal: every run ends within {GOAL_SECONDS:.0f} s of the fault's end. "
        "`queue-lost-scoring` is emulated (the deployment's Redis keys deleted, connections "
        "kept).",
        "",
        "| scenario | runs | ended well | stuck | median s | max s | within goal "
        "| duplicate rows | outage answered 503 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    yes_no = {True: "yes", False: "no", None: "—"}
    for s in report["summary"]:
        lines.append(
            f"| {s['scenario']} | {s['runs']} | {s['ended_well']} | {s['stuck']} | "
            f"{s['median_s']} | {s['max_s']} | {yes_no[s['within_goal']]} | "
            f"{yes_no[s['duplicate_rows']]} | {yes_no[s.get('outage_503')]} |"
        )
    lines += ["", "Runs:", "", "| scenario | repeat | outcome | recovery s | details |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in report["runs"]:
        details = {k: v for k, v in r.items()
                   if k not in ("scenario", "repeat", "outcome", "recovery_s")}  # fmt: skip
        lines.append(f"| {r['scenario']} | {r['repeat']} | {r['outcome']} | "
                     f"{r.get('recovery_s')} | {json.dumps(details)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=420.0,
                   help="seconds after the fault's end before a run counts as stuck")
    p.add_argument("--images-per-class", type=int, default=400,
                   help="the scored dataset's size (3 classes, 32 px)")
    p.add_argument("--validation-images-per-class", type=int, default=6000,
                   help="the validated dataset's size: large enough to be caught validating")
    p.add_argument("--merge", action="store_true",
                   help="keep the other scenarios' runs from the existing --out file")
    p.add_argument("--outage", type=float, default=10.0,
                   help="seconds the database stays stopped (database-stopped-scoring)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a Settings field for the deployment (e.g. lease_seconds=30)")
    p.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    p.add_argument("--out", default="benchmarks/results/faults")
    args = p.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    out = Path(args.out)
    rows = []
    if args.merge and out.with_suffix(".json").exists():  # other scenarios' runs, kept
        old = json.loads(out.with_suffix(".json").read_text())
        rows = [{"commit": old["commit"]} | r for r in old["runs"]
                if r["scenario"] not in scenarios]  # fmt: skip
    for repeat in range(args.repeats):
        for name in scenarios:
            start = time.monotonic()
            row = {"scenario": name, "repeat": repeat, "commit": commit,
                   **run_scenario(name, args, overrides)}  # fmt: skip
            row["wall_s"] = round(time.monotonic() - start, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    report = {
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f} at the end",
        "overrides": overrides,
        "timeout_s": args.timeout,
        "runs": rows,
        "summary": summarise(rows),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
