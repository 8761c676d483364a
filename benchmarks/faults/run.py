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
    the deployment's PostgreSQL (a server of the benchmark's own,
    ``tests/service/private_pg.py``: the
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

The deployment, its faults and what is read from it are ``tests/service/faults.py``'s, shared
with the fault tests (``tests/service/test_faults.py``, which run these faults at short
recovery settings). Writes ``<out>.json`` and ``<out>.md``. Example (about 3-10 minutes a
repeat on 2 cores)::

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
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.database import private_database  # noqa: E402
from tests.service.faults import (  # noqa: E402
    ENDED,
    Deployment,
    mid_scoring,
    probe_outage,
    ready_dataset,
    score_rows,
    signed_in,
    submit_all,
    upload,
    view,
    wait,
)
from tests.service.faults import deployment as start_deployment  # noqa: E402
from tests.service.private_pg import PrivateCluster  # noqa: E402
from tests.service.procs import Proc, start_serve, wait_http  # noqa: E402

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
WORKERS = ("cpu,gpu",)
"""One worker on both queues: a fault to it stops validation and scoring alike."""


@contextmanager
def deployment(
    args: argparse.Namespace, overrides: dict[str, str], pg_admin: str | None = None
) -> Iterator[Deployment]:
    from zoopick.service.settings import Settings

    with private_database(pg_admin or args.pg, "zoopick_faults") as database_url:
        settings = Settings(
            data_dir=Path(tempfile.mkdtemp(prefix="zoopick-faults-")),
            database_url=database_url,
            broker_url=args.redis,
            redis_key_prefix=f"zoopick-faults-{secrets.token_hex(4)}:",
            **overrides,
        )
        with start_deployment(settings, ZOO, WORKERS) as dep:
            yield dep


def _submit_all(http: httpx.Client, images_per_class: int) -> str:
    return submit_all(http, ready_dataset(http, images_per_class), METRICS)


def _outcome(final: dict, ended: bool, seconds: float, done_at_fault: int, rows: int) -> dict:
    """A scoring scenario's row: how the job ended, how long after the fault, its score rows
    against the models x metrics they should be."""
    return {
        "outcome": final["status"] if ended else "stuck",
        "recovery_s": round(seconds, 1) if ended else None,
        "waited_s": round(seconds, 1),
        "scored_at_fault": f"{done_at_fault}/{len(ZOO)}",
        "error": final.get("error"),
        "score_rows": rows,
        "score_rows_expected": len(ZOO) * len(METRICS),
    }


def scoring_fault(
    dep: Deployment, args: argparse.Namespace, inject: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """A job of every zoo model; once it has scored some and not all, ``inject()`` (which
    returns what it saw); then the seconds from its return to the job's end."""
    with dep.http() as http:
        job_id = _submit_all(http, args.images_per_class)
        before, _ = wait(lambda: view(http, job_id), mid_scoring, 300, interval=0.1)
        if before["status"] in ENDED:
            return {"outcome": "fault missed (the job ended first)"}
        done_at_fault = before["scoring"]["done"]
        seen = inject()
        fault_end = time.monotonic()
        final, ended = wait(lambda: view(http, job_id), lambda j: j["status"] in ENDED,
                            args.timeout, interval=0.5)  # fmt: skip
        seconds = time.monotonic() - fault_end
        rows = len(score_rows(dep.settings.database_url, job_id))
    return {**_outcome(final, ended, seconds, done_at_fault, rows), **seen}


def _kill_and_restart(dep: Deployment) -> dict[str, Any]:
    (queues,) = WORKERS
    dep.kill_worker(queues)
    dep.start_worker(queues)
    return {}


def _lose_keys(dep: Deployment) -> dict[str, Any]:
    return {"keys_deleted": dep.forget_keys()}


def _stop_database(dep: Deployment, cluster: PrivateCluster, outage: float) -> dict[str, Any]:
    browser = signed_in(dep.base, dep.key)
    start = time.monotonic()
    cluster.stop()
    time.sleep(1.0)  # the API's pooled connections find the server gone
    answers = probe_outage(dep.base, dep.key, browser)
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
        ds = upload(http, args.validation_images_per_class)

        def status() -> str:
            return http.get(f"/datasets/{ds}").json()["status"]

        seen, _ = wait(status, lambda s: s != "uploaded", 120, interval=0.05)
        if seen != "validating":
            return {"outcome": f"fault missed (the dataset was {seen})"}
        _kill_and_restart(dep)
        fault_end = time.monotonic()
        final, ended = wait(status, lambda s: s in ("ready", "failed"), args.timeout, 0.5)
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
        before, _ = wait(lambda: view(http, job_id), mid_scoring, 300, interval=0.1)
        http.close()
        if before["status"] in ENDED:
            return {"outcome": "fault missed (the job ended first)"}
        with suppress(ProcessLookupError):
            os.killpg(serve.proc.pid, signal.SIGKILL)
        serve.proc.wait()
        serve, base = start(2)
        fault_end = time.monotonic()
        with httpx.Client(base_url=base + "/api/v1", timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as http:  # fmt: skip
            final, ended = wait(lambda: view(http, job_id), lambda j: j["status"] in ENDED,
                                args.timeout, interval=0.5)  # fmt: skip
        seconds = time.monotonic() - fault_end
        rows = len(score_rows(Settings(data_dir=data).database_url, job_id))
    finally:
        serve.stop()
    return _outcome(final, ended, seconds, before["scoring"]["done"], rows)


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
        return scoring_fault(dep, args, lambda: _lose_keys(dep))


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
    p.add_argument(
        "--timeout",
        type=float,
        default=420.0,
        help="seconds after the fault's end before a run counts as stuck",
    )
    p.add_argument(
        "--images-per-class",
        type=int,
        default=400,
        help="the scored dataset's size (3 classes, 32 px)",
    )
    p.add_argument(
        "--validation-images-per-class",
        type=int,
        default=6000,
        help="the validated dataset's size: large enough to be caught validating",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the other scenarios' runs from the existing --out file",
    )
    p.add_argument(
        "--outage",
        type=float,
        default=10.0,
        help="seconds the database stays stopped (database-stopped-scoring)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a Settings field for the deployment (e.g. lease_seconds=30)",
    )
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
            start, load_before = time.monotonic(), os.getloadavg()[0]
            row = {"scenario": name, "repeat": repeat, "commit": commit,
                   **run_scenario(name, args, overrides)}  # fmt: skip
            row["wall_s"] = round(time.monotonic() - start, 1)
            # the machine is shared: the 1-minute load average at the run's start and end
            row["load_1min"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
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
