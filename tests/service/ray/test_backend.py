"""The ``ray`` training backend on a real local Ray cluster (``ray.cluster_utils.Cluster``: a
head with no CPUs and 1-CPU worker nodes, so every training worker sits on a node of its own),
driven the way users drive it: ``zoopick train --backend ray`` and the driver process the
service's task starts (``training.backends.spawn``). The cluster is the package's (conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.service.procs import poll
from tests.service.ray.conftest import add_node
from zoopick.training.config import (
    CHECKPOINT,
    FINAL_CONFIG,
    FINAL_WEIGHTS,
    METRICS,
    EpochRecord,
    RunEvent,
    parse_line,
)

pytest.importorskip("ray", reason="the ray extra is not installed")

TRAIN = [sys.executable, "-m", "zoopick.cli", "train"]


@pytest.fixture(scope="module")
def epochs_of_seconds(tmp_path_factory) -> Path:
    """600 images: an epoch lasts about a second on two 1-CPU workers, so a node removed
    after the first epoch is lost in the middle of the run, not after its end."""
    import numpy as np

    rng = np.random.default_rng(0)
    y = np.arange(600) % 3
    x = (rng.integers(0, 60, (600, 16, 16)) + 60 * y[:, None, None]).astype(np.uint8)
    path = tmp_path_factory.mktemp("ray-data") / "shapes600.npz"
    np.savez(path, x=x, y=y)
    return path


def _args(tiny_zoo: Path, tiny_npz: Path, out: Path, address: str, **extra: str) -> list[str]:
    options = {
        "--zoo": str(tiny_zoo), "--model": "tiny-resnet", "--data": str(tiny_npz),
        "--out": str(out), "--backend": "ray", "--ray-address": address,
        "--workers": "2", "--compressor": "spardl", "--density": "0.1", "--epochs": "3",
        "--batch-size": "4", "--lr": "0.05", "--placement": "STRICT_SPREAD", **extra,
    }  # fmt: skip
    return [*TRAIN, *(item for pair in options.items() for item in pair), "--json"]


_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_driver_left():
    """A test that fails half-way leaves no driver running into the next one."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _start(cmd: list[str]) -> tuple[subprocess.Popen[str], list[str]]:
    """Start ``cmd`` in its own session; its stdout lines collect in the returned list."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    _STARTED.append(proc)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def _finish(proc: subprocess.Popen[str], lines: list[str]) -> list[EpochRecord | RunEvent]:
    """Wait for the run to succeed and return what it printed."""
    assert proc.wait(timeout=240) == 0, proc.stderr.read()[-3000:]
    time.sleep(0.5)  # the reader thread takes the last lines
    return [r for r in map(parse_line, lines) if isinstance(r, EpochRecord | RunEvent)]


def _epochs(lines: list[str]) -> list[EpochRecord]:
    return [r for r in map(parse_line, list(lines)) if isinstance(r, EpochRecord)]


def test_a_run_keeps_its_checkpoints_in_the_store_and_a_second_driver_continues_from_them(
    cluster, s3_server, tiny_zoo, tiny_npz, tmp_path, monkeypatch
):
    """spardl on two 1-CPU nodes, Ray's storage in S3 (SeaweedFS): each worker writes in a
    private folder, its checkpoints go to the store (``ray.train.report``) and rank 0's lines
    reach the driver through Ray, not a file; the run ends with the model in the driver's
    folder, both replicas' parameters equal. A driver started again on the same storage (a
    re-delivered task, on a machine with an empty folder) continues from there: it has nothing
    left to train. (A node lost mid-run, resuming from the store on nodes that share no
    folder, is the pool test's: ``test_pool``.) Two epochs of the 24 tiny images: nothing
    here needs a run that lasts."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    out, where = tmp_path / "first", s3_server.url(f"ray-test/{tmp_path.name}")
    store = {"--ray-storage": where, "--epochs": "2"}
    records = _finish(*_start(_args(tiny_zoo, tiny_npz, out, cluster.address, **store)))
    epochs = [r for r in records if isinstance(r, EpochRecord)]
    assert sorted({r.epoch for r in epochs}) == [1, 2]
    assert all(r.workers == 2 and r.compressor == "spardl" and r.bytes_sent for r in epochs)
    started = [r for r in records if isinstance(r, RunEvent) and r.event == "started"]
    assert started and started[0].backend == "ray" and started[0].ref
    assert (out / FINAL_WEIGHTS).is_file()
    digests = json.loads((out / FINAL_CONFIG).read_text())["rank_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert not (out / METRICS).exists() and not (out / "ray").exists()  # nothing shared here
    stored = _stored(s3_server, f"ray-test/{tmp_path.name}/")
    assert any(k.endswith(f"/{CHECKPOINT}") for k in stored), stored
    assert any(k.endswith("/comm-state-rank1.pt") for k in stored), stored
    assert any(k.endswith("/checkpoint_manager_snapshot.json") for k in stored), stored

    again = tmp_path / "elsewhere"  # the run again, from another machine's empty folder
    records = _finish(*_start(_args(tiny_zoo, tiny_npz, again, cluster.address, **store)))
    assert not [r for r in records if isinstance(r, EpochRecord)]  # nothing trained again
    assert [r.epoch for r in records if isinstance(r, RunEvent) and r.event == "resumed"] == [2]
    assert (again / FINAL_WEIGHTS).read_bytes() == (out / FINAL_WEIGHTS).read_bytes()


def _stored(server, prefix: str) -> list[str]:
    """The keys under ``prefix`` of the test bucket."""
    import boto3

    env = server.env
    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
    )
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=server.bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def test_an_elastic_run_carries_on_with_fewer_workers(
    cluster, tiny_zoo, epochs_of_seconds, tmp_path
):
    """workers {"min": 1, "max": 2}: a node lost after the first epoch, the run restarts on
    the one node left (residuals start over: they belong to the old shards), the node comes
    back, and the run finishes."""
    from zoopick.training.ray_driver import RUN_NAME

    out = tmp_path / "elastic"
    # a start that waits 3 s for the lost machine gives up, and the next takes one worker
    extra = {"--min-workers": "1", "--ray-start-timeout": "3"}
    cmd = _args(tiny_zoo, epochs_of_seconds, out, cluster.address, **extra)
    proc, lines = _start(cmd)
    poll(lambda: _epochs(lines), len, timeout=180, what="the first epoch")
    assert _epochs(lines)[0].workers == 2  # both nodes were free: the run took both
    # the epoch's line comes before its checkpoint is reported: wait until Ray's storage (the
    # run folder here) holds it and Ray has recorded it, or the restart would start afresh
    poll(
        lambda: (
            [p.name for p in (out / RUN_NAME).rglob("*") if p.is_file()]
            if (out / RUN_NAME).is_dir()
            else []
        ),
        lambda names: CHECKPOINT in names and "checkpoint_manager_snapshot.json" in names,
        timeout=180,
        what="the first checkpoint in Ray's storage",
    )
    cluster.remove_node(cluster.list_all_nodes()[-1], allow_graceful=False)
    poll(
        lambda: _epochs(lines),
        lambda e: any(r.workers == 1 for r in e),
        180,
        what="an epoch on one",
    )
    add_node(cluster)
    records = _finish(proc, lines)
    resumed = [r for r in records if isinstance(r, RunEvent) and r.event == "resumed"]
    assert resumed and resumed[0].workers == 1
    assert sorted({r.epoch for r in records if isinstance(r, EpochRecord)}) == [1, 2, 3]
    assert (out / FINAL_WEIGHTS).is_file()


def test_one_worker_then_stopping_the_driver_leaves_no_ray_worker(
    cluster, tiny_zoo, tiny_npz, tmp_path
):
    """World size 1 inside Ray trains like many (the run wraps the model in DDP with its hook
    itself: Ray's prepare_model would not at one worker, and registering the hook would then
    fail); stopping the driver, as cancelling a job does, takes its Ray workers with it."""
    out = tmp_path / "cancelled"
    cmd = _args(tiny_zoo, tiny_npz, out, cluster.address, **{"--workers": "1", "--epochs": "50"})
    proc, lines = _start(cmd)
    try:
        poll(lambda: _epochs(lines), len, timeout=180, what="the first epoch")
        assert _training_processes(cluster)  # the check below sees them while they run
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    first = _epochs(lines)[0]
    assert (first.epoch, first.workers, first.compressor) == (1, 1, "spardl")
    assert first.iterations and first.loss is not None
    poll(lambda: _training_processes(cluster), lambda p: not p, 60, what="the Ray workers to exit")


def _training_processes(cluster) -> list[str]:
    """The Ray Train actor processes (``ray::RayTrainWorker...``, ``ray::TrainController...``)
    running under this cluster's raylets, read from /proc (the state API would need the
    dashboard, which ``ray[train]`` does not install)."""
    raylets = {
        info.process.pid
        for node in cluster.list_all_nodes()
        for info in node.all_processes.get("raylet", [])
    }
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], list(raylets)
    while stack:
        for pid in children.get(stack.pop(), []):
            stack.append(pid)
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if title.startswith("ray::") and "Train" in title:
                found.append(title.strip())
    return found


def test_an_unreachable_cluster_fails_at_once_naming_the_setting(tiny_zoo, tiny_npz, tmp_path):
    start = time.monotonic()
    done = subprocess.run(
        _args(tiny_zoo, tiny_npz, tmp_path / "nowhere", "127.0.0.1:9"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "ZOOPICK_RAY_ADDRESS" in done.stderr and "127.0.0.1:9" in done.stderr
    assert time.monotonic() - start < 60
