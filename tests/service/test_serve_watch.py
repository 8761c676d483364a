"""``zoopick serve`` restarts its local worker when the worker stops beating (issue 10, item 4),
on the embedded setup (SQLite, file broker): real serve, worker and pool processes."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.service import procs
from tests.service.datafiles import npz_bytes
from tests.service.test_api import API
from tests.service.test_hardening_workers import EXTRA


@contextlib.contextmanager
def serving(
    tmp_path: Path, extra: dict[str, str], concurrency: int
) -> Iterator[tuple[procs.Proc, httpx.Client, set[int]]]:
    """``zoopick serve`` on the embedded setup in ``tmp_path`` (its local worker has
    ``concurrency`` pool processes) and a client with its key. On exit serve is stopped and
    every process in the yielded set, plus serve's descendants then, is killed: a test adds
    the processes it saw to that set."""
    from tests.service.test_serve_signals import descendants

    serve, port = procs.start_serve(
        tmp_path,
        # these tests time the worker's heartbeats in seconds: at the API's CPU priority, so
        # a worker starting beside the suite's other tests is not taken for a stalled one
        *("--worker-nice", "0"),
        *("--concurrency", str(concurrency)),
        **extra,
        ZOOPICK_DATA_DIR=str(tmp_path / "data"),
        OMP_NUM_THREADS="1",
    )
    base = f"http://127.0.0.1:{port}"
    seen: set[int] = set()
    try:
        procs.wait_http(serve, f"{base}/healthz", timeout=90)
        key = (tmp_path / "data" / "api-key").read_text().strip()
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=base, headers=headers, timeout=30) as http:
            yield serve, http, seen
    finally:
        seen |= descendants(serve.proc.pid)
        serve.stop()
        for pid in seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_serve_restarts_a_stalled_embedded_worker_and_recovers_its_work(tmp_path):
    """Embedded mode (SQLite, file broker): the local worker of ``zoopick serve`` stops
    (SIGSTOP on its process group, as a hung pool looks from outside); /readyz reports it,
    serve restarts it, and a dataset uploaded meanwhile (its message taken by the stalled
    worker, or still queued) ends ready."""
    from tests.service.test_serve_signals import descendants, local_worker

    # re-sending a lost validation every 12 s, up to 5 times, covers the stall and restart
    extra = {
        **EXTRA,
        "ZOOPICK_MAX_DELIVERIES": "5",
        "ZOOPICK_LIGHT_SOFT_TIME_LIMIT": "5",
        "ZOOPICK_LIGHT_HARD_TIME_LIMIT": "6",
    }
    with serving(tmp_path, extra, concurrency=1) as (serve, http, seen):
        procs.poll(
            lambda: http.get("/readyz").json().get("checks", {}).get("workers", ""),
            lambda w: w.startswith("ok"),
            60,
            what="the local worker's heartbeat",
        )
        started = local_worker(serve.proc.pid)
        seen |= started
        leader = min(started)  # the worker's main process leads its own group
        os.killpg(os.getpgid(leader), signal.SIGSTOP)
        resp = http.post(f"{API}/datasets", files={"file": ("late.npz", npz_bytes(), "x")})
        assert resp.status_code == 202, resp.text
        ds = resp.json()["id"]
        procs.poll(lambda: http.get("/readyz").status_code, lambda s: s == 503, 30, what="503")
        procs.poll(lambda: http.get("/readyz").status_code, lambda s: s == 200, 60, what="back")
        assert not (descendants(serve.proc.pid) & {leader})  # a new worker, not the old one
        final = procs.poll(
            lambda: http.get(f"{API}/datasets/{ds}").json(),
            lambda d: d["status"] in ("ready", "invalid"),
            90,
            what="the dataset uploaded during the stall",
        )
        assert final["status"] == "ready", final


def test_a_worker_whose_pool_children_were_killed_gives_its_tasks_back_and_is_restarted(
    tmp_path,
):
    """The case of issue 10, item 4: with the file broker, SIGKILL both prefork pool processes
    of serve's local worker. Celery starts two new ones, but its main process only reserves
    the tasks that arrive after that and never runs them (all its processes live, so neither
    a live process nor a beating pool process tells). The worker sees its reserved tasks wait
    while its pool is free: it stops beating (/readyz 503), gives the tasks back and exits;
    serve starts a new worker, which runs them. The validation time limits keep their
    defaults, so the sweeper (which re-sends a dataset only after twice that) plays no part."""
    from tests.service.test_serve_signals import descendants, local_worker

    extra = {
        "ZOOPICK_HEARTBEAT_SECONDS": "0.5",
        "ZOOPICK_HEARTBEAT_TIMEOUT_SECONDS": "4",
        "ZOOPICK_SWEEP_INTERVAL_SECONDS": "1",
    }
    with serving(tmp_path, extra, concurrency=2) as (serve, http, seen):

        def dataset(name: str, seed: int) -> str:
            files = {"file": (name, npz_bytes(seed=seed), "x")}
            resp = http.post(f"{API}/datasets", files=files)
            assert resp.status_code == 202, resp.text
            return resp.json()["id"]

        def statuses(ids: list[str]) -> list[str]:
            return [http.get(f"{API}/datasets/{i}").json()["status"] for i in ids]

        first = dataset("first.npz", 0)  # the pool has run a task before it is killed
        procs.poll(lambda: statuses([first]), lambda s: s == ["ready"], 60, what="first")
        started = local_worker(serve.proc.pid)
        seen |= started
        leader = min(started)
        pool = started - {leader}
        assert len(pool) == 2, started
        for pid in pool:
            os.kill(pid, signal.SIGKILL)
        procs.poll(  # Celery replaces them
            lambda: local_worker(serve.proc.pid) - started, lambda new: len(new) >= 2, 30,
            what="new pool processes",
        )  # fmt: skip
        late = [dataset(f"late{i}.npz", i) for i in range(1, 4)]
        resp = procs.poll(lambda: http.get("/readyz"), lambda r: r.status_code == 503, 30,
                          what="/readyz to report the stalled worker")  # fmt: skip
        assert "no live worker" in resp.json()["detail"]
        final = procs.poll(lambda: statuses(late), lambda s: s == ["ready"] * 3, 90,
                           what="the datasets the stalled worker had taken")  # fmt: skip
        assert final == ["ready"] * 3
        assert leader not in descendants(serve.proc.pid)  # a new worker ran them
        log = serve.log.read_text(errors="replace")
        assert "reserved task(s) not started" in log and "reserved task(s) back" in log, log
        procs.poll(lambda: http.get("/readyz").status_code, lambda s: s == 200, 30, what="200")
