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
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.service.datafiles import npz_bytes  # noqa: E402
from tests.service.procs import Proc, start_api, start_worker, wait_worker_ready  # noqa: E402

SCENARIOS = ("worker-killed-scoring", "queue-lost-scoring", "worker-killed-validation")
GOAL_SECONDS = 180.0
"""The issue's bound: a job or dataset ends within 3 minutes of the fault's end."""
METRICS = ["logme", "leep"]
ZOO = [(f"fault-{arch}-{i}", arch) for i in range(3) for arch in ("test_resnet", "test_vit")]
"""Six tiny random-weight models: scoring takes some seconds a model, so a fault lands mid-way."""


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
def deployment(args: argparse.Namespace, overrides: dict[str, str]) -> Iterator[Deployment]:
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
    from zoopick.service.security import create_api_key
    from zoopick.service.settings import Settings

    folder = Path(tempfile.mkdtemp(prefix="zoopick-faults-"))
    settings = Settings(
        data_dir=folder,
        database_url=_database(args.pg),
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


def _score_rows(dep: Deployment, job_id: str) -> int:
    from sqlalchemy import func, select

    from zoopick.service.db.models import Score
    from zoopick.service.db.session import make_engine, make_sessionmaker

    engine = make_engine(dep.settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            return session.scalar(
                select(func.count()).select_from(Score).where(Score.job_id == job_id)
            )
    finally:
        engine.dispose()


def scoring_fault(dep: Deployment, args: argparse.Namespace, fault: str) -> dict[str, Any]:
    with dep.http() as http:
        ds = _ready_dataset(http, args.images_per_class)
        body = {"dataset_id": ds, "models": "all", "metrics": METRICS, "select_by": "logme"}
        resp = http.post("/jobs", json=body)
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["id"]

        def view() -> dict:
            return http.get(f"/jobs/{job_id}").json()

        def mid_scoring(j: dict) -> bool:
            s = j.get("scoring") or {}
            ended = j["status"] in ("succeeded", "failed")
            return ended or 0 < s.get("done", 0) < s.get("total", 0)

        before, _ = _wait(view, mid_scoring, 300, interval=0.1)
        if before["status"] in ("succeeded", "failed"):
            return {"outcome": "fault missed (the job ended first)"}
        done_at_fault = before["scoring"]["done"]
        if fault == "worker-killed-scoring":
            dep.kill_worker()
            dep.restart_worker()
        else:
            _forget_keys(args.redis, dep.settings.redis_key_prefix)
        fault_end = time.monotonic()
        final, ended = _wait(view, lambda j: j["status"] in ("succeeded", "failed"),
                             args.timeout, interval=0.5)  # fmt: skip
        seconds = time.monotonic() - fault_end
        rows = _score_rows(dep, job_id)
    return {
        "outcome": final["status"] if ended else "stuck",
        "recovery_s": round(seconds, 1) if ended else None,
        "waited_s": round(seconds, 1),
        "scored_at_fault": f"{done_at_fault}/{len(ZOO)}",
        "error": final.get("error"),
        "score_rows": rows,
        "score_rows_expected": len(ZOO) * len(METRICS),
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


def run_scenario(name: str, args: argparse.Namespace, overrides: dict[str, str]) -> dict:
    with deployment(args, overrides) as dep:
        if name == "worker-killed-validation":
            return validation_fault(dep, args)
        return scoring_fault(dep, args, name)


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
        })  # fmt: skip
    return out


def markdown(report: dict) -> str:
    lines = [
        "# Fault recovery (`benchmarks/faults/run.py`)",
        "",
        f"Commit `{report['commit']}`, {report['machine']}; settings overridden: "
        f"{report['overrides'] or 'none (the defaults)'}; timeout {report['timeout_s']:.0f} s; "
        f"goal: every run ends within {GOAL_SECONDS:.0f} s of the fault's end. "
        "`queue-lost-scoring` is emulated (the deployment's Redis keys deleted, connections "
        "kept).",
        "",
        "| scenario | runs | ended well | stuck | median s | max s | within goal "
        "| duplicate rows |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in report["summary"]:
        lines.append(
            f"| {s['scenario']} | {s['runs']} | {s['ended_well']} | {s['stuck']} | "
            f"{s['median_s']} | {s['max_s']} | {'yes' if s['within_goal'] else 'no'} | "
            f"{'yes' if s['duplicate_rows'] else 'no'} |"
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
    rows = []
    for repeat in range(args.repeats):
        for name in scenarios:
            start = time.monotonic()
            row = {"scenario": name, "repeat": repeat, **run_scenario(name, args, overrides)}
            row["wall_s"] = round(time.monotonic() - start, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    report = {
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f} at the end",
        "overrides": overrides,
        "timeout_s": args.timeout,
        "runs": rows,
        "summary": summarise(rows),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
