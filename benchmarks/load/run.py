"""Job-status polling under load: p50/p99 latency of ``GET /api/v1/jobs/{id}`` at fixed rates.

An **open-loop** generator: request i is scheduled at ``t0 + i / rate`` whatever happened to
the ones before, and its latency is counted from that scheduled time (so a server that falls
behind shows its queue in the latency, instead of the generator politely slowing down, the
"coordinated omission" of closed-loop tools). Requests go over a pool of keep-alive HTTP/1.1
connections written by hand on asyncio streams: the generator shares the machine with the
server and must cost far less than it.

Set-up (PostgreSQL mode, as production): a fresh PostgreSQL database migrated to head, Redis as
broker, one tenant with a ready dataset and a scoring job holding 3 models x 3 metrics of
scores (what a client polls while its job runs), ``zoopick serve --workers N`` in each of the
configurations of ``CONFIGS``: the API alone (``--no-worker``), with the local worker that
``serve`` starts by default, idle, and with that worker busy running a demo job (``busy.py``;
and, for comparison, busy at the API's own CPU priority, ``--worker-nice 0``). Each repeat
starts a fresh server per configuration, alternating their order, so a drift of the machine's
load falls on all of them alike; the report gives the spread over the repeats and, per
repeat, each configuration's p99 over the API alone's. Baseline, measured in the same run at
the same rates: ``GET /healthz`` (no database, no auth), so the ratios say what the endpoint
itself costs over the bare server on this machine.

    python benchmarks/load/run.py --rates 50 100 200 400 --seconds 10 --workers 2 --repeats 3

``--job finetuned`` polls instead a finished job with a race and a 40-epoch fine-tune
(``finetuned.py``: the rows a real one leaves, its curve at its bound), what a client polls
once its job is done; ``--baseline-tree DIR`` measures each configuration a second time, in
the same repeat, with the server run from another checkout (the commit before a change), so
before and after see the same machine:

    git worktree add /tmp/load-before <commit>
    python benchmarks/load/run.py --job finetuned --configs local-worker --rates 200 \
        --repeats 2 --baseline-tree /tmp/load-before

Writes ``benchmarks/results/load.json`` and ``load.md`` (``load_finetuned.*`` for
``--job finetuned``). Talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import finetuned
import numpy as np
from busy import BusyWorker, demo_models, demo_zoo

ROOT = Path(__file__).resolve().parents[2]
if sys.argv[1:2] != ["--count-statements"]:  # that child imports zoopick from its PYTHONPATH
    sys.path.insert(0, str(ROOT))

GOAL_P99_MS = 50.0
GOAL_RATE = 200


def tree_commit(tree: Path | None) -> str | None:
    """The commit checked out in ``tree`` (with ``+dirty`` when its tracked files differ)."""
    if tree is None:
        return None
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()  # fmt: skip
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", *SUBPACKAGES, "zoopick"])
    return head + ("+dirty" if dirty.returncode else "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(
    pg_admin: str, redis_url: str, data_dir: Path, manifest: Path | None = None,
    kind: str = "scoring",
) -> tuple[dict[str, str], str, str]:  # fmt: skip
    """(environment of the server, API token, job id) on a fresh database; ``manifest``: a
    zoo the server syncs at start (the demo's, for a busy worker's jobs); ``kind``: the
    polled job, ``scoring`` (running, 3 models x 3 metrics scored) or ``finetuned``
    (finished, with a race and a fine-tune: ``finetuned.build``)."""
    from benchmarks.database import create_database
    from zoopick.service import pipeline
    from zoopick.service.db.models import Job
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
    from zoopick.service.security import create_api_key, get_or_create_tenant

    url = create_database(pg_admin, "zoopick_load")
    engine = make_engine(url)
    with session_scope(make_sessionmaker(engine)) as session:
        _, token = create_api_key(session, tenant="load", name="load")
        tenant = get_or_create_tenant(session, "load")
        models = ["m1", "m2", "m3"] if kind == "scoring" else [f"m{i}" for i in range(6)]
        dataset_id = finetuned.zoo_and_dataset(session, tenant.id, models, num_classes=10)
        if kind == "finetuned":
            job_id = str(finetuned.build(session, tenant.id, dataset_id, models))
        metrics = ["sms", "isms", "logme"]
        if kind == "scoring":
            job = Job(
                tenant_id=tenant.id, dataset_id=dataset_id, status="scoring", progress=0.5,
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
        ZOOPICK_RATE_AUTH_FAILURES="100000/minute",
        PYTHONPATH=str(ROOT),
    )
    # torch's threads as a user's serve would have them (a busy worker's trainer then uses
    # the cores its launcher gives it)
    env.pop("OMP_NUM_THREADS", None)
    if manifest is not None:
        env["ZOOPICK_ZOO_MANIFEST"] = str(manifest)
    return env, token, job_id


SUBPACKAGES = ("app", "client", "selection", "service", "training", "workers")
"""The folders of a checkout that are ``zoopick``'s sub-packages (pyproject's package-dir;
``zoopick.service.migrations`` is left to the installed package: the database is migrated
by this checkout's code anyway)."""
BASELINE = " (baseline)"


def baseline_env(env: dict[str, str], tree: Path, folder: Path) -> dict[str, str]:
    """``env`` with ``zoopick`` imported from the checkout ``tree``: the package's layout
    (as the editable install maps it) made of links into that checkout, first on the path."""
    pkg = folder / "baseline-pkg" / "zoopick"
    if not pkg.exists():
        pkg.mkdir(parents=True)
        for f in (tree / "zoopick").glob("*.py"):
            (pkg / f.name).symlink_to(f.resolve())
        for sub in SUBPACKAGES:
            (pkg / sub).symlink_to((tree / sub).resolve(), target_is_directory=True)
    return {**env, "PYTHONPATH": os.pathsep.join([str(pkg.parent), str(tree)])}


MAX_CONNECTIONS = 64


def process_table() -> dict[int, tuple[int, float, str]]:
    """Every process: pid -> (parent pid, user + system CPU seconds, command line), from /proc."""
    table: dict[int, tuple[int, float, str]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmd)
    return table


def descendants(table: dict[int, tuple[int, float, str]], root: int) -> set[int]:
    """``root`` and every process below it."""
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(child for child, (parent, _, _) in table.items() if parent == pid)
    return found


def runqueue_waits(pids: set[int]) -> dict[int, float]:
    """Seconds each thread of ``pids`` spent runnable but waiting for a core (the second field
    of /proc/<pid>/task/<tid>/schedstat): the part of the latency that is CPU contention, the
    server's own work left aside."""
    waits: dict[int, float] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                waits[int(task.name)] = int((task / "schedstat").read_text().split()[1]) / 1e9
            except (OSError, IndexError, ValueError):
                continue
    return waits


Usage = dict[str, dict[int, float]]


def tree_usage(root: int) -> Usage:
    """Below the ``serve`` process ``root``: CPU seconds (user + system, from /proc: what the
    server spent, whatever else the machine was doing) of each process of the API (``serve``
    and its uvicorn processes) and of the local worker (its Celery main process and
    everything under it: pool processes, trainers), and the run-queue wait of each thread of
    the API."""
    table = process_table()
    tree = {pid for pid in descendants(table, root) if pid in table}
    worker: set[int] = set()
    for pid, (parent, _, cmd) in table.items():
        if parent == root and "celery" in cmd:  # the local worker, started by serve
            worker |= descendants(table, pid)
    api = tree - worker
    return {
        "api": {pid: table[pid][1] for pid in api},
        "worker": {pid: table[pid][1] for pid in tree & worker},
        "wait": runqueue_waits(api),
    }


def grown(before: Usage, after: Usage, key: str) -> float:
    """What ``key`` grew by between two readings, over the processes (threads) seen in the
    second: one that ended meanwhile (a finished trainer) takes what it spent with it, so
    this may count less, never less than nothing."""
    return sum(v - before[key].get(k, 0.0) for k, v in after[key].items())


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
        "p95_ms": round(float(np.percentile(lat, 95)), 2) if lat.size else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
        "max_ms": round(float(lat.max()), 2) if lat.size else None,
    }


def count_statements(env: dict[str, str], token: str, job_id: str) -> int:
    """SQL statements one ``GET /jobs/{id}`` runs (warm: the key's last use already
    recorded), counted in a process of the server's environment (its checkout's code)."""
    out = subprocess.run([sys.executable, __file__, "--count-statements", token, job_id],
                         env=env, check=True, capture_output=True, text=True)  # fmt: skip
    return int(out.stdout.split()[-1])


def _count_statements(env: dict[str, str], token: str, job_id: str) -> int:
    """What :func:`count_statements` runs: SQLAlchemy's cursor events on an in-process app
    with the server's settings."""
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


CONFIGS: dict[str, tuple[list[str], bool]] = {
    "no-worker": (["--no-worker"], False),
    "local-worker": ([], False),
    "local-worker-busy": ([], True),
    "local-worker-busy-nice0": (["--worker-nice", "0"], True),
}
"""The deployments measured, as (``serve`` options, whether the worker runs a job meanwhile):
the API alone (the worker on other machines); with the local worker that ``zoopick serve``
starts by default, idle; the same while it runs a job (scoring, then a fine-tune: what a
polled job does, see ``busy.py``); and that at the API's own CPU priority (``--worker-nice
0``, as before issue 21 item 14), for comparison."""
DEFAULT_CONFIGS = list(CONFIGS)
JOBS = {
    "scoring": "a scoring job (3 models x 3 metrics)",
    "finetuned": f"a finished job with a race (3 shortlisted of 6 models, 2 rungs) and a "
    f"{finetuned.EPOCHS}-epoch fine-tune (its sub-epoch curve at its bound)",
}
"""The polled job of each ``--job``, in words."""


def start_server(
    env: dict[str, str], config: str, workers: int, log: Path
) -> tuple[subprocess.Popen, int]:
    config = config.removesuffix(BASELINE)
    """``zoopick serve`` in ``config``, answering (and, with a local worker, ready: its worker
    beats, so its start-up is over before anything is measured)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "zoopick", "serve", "--no-demo", "--no-local-key",
           "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
           *CONFIGS[config][0]]  # fmt: skip
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        # run from the log's folder: ``python -m`` puts the working directory first on the
        # path, which would shadow a baseline checkout's package with this one's
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=log.parent)  # fmt: skip
    probe = "/healthz" if "--no-worker" in cmd else "/readyz"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{probe}", timeout=1).status_code == 200:
                return server, port
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            break
        time.sleep(0.3)
    stop_server(server)
    raise SystemExit(f"server did not start ({config}): {log.read_text()[-3000:]}")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to ``serve``'s group (it stops its worker), SIGKILL after 40 s."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait()


def measure(server: subprocess.Popen, port: int, job_path: str, token: str,
            rates: list[float], seconds: float) -> dict[str, list[dict]]:  # fmt: skip
    """One pass over ``rates``: ``/healthz`` then the job's status at each."""
    rows: dict[str, list[dict]] = {"job_status": [], "healthz_baseline": []}
    asyncio.run(open_loop("127.0.0.1", port, job_path, token, 20, 2))  # warm-up
    time.sleep(1.0)
    for rate in rates:
        for name, path in (("healthz_baseline", "/healthz"), ("job_status", job_path)):
            before, own_before = tree_usage(server.pid), time.process_time()
            load_before = os.getloadavg()[0]
            lat, st, achieved = asyncio.run(
                open_loop("127.0.0.1", port, path, token, rate, seconds)
            )
            after = tree_usage(server.pid)
            own = time.process_time() - own_before
            row = summarise(lat, st, rate, achieved)
            ok = max(1, row["ok"])
            row["server_cpu_ms_per_request"] = round(1000 * grown(before, after, "api") / ok, 2)
            row["api_runqueue_wait_ms_per_request"] = round(
                1000 * grown(before, after, "wait") / ok, 2
            )
            row["worker_cpu_ms_per_s"] = round(1000 * grown(before, after, "worker") / seconds, 1)
            row["generator_cpu_ms_per_request"] = round(1000 * own / max(1, row["sent"]), 2)
            row["load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            rows[name].append(row)
            print(name, json.dumps(row), flush=True)
            time.sleep(1.0)
    return rows


def spread(values: list[float | None]) -> dict | None:
    """Median, min and max of ``values`` (None when a run had no answer)."""
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {"median": round(float(np.median(got)), 2), "min": min(got), "max": max(got),
            "n": len(got)}  # fmt: skip


def summarise_runs(runs: list[dict], configs: list[str], rates: list[float]) -> dict:
    """Per configuration and rate: the spread over repeats of p50/p95/p99 and the achieved
    rate; per repeat, each configuration's job-status p99 over the API alone's (and the busy
    worker's over the same at the API's priority) in the same repeat: the configurations
    alternate, so both saw about the same machine."""
    out: dict = {}
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        per_rate = {}
        for i, rate in enumerate(rates):
            rows = [r["job_status"][i] for r in mine]
            per_rate[f"{rate:g}"] = {
                key: spread([row[key] for row in rows])
                for key in ("p50_ms", "p95_ms", "p99_ms", "achieved_rate", "errors",
                            "server_cpu_ms_per_request", "api_runqueue_wait_ms_per_request",
                            "worker_cpu_ms_per_s")
            }  # fmt: skip
        out[config] = per_rate
    pairs = [(c, "no-worker") for c in configs if c != "no-worker" and "no-worker" in configs]
    pairs += [(c, c + BASELINE) for c in configs if c + BASELINE in configs]
    if {"local-worker-busy", "local-worker-busy-nice0"} <= set(configs):
        pairs.append(("local-worker-busy", "local-worker-busy-nice0"))
    out["p99_ratios"] = {}
    for a, b in pairs:
        ratios: dict[str, list] = {}
        for i, rate in enumerate(rates):
            got = []
            for rep in sorted({r["repeat"] for r in runs}):
                mine = {r["config"]: r["job_status"][i]["p99_ms"] for r in runs
                        if r["repeat"] == rep}  # fmt: skip
                if mine.get(a) and mine.get(b):
                    got.append(round(mine[a] / mine[b], 2))
            ratios[f"{rate:g}"] = got
        out["p99_ratios"][f"{a} / {b}"] = ratios
    return out


def goal_met(summary: dict, config: str) -> bool:
    """The goal holds for ``config`` when, at the goal rate, the median repeat's p99 is under
    it, and no repeat had errors or fell behind the offered rate."""
    at = summary.get(config, {}).get(f"{GOAL_RATE:g}")
    if not at or at["p99_ms"] is None:
        return False
    return (at["p99_ms"]["median"] < GOAL_P99_MS and at["errors"]["max"] == 0
            and at["achieved_rate"]["min"] >= 0.95 * GOAL_RATE)  # fmt: skip


def fmt(s: dict | None, digits: int = 1) -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def describe(config: str, workers: int) -> str:
    options, busy = CONFIGS[config.removesuffix(BASELINE)]
    line = " ".join(["`zoopick serve", f"--workers {workers}", *options]) + "`"
    if config.endswith(BASELINE):
        line += " run from the baseline checkout (`--baseline-tree`)"
    return line + (", its worker running a demo job (scoring, then a fine-tune)" if busy else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[50, 100, 200, 400])
    ap.add_argument("--seconds", type=float, default=10.0, help="Length of each rate's run.")
    ap.add_argument("--workers", type=int, default=2, help="uvicorn processes (serve --workers).")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS,
                    help="Deployments to measure, alternating within each repeat.")  # fmt: skip
    ap.add_argument(
        "--local-worker",
        action="store_true",
        help="Measure only serve with its local worker, idle and busy (as --configs "
        "local-worker local-worker-busy).",
    )
    ap.add_argument("--repeats", type=int, default=3, help="Passes over every configuration.")
    ap.add_argument("--job", choices=["scoring", "finetuned"], default="scoring",
                    help="The polled job: a scoring one (3 models x 3 metrics), or a finished "
                    "one with a race and a 40-epoch fine-tune (finetuned.py).")  # fmt: skip
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="Another checkout (e.g. a git worktree of the commit before a "
                    "change): each configuration is measured again, in the same repeat, with "
                    "the server run from its code.")  # fmt: skip
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    if sys.argv[1:2] == ["--count-statements"]:  # count_statements' child process
        print(_count_statements(dict(os.environ), sys.argv[2], sys.argv[3]))
        return
    args = ap.parse_args()
    configs = list(dict.fromkeys(args.configs))
    if args.local_worker:
        configs = ["local-worker", "local-worker-busy"]
    if args.baseline_tree is not None:  # each one from this checkout, then from the other
        configs = [c + suffix for c in configs for suffix in ("", BASELINE)]
    stem = "load" if args.job == "scoring" else f"load_{args.job}"

    import tempfile

    load_at_start = os.getloadavg()
    data_dir = Path(tempfile.mkdtemp(prefix="zoopick-load-"))
    manifest = target = None
    if any(CONFIGS[c.removesuffix(BASELINE)][1] for c in configs):
        manifest, target = demo_zoo(data_dir / "demo")
    env, token, job_id = prepare(args.pg, args.redis, data_dir, manifest, args.job)
    envs = {"": env}
    if args.baseline_tree is not None:
        envs[BASELINE] = baseline_env(env, args.baseline_tree, data_dir)
    busy_dataset: str | None = None  # uploaded once, by the first busy configuration
    statements = count_statements(env, token, job_id)
    baseline_statements = (count_statements(envs[BASELINE], token, job_id)
                           if BASELINE in envs else None)  # fmt: skip
    job_path = f"/api/v1/jobs/{job_id}"
    runs: list[dict] = []
    try:
        for repeat in range(args.repeats):
            # alternate which configuration goes first: a drift of the machine's load over
            # the run then falls on both alike
            order = configs if repeat % 2 == 0 else configs[::-1]
            for config in order:
                print(f"repeat {repeat + 1}/{args.repeats}: {config}", flush=True)
                load_before = os.getloadavg()
                tree_env = envs[BASELINE if config.endswith(BASELINE) else ""]
                server, port = start_server(tree_env, config, args.workers,
                                            data_dir / "serve.log")  # fmt: skip
                busy = None
                try:
                    if CONFIGS[config.removesuffix(BASELINE)][1]:
                        busy = BusyWorker(f"http://127.0.0.1:{port}", token, target,
                                          demo_models(manifest))  # fmt: skip
                        busy.dataset_id = busy_dataset
                        busy.start()
                        busy_dataset = busy.dataset_id
                    time.sleep(2.0)  # let the start-up's last work (a worker's sweep) settle
                    rows = measure(server, port, job_path, token, args.rates, args.seconds)
                finally:
                    if busy is not None:
                        busy.stop()
                    stop_server(server)
                runs.append({"config": config, "repeat": repeat + 1,
                             "load_average_before": [round(x, 2) for x in load_before],
                             "load_average_after": [round(x, 2) for x in os.getloadavg()],
                             "busy_jobs": busy.jobs if busy else [], **rows})  # fmt: skip
    finally:
        from benchmarks.database import drop_database

        drop_database(args.pg, env["ZOOPICK_DATABASE_URL"])
        import redis

        broker = redis.Redis.from_url(args.redis)  # the run's queues, results and counters
        for key in broker.scan_iter(f"{env['ZOOPICK_REDIS_KEY_PREFIX']}*", count=1000):
            broker.delete(key)
    shutil.rmtree(data_dir, ignore_errors=True)  # kept (with serve.log) when a run failed

    for run in runs:
        for job, base in zip(run["job_status"], run["healthz_baseline"], strict=True):
            for q in ("p50", "p99"):
                a, b = job[f"{q}_ms"], base[f"{q}_ms"]
                job[f"{q}_over_baseline"] = round(a / b, 2) if a and b else None
    summary = summarise_runs(runs, configs, args.rates)
    met = {config: goal_met(summary, config) for config in configs}
    report = {
        "benchmark": stem,
        "endpoint": "GET /api/v1/jobs/{id}",
        "job": args.job,
        "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None,
        "baseline_commit": tree_commit(args.baseline_tree),
        "commit": tree_commit(ROOT),
        "goal": f"p99 < {GOAL_P99_MS} ms at {GOAL_RATE} requests/s (median of the repeats; "
        "no errors, at least 95 % of the rate achieved in every repeat)",
        "goal_met": met,
        "sql_statements_per_request": statements,
        "baseline_sql_statements_per_request": baseline_statements,
        "seconds_per_rate": args.seconds,
        "server_workers": args.workers,
        "repeats": args.repeats,
        "configs": {c: describe(c, args.workers) for c in configs},
        "command": " ".join(["python benchmarks/load/run.py", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
            "python": platform.python_version(),
        },
        "summary": summary,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Load: job-status polling (open loop, PostgreSQL mode)",
        "",
        f"`GET /api/v1/jobs/{{id}}` of {JOBS[args.job]}, PostgreSQL and "
        f"Redis, {args.seconds:g} s per rate, {args.repeats} repeat(s); latency counted from "
        "each request's scheduled send time. Baseline: `GET /healthz` at the same rate in the "
        f"same run. {statements} SQL statements per request"
        + (
            f" ({baseline_statements} from the baseline checkout, at "
            f"{report['baseline_commit']}; this one at {report['commit']})"
            if baseline_statements is not None
            else ""
        )
        + ". Configurations, alternating within each repeat (so all see about the same "
        "machine):",
        "",
    ]
    for config in configs:
        lines.append(f"- **{config}**: {report['configs'][config]}")
    lines += [
        "",
        f"Recipe: `{report['command']}`. Where the time goes, and how the configurations "
        "were compared: `benchmarks/load/README.md`.",
        "",
        f"Goal: p99 < {GOAL_P99_MS:g} ms at {GOAL_RATE} requests/s (median of the repeats, "
        "no errors, at least 95 % of the rate achieved in each): "
        + ", ".join(f"{c} **{'met' if met[c] else 'not met'}**" for c in configs)
        + ".",
        "",
        "Job status, median over the repeats (min-max):",
        "",
        "| configuration | rate /s | achieved /s | p50 ms | p95 ms | p99 ms | errors (max) "
        "| API CPU ms / request | API run-queue wait ms / request | worker CPU ms / s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config in configs:
        for rate in args.rates:
            s = summary[config][f"{rate:g}"]
            lines.append(
                f"| {config} | {rate:g} | {fmt(s['achieved_rate'])} | {fmt(s['p50_ms'])} | "
                f"{fmt(s['p95_ms'])} | {fmt(s['p99_ms'])} | {s['errors']['max']:g} | "
                f"{fmt(s['server_cpu_ms_per_request'], 2)} | "
                f"{fmt(s['api_runqueue_wait_ms_per_request'], 2)} | "
                f"{fmt(s['worker_cpu_ms_per_s'])} |"
            )
    if summary["p99_ratios"]:
        lines += [
            "",
            "Job-status p99 of one configuration over another's in the same repeat (the "
            "configurations alternate within a repeat), per repeat:",
            "",
            "| ratio | rate /s | "
            + " | ".join(f"repeat {i + 1}" for i in range(args.repeats))
            + " |",
            "|---|---|" + "---|" * args.repeats,
        ]
        for pair, per_rate in summary["p99_ratios"].items():
            for rate, got in per_rate.items():
                lines.append(f"| {pair} | {rate} | " + " | ".join(str(g) for g in got) + " |")
    lines += [
        "",
        "Every run (job status p50 / p99 ms, achieved /s; the 1-minute load average before and "
        "after the configuration's pass):",
        "",
        "| repeat | configuration | load before -> after | "
        + " | ".join(f"{r:g}/s" for r in args.rates)
        + " |",
        "|---|---|---|" + "---|" * len(args.rates),
    ]
    for run in runs:
        cells = [
            f"{r['p50_ms']} / {r['p99_ms']}, {r['achieved_rate']:g}" for r in run["job_status"]
        ]
        lines.append(
            f"| {run['repeat']} | {run['config']} | {run['load_average_before'][0]:.2f} -> "
            f"{run['load_average_after'][0]:.2f} | " + " | ".join(cells) + " |"
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
    (args.out / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
