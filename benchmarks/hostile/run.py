"""Hostile uploads at full size against a running service: what each costs the API and the worker.

Every input of the hostile corpus (``tests/hostile.py``: archives of every format, npz and
images built as bombs, ratio tricks, lying headers, entry floods, links, odd names) is
uploaded to ``zoopick serve --no-worker`` (the API) with a ``zoopick worker --queues cpu``
(one pool process) validating, on a fresh PostgreSQL database with Redis as broker, one input
at a time. Per input: the HTTP status and error, the peak RSS growth of the API's processes
and of the worker's (each process' high-water mark, reset before the input through
``/proc/PID/clear_refs``, minus its resident size before), the time from upload to
``invalid``, and the CPU seconds the worker's processes spent.

    python benchmarks/hostile/run.py                        # the issue's sizes
    python benchmarks/hostile/run.py --bomb-mib 8 --entries 500000 --images 2000

Goal (issue 21): every input refused with a 4xx or ``invalid``, no process above 600 MB of
growth, validation under 30 s of CPU. Writes ``benchmarks/results/hostile.json`` and
``hostile.md``. Talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.database import create_database, drop_database  # noqa: E402

GOAL_GROWTH_MB = 600
GOAL_CPU_S = 30
MB = 1_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(pg_admin: str, redis_url: str, data_dir: Path) -> tuple[dict[str, str], str]:
    """(environment of the service, API token) on a fresh, migrated database."""
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
    from zoopick.service.security import create_api_key

    url = create_database(pg_admin, "zoopick_hostile")
    engine = make_engine(url)
    with session_scope(make_sessionmaker(engine)) as session:
        _, token = create_api_key(session, tenant="mallory", name="hostile")
    engine.dispose()
    env = dict(os.environ)
    env.update(
        ZOOPICK_DATA_DIR=str(data_dir),
        ZOOPICK_DATABASE_URL=url,
        ZOOPICK_BROKER_URL=redis_url,
        ZOOPICK_REDIS_KEY_PREFIX=f"zoopick-hostile-{secrets.token_hex(3)}:",
        ZOOPICK_RATE_UPLOADS="100000/minute",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    return env, token


def tree(root: int) -> list[int]:
    """``root`` and all its descendants."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return out


def status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return total


class Meter:
    """Peak RSS growth and CPU of one process tree across one input."""

    def __init__(self, root: int) -> None:
        self.root = root

    def start(self) -> None:
        self.pids = tree(self.root)
        self.rss = {pid: status_kb(pid, "VmRSS") for pid in self.pids}
        for pid in self.pids:  # the high-water mark restarts at the current size
            with contextlib.suppress(OSError):
                Path(f"/proc/{pid}/clear_refs").write_text("5")
        self.cpu = {pid: cpu_seconds([pid]) for pid in self.pids}

    def stop(self) -> dict:
        pids = tree(self.root)
        growth = max((status_kb(pid, "VmHWM") - self.rss.get(pid, 0) for pid in pids), default=0)
        # processes alive now: a pool process started meanwhile counts whole (one that died
        # with its work is lost to this count; the outcome then says so)
        cpu = sum(cpu_seconds([pid]) - self.cpu.get(pid, 0.0) for pid in pids)
        return {"peak_growth_mb": round(growth * 1024 / MB, 1), "cpu_s": round(cpu, 2)}


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


CONTROL = "control.npz"  # the fair input: it must end ready


def run_one(http, item, folder: Path, api: Meter, worker: Meter, timeout: float) -> dict:
    """Upload one input, wait for its outcome, measure both trees."""
    path = folder / item.name
    path.write_bytes(item.build())
    row: dict = {"name": item.name, "about": item.about, "bytes": path.stat().st_size}
    api.start()
    worker.start()
    t0 = time.monotonic()
    with path.open("rb") as fh:
        resp = http.post("/api/v1/datasets", files={"file": (item.name, fh, "application/zip")})
    row["http_status"] = resp.status_code
    outcome, error = None, None
    if resp.status_code == 202:
        ds_id = resp.json()["id"]
        while time.monotonic() - t0 < timeout:
            ds = http.get(f"/api/v1/datasets/{ds_id}").json()
            if ds["status"] in ("ready", "invalid"):
                outcome, error = ds["status"], ds.get("error")
                break
            time.sleep(0.1)
        else:
            outcome = "timeout"
    else:
        outcome = "refused"
        try:
            error = resp.json().get("detail")
        except ValueError:
            error = resp.text[:200]
    row["seconds_to_outcome"] = round(time.monotonic() - t0, 2)
    time.sleep(0.3)  # the pool process' last bookkeeping
    row.update(outcome=outcome, error=error)
    row["api"] = api.stop()
    row["worker"] = worker.stop()
    path.unlink()
    refused = outcome == "invalid" or (outcome == "refused" and 400 <= resp.status_code < 500)
    row["ok"] = bool(
        (outcome == "ready" if item.name == CONTROL else refused)
        and row["api"]["peak_growth_mb"] < GOAL_GROWTH_MB
        and row["worker"]["peak_growth_mb"] < GOAL_GROWTH_MB
        and row["worker"]["cpu_s"] < GOAL_CPU_S
    )
    return row


def _control() -> bytes:
    """A fair 29 MB npz (random uint8 images): it must be ready, and its growth shows what
    the meters see for real work."""
    import io

    import numpy as np

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    np.savez(buf, x=rng.integers(0, 255, (600, 128, 128, 3), np.uint8), y=np.arange(600) % 6)
    return buf.getvalue()


def main() -> None:
    from tests.hostile import FULL, Hostile, Sizes, corpus

    control = Hostile(CONTROL, _control, (), "a fair dataset (expected ready)")

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bomb-mib", type=int, default=FULL.bomb_mib)
    ap.add_argument("--entries", type=int, default=FULL.entries)
    ap.add_argument("--member-mib", type=int, default=FULL.member_mib)
    ap.add_argument("--images", type=int, default=FULL.images)
    ap.add_argument("--only", nargs="*", help="Input names to run (default: all).")
    ap.add_argument("--timeout", type=float, default=300, help="Seconds to wait per input.")
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/13")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    sizes = Sizes(bomb_mib=args.bomb_mib, entries=args.entries, member_mib=args.member_mib,
                  images=args.images)  # fmt: skip
    items = [h for h in [*corpus(sizes), control] if not args.only or h.name in args.only]

    import httpx

    load_at_start = os.getloadavg()
    data_dir = Path(tempfile.mkdtemp(prefix="zoopick-hostile-"))
    env, token = prepare(args.pg, args.redis, data_dir)
    port = free_port()
    exe = [sys.executable, "-m", "zoopick"]
    api_proc = start([*exe, "serve", "--no-worker", "--no-demo", "--no-local-key", "--host",
                      "127.0.0.1", "--port", str(port)], env, data_dir / "api.log")  # fmt: skip
    worker_proc = start([*exe, "worker", "--queues", "cpu", "--concurrency", "1"], env,
                        data_dir / "worker.log")  # fmt: skip
    rows = []
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise SystemExit(f"the API did not start: {(data_dir / 'api.log').read_text()}")
        time.sleep(5)  # the worker's start
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=base, headers=headers, timeout=600) as http:
            for item in items:
                row = run_one(http, item, data_dir, Meter(api_proc.pid), Meter(worker_proc.pid),
                              args.timeout)  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        stop(api_proc)
        stop(worker_proc)
        drop_database(args.pg, env["ZOOPICK_DATABASE_URL"])
    write_report(args.out, sizes, rows, load_at_start)


def write_report(out: Path, sizes, rows: list[dict], load_at_start) -> None:
    met = bool(rows) and all(r["ok"] for r in rows)
    report = {
        "benchmark": "hostile",
        "goal": f"every input refused (4xx or invalid), no process above {GOAL_GROWTH_MB} MB of "
        f"growth, validation under {GOAL_CPU_S} s of CPU",
        "goal_met": met,
        "sizes": sizes.__dict__,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
            "python": platform.python_version(),
        },
        "inputs": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "hostile.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Hostile uploads at full size (PostgreSQL + Redis, one cpu worker process)",
        "",
        "Each input of `tests/hostile.py` uploaded to `zoopick serve --no-worker` and validated "
        "by `zoopick worker --queues cpu --concurrency 1`, one at a time, service defaults. "
        "Peak growth: the largest rise of one process' resident size (high-water mark reset "
        "before the input) in the API's processes and in the worker's; CPU: the worker's "
        f"processes. Sizes: {sizes.bomb_mib} MiB of compressed zeros per stream bomb, "
        f"{sizes.entries:,} entries per flood, {sizes.images:,} float64 images in the npz. "
        f"The last row, `{CONTROL}`, is a fair dataset that must end ready: its growth is what "
        "the meters show for real work. The bzip2 and xz bombs go in under their own names "
        "(`.tar.bz2`, `.tar.xz`) and named `.tar.gz`: the worker reads a tar by its content.",
        "",
        f"Goal: every input refused (4xx or `invalid`), no process above {GOAL_GROWTH_MB} MB of "
        f"growth, validation under {GOAL_CPU_S} s of CPU: **{'met' if met else 'not met'}**.",
        "",
        "| input | MB | HTTP | outcome | s to outcome | API growth MB | worker growth MB "
        "| worker CPU s | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        error = (r["error"] or "").replace("|", "\\|")
        if len(error) > 140:
            error = error[:137] + "..."
        lines.append(
            f"| {r['name']} | {r['bytes'] / MB:.2f} | {r['http_status']} | {r['outcome']} | "
            f"{r['seconds_to_outcome']} | {r['api']['peak_growth_mb']} | "
            f"{r['worker']['peak_growth_mb']} | {r['worker']['cpu_s']} | {error} |"
        )
    lines += [
        "",
        f"Machine: {os.cpu_count()} CPUs; load average (1, 5, 15 min) "
        f"{', '.join(f'{x:.1f}' for x in load_at_start)} at the start and "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end (other work shared the "
        "cores: times to outcome are noisy, CPU seconds and memory much less so).",
        "",
    ]
    (out / "hostile.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
