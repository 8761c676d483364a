"""Job-status polling under load: p50/p99 latency of ``GET /api/v1/jobs/{id}`` at fixed rates.

An **open-loop** generator: request i is scheduled at ``t0 + i / rate`` whatever happened to
the ones before, and its latency is counted from that scheduled time (so a server that falls
behind shows its queue in the latency, instead of the generator politely slowing down, the
"coordinated omission" of closed-loop tools). Requests go over a pool of keep-alive HTTP/1.1
connections written by hand on asyncio streams: the generator shares the machine with the
server and must cost far less than it.

Set-up (PostgreSQL mode, as production): a fresh PostgreSQL database migrated to head, Redis as
broker, one tenant with a ready dataset and a scoring job holding 3 models x 3 metrics of
scores (what a client polls while its job runs), ``zoopick serve --no-worker --workers N``.
Baseline, measured in the same run at the same rates: ``GET /healthz`` (no database, no auth),
so the ratios say what the endpoint itself costs over the bare server on this machine.

    python benchmarks/load/run.py --rates 50 100 200 400 --seconds 10 --workers 2

Writes ``benchmarks/results/load.json`` and ``load.md``. Talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GOAL_P99_MS = 50.0
GOAL_RATE = 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(pg_admin: str, redis_url: str, data_dir: Path) -> tuple[dict[str, str], str, str]:
    """(environment of the server, API token, job id) on a fresh database."""
    import psycopg
    from sqlalchemy.engine import make_url

    from zoopick.service import pipeline
    from zoopick.service.db import migrate
    from zoopick.service.db.models import Dataset, Job, ZooModel
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
    from zoopick.service.security import create_api_key, get_or_create_tenant

    name = f"zoopick_load_{secrets.token_hex(4)}"
    with psycopg.connect(pg_admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    admin = make_url(pg_admin.replace("postgresql://", "postgresql+psycopg://", 1))
    url = admin.set(database=name).render_as_string(hide_password=False)
    migrate.upgrade(url)
    engine = make_engine(url)
    with session_scope(make_sessionmaker(engine)) as session:
        _, token = create_api_key(session, tenant="load", name="load")
        tenant = get_or_create_tenant(session, "load")
        models = ["m1", "m2", "m3"]
        for m in models:
            session.add(ZooModel(id=m, arch="test_resnet", weights="none", num_classes=10))
        ds = Dataset(
            tenant_id=tenant.id, name="d", format="npz", filename="d.npz", size_bytes=1,
            file_sha256="0" * 64, storage_path="/nonexistent", status="ready",
            classes=["a", "b"], counts={"a": 5, "b": 5}, num_samples=10, digest="d" * 16,
        )  # fmt: skip
        session.add(ds)
        session.flush()
        metrics = ["sms", "isms", "logme"]
        job = Job(
            tenant_id=tenant.id, dataset_id=ds.id, status="scoring", progress=0.5,
            request={}, models=models, metrics=metrics, select_by="isms", task_ids=[],
        )  # fmt: skip
        session.add(job)
        session.flush()
        for i, m in enumerate(models):
            pipeline.upsert_scores(session, job.id, m, {k: 0.1 * i for k in metrics}, {})
        job_id = str(job.id)
    engine.dispose()
    env = dict(os.environ)
    env.update(
        ZOOPICK_DATA_DIR=str(data_dir),
        ZOOPICK_DATABASE_URL=url,
        ZOOPICK_BROKER_URL=redis_url,
        ZOOPICK_REDIS_KEY_PREFIX=f"zoopick-load-{secrets.token_hex(3)}:",
        ZOOPICK_SWEEP_INTERVAL_SECONDS="0",
        ZOOPICK_RATE_AUTH_FAILURES="100000/minute",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    env["_LOAD_DB"] = name
    return env, token, job_id


MAX_CONNECTIONS = 64


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and all its descendants (the ``serve`` process
    and its uvicorn workers), read from /proc: what the server spent, whatever else the
    machine was doing."""
    parents: dict[int, int] = {}
    spent: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        spent[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += spent.get(pid, 0.0)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return total


async def _one(pool: asyncio.Queue, slots: asyncio.Semaphore, host: str, port: int,
               request: bytes) -> int:  # fmt: skip
    """Send ``request`` on a pooled keep-alive connection (at most ``MAX_CONNECTIONS`` open:
    a request waits for a free one, and that wait counts in its latency); returns the status
    code."""
    async with slots:
        try:
            reader, writer = pool.get_nowait()
        except asyncio.QueueEmpty:
            reader, writer = await asyncio.open_connection(host, port)
        try:
            return await _exchange(pool, reader, writer, request)
        except BaseException:
            writer.close()
            raise


async def _exchange(pool: asyncio.Queue, reader, writer, request: bytes) -> int:
    writer.write(request)
    status_line = await reader.readline()
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    pool.put_nowait((reader, writer))
    return int(status_line.split()[1])


async def open_loop(host: str, port: int, path: str, token: str, rate: float, seconds: float):
    """Latencies (s, from the scheduled send time) and statuses of ``rate * seconds`` requests."""
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
        "Connection: keep-alive\r\n\r\n"
    ).encode()
    pool: asyncio.Queue = asyncio.Queue()
    slots = asyncio.Semaphore(MAX_CONNECTIONS)
    n = int(rate * seconds)
    latencies = np.full(n, np.nan)
    statuses = np.zeros(n, dtype=int)
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05

    async def fire(i: int, due: float) -> None:
        try:
            statuses[i] = await _one(pool, slots, host, port, request)
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            statuses[i] = -1
        latencies[i] = loop.time() - due

    tasks = []
    for i in range(n):
        due = start + i / rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(fire(i, due)))
    done_by = start + seconds
    _, pending = await asyncio.wait(tasks, timeout=max(10.0, seconds))
    for task in pending:  # not answered in time: counted as errors
        task.cancel()
    achieved = np.isfinite(latencies).sum() / max(loop.time() - start, seconds)
    while not pool.empty():
        _, writer = pool.get_nowait()
        writer.close()
    del done_by
    return latencies, statuses, achieved


def summarise(latencies: np.ndarray, statuses: np.ndarray, rate: float, achieved: float) -> dict:
    ok = np.isfinite(latencies) & (statuses == 200)
    lat = latencies[ok] * 1000
    return {
        "rate": rate,
        "sent": int(latencies.size),
        "ok": int(ok.sum()),
        "errors": int((~ok).sum()),
        "achieved_rate": round(float(achieved), 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
        "max_ms": round(float(lat.max()), 2) if lat.size else None,
    }


def count_statements(env: dict[str, str], token: str, job_id: str) -> int:
    """SQL statements one ``GET /jobs/{id}`` runs (warm: the key's last use already recorded),
    counted with SQLAlchemy's cursor events on an in-process app with the same settings."""
    from fastapi.testclient import TestClient
    from sqlalchemy import event

    from zoopick.app.main import create_app
    from zoopick.service.settings import Settings

    keys = {k: v for k, v in env.items() if k.startswith("ZOOPICK_")}
    settings = Settings(**{k.removeprefix("ZOOPICK_").lower(): v for k, v in keys.items()})
    app = create_app(settings)
    seen: list[str] = []
    event.listen(app.state.engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    with TestClient(app) as c:
        headers = {"Authorization": f"Bearer {token}"}
        assert c.get(f"/api/v1/jobs/{job_id}", headers=headers).status_code == 200
        seen.clear()
        assert c.get(f"/api/v1/jobs/{job_id}", headers=headers).status_code == 200
    return len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[50, 100, 200, 400])
    ap.add_argument("--seconds", type=float, default=10.0, help="Length of each rate's run.")
    ap.add_argument("--workers", type=int, default=2, help="uvicorn processes (serve --workers).")
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()

    import tempfile

    load_at_start = os.getloadavg()
    data_dir = Path(tempfile.mkdtemp(prefix="zoopick-load-"))
    env, token, job_id = prepare(args.pg, args.redis, data_dir)
    statements = count_statements(env, token, job_id)
    port = free_port()
    cmd = [sys.executable, "-m", "zoopick", "serve", "--no-worker", "--no-demo",
           "--no-local-key", "--host", "127.0.0.1", "--port", str(port),
           "--workers", str(args.workers)]  # fmt: skip
    log = (data_dir / "serve.log").open("wb")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)  # fmt: skip
    results: dict = {"job_status": [], "healthz_baseline": []}
    try:
        import httpx

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise SystemExit(f"server did not start: {(data_dir / 'serve.log').read_text()}")
        job_path = f"/api/v1/jobs/{job_id}"
        asyncio.run(open_loop("127.0.0.1", port, job_path, token, 20, 2))  # warm-up
        for rate in args.rates:
            for name, path in (("healthz_baseline", "/healthz"), ("job_status", job_path)):
                cpu_before, own_before = tree_cpu_seconds(server.pid), time.process_time()
                lat, st, achieved = asyncio.run(
                    open_loop("127.0.0.1", port, path, token, rate, args.seconds)
                )
                cpu = tree_cpu_seconds(server.pid) - cpu_before
                own = time.process_time() - own_before
                row = summarise(lat, st, rate, achieved)
                row["server_cpu_ms_per_request"] = round(1000 * cpu / max(1, row["ok"]), 2)
                row["generator_cpu_ms_per_request"] = round(1000 * own / max(1, row["sent"]), 2)
                results[name].append(row)
                print(name, json.dumps(row), flush=True)
                time.sleep(1.0)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        import psycopg

        with psycopg.connect(args.pg, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{env["_LOAD_DB"]}" WITH (FORCE)')

    at_goal = next((r for r in results["job_status"] if r["rate"] == GOAL_RATE), None)
    met = bool(
        at_goal and at_goal["errors"] == 0 and at_goal["p99_ms"] is not None
        and at_goal["p99_ms"] < GOAL_P99_MS and at_goal["achieved_rate"] >= 0.95 * GOAL_RATE
    )  # fmt: skip
    for job, base in zip(results["job_status"], results["healthz_baseline"], strict=True):
        job["p50_over_baseline"] = (
            round(job["p50_ms"] / base["p50_ms"], 2) if job["p50_ms"] and base["p50_ms"] else None
        )
        job["p99_over_baseline"] = (
            round(job["p99_ms"] / base["p99_ms"], 2) if job["p99_ms"] and base["p99_ms"] else None
        )
    report = {
        "benchmark": "load",
        "endpoint": "GET /api/v1/jobs/{id}",
        "goal": f"p99 < {GOAL_P99_MS} ms at {GOAL_RATE} requests/s",
        "goal_met": met,
        "sql_statements_per_request": statements,
        "seconds_per_rate": args.seconds,
        "server_workers": args.workers,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
            "python": platform.python_version(),
        },
        **results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Load: job-status polling (open loop, PostgreSQL mode)",
        "",
        f"`GET /api/v1/jobs/{{id}}` of a scoring job (3 models x 3 metrics), `zoopick serve "
        f"--workers {args.workers} --no-worker`, {args.seconds:g} s per rate; latency counted "
        "from each request's scheduled send time. Baseline: `GET /healthz` at the same rate in "
        f"the same run. {statements} SQL statements per request.",
        "",
        f"Goal: p99 < {GOAL_P99_MS:g} ms at {GOAL_RATE} requests/s: "
        f"**{'met' if met else 'not met'}**.",
        "",
        "| rate /s | achieved /s | p50 ms | p99 ms | errors | p50 / healthz | p99 / healthz "
        "| server CPU ms / request (healthz) | generator CPU ms / request |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, base in zip(results["job_status"], results["healthz_baseline"], strict=True):
        lines.append(
            f"| {r['rate']:g} | {r['achieved_rate']:g} | {r['p50_ms']} | {r['p99_ms']} | "
            f"{r['errors']} | {r['p50_over_baseline']} | {r['p99_over_baseline']} | "
            f"{r['server_cpu_ms_per_request']} ({base['server_cpu_ms_per_request']}) | "
            f"{r['generator_cpu_ms_per_request']} |"
        )
    lines += [
        "",
        f"Machine: {os.cpu_count()} CPUs; load average (1, 5, 15 min) "
        f"{', '.join(f'{x:.1f}' for x in load_at_start)} at the start and "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end (a start above about "
        "0.5 means other work shared the cores: latencies are then noisy, the CPU per request "
        "much less so). The generator runs on the same cores as the server.",
        "",
    ]
    (args.out / "load.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
