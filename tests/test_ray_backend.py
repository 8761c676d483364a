"""The ``ray`` training backend on a real local Ray cluster (``ray.cluster_utils.Cluster``: a
head with no CPUs and 1-CPU worker nodes, so every training worker sits on a node of its own),
driven the way users drive it: ``zoopick train --backend ray`` and the driver process the
service's task starts (``training.backends.spawn``). One cluster for the module."""

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

from zoopick.training.config import FINAL_CONFIG, FINAL_WEIGHTS, EpochRecord, RunEvent, parse_line

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

TRAIN = [sys.executable, "-m", "zoopick.cli", "train"]


@pytest.fixture(scope="module")
def cluster():
    from tests.service.procs import free_port

    # a dashboard of its own (the state API the cancel test reads goes through it)
    head = {"num_cpus": 0, "dashboard_port": free_port()}
    c = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()


def _args(tiny_zoo: Path, tiny_npz: Path, out: Path, address: str, **extra: str) -> list[str]:
    options = {
        "--zoo": str(tiny_zoo), "--model": "tiny-resnet", "--data": str(tiny_npz),
        "--out": str(out), "--backend": "ray", "--ray-address": address,
        "--workers": "2", "--compressor": "spardl", "--density": "0.1", "--epochs": "2",
        "--batch-size": "4", "--lr": "0.05", "--placement": "STRICT_SPREAD", **extra,
    }  # fmt: skip
    return [*TRAIN, *(item for pair in options.items() for item in pair), "--json"]


def _records(stdout: str) -> list[EpochRecord | RunEvent]:
    found = [parse_line(line) for line in stdout.splitlines()]
    return [r for r in found if isinstance(r, EpochRecord | RunEvent)]


def test_spardl_across_two_nodes_streams_epochs_and_ends_with_equal_replicas(
    cluster, tiny_zoo, tiny_npz, tmp_path
):
    out = tmp_path / "run"
    done = subprocess.run(
        _args(tiny_zoo, tiny_npz, out, cluster.address),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = _records(done.stdout)
    started = [r for r in lines if isinstance(r, RunEvent)]
    epochs = [r for r in lines if isinstance(r, EpochRecord)]
    assert started and started[0].event == "started" and started[0].backend == "ray"
    assert [r.epoch for r in epochs] == [1, 2]
    assert all(r.workers == 2 and r.compressor == "spardl" and r.bytes_sent for r in epochs)
    assert (out / FINAL_WEIGHTS).is_file()
    digests = json.loads((out / FINAL_CONFIG).read_text())["rank_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]  # both replicas, same weights


def test_one_worker_is_wrapped_like_many(cluster, tiny_zoo, tiny_npz, tmp_path):
    """World size 1 inside Ray: the run still wraps the model in DDP with its hook (Ray's own
    prepare_model would not, and registering the hook would then fail)."""
    out = tmp_path / "one"
    done = subprocess.run(
        _args(tiny_zoo, tiny_npz, out, cluster.address, **{"--workers": "1", "--epochs": "1"}),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    epochs = [r for r in _records(done.stdout) if isinstance(r, EpochRecord)]
    assert [(r.epoch, r.workers, r.compressor) for r in epochs] == [(1, 1, "spardl")]


def _start(cmd: list[str]) -> tuple[subprocess.Popen[str], list[str]]:
    """Start ``cmd`` in its own session; its stdout lines collect in the returned list."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _epochs(lines: list[str]) -> list[EpochRecord]:
    return [r for r in map(parse_line, list(lines)) if isinstance(r, EpochRecord)]


def test_a_node_lost_mid_run_resumes_from_the_checkpoint(cluster, tiny_zoo, tiny_npz, tmp_path):
    out = tmp_path / "lost"
    proc, lines = _start(_args(tiny_zoo, tiny_npz, out, cluster.address, **{"--epochs": "4"}))
    try:
        _wait_for(lambda: len(_epochs(lines)) >= 1, 180, "the first epoch")
        victim = cluster.list_all_nodes()[-1]
        assert victim is not cluster.head_node
        cluster.remove_node(victim, allow_graceful=False)
        cluster.add_node(num_cpus=1)  # the replacement machine
        assert proc.wait(timeout=240) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.5)
    records = [r for r in map(parse_line, lines) if r is not None]
    resumed = [r for r in records if isinstance(r, RunEvent) and r.event == "resumed"]
    assert resumed and resumed[0].workers == 2 and resumed[0].epoch >= 1
    assert sorted({r.epoch for r in records if isinstance(r, EpochRecord)}) == [1, 2, 3, 4]
    assert (out / FINAL_WEIGHTS).is_file()


def test_stopping_the_driver_leaves_no_ray_worker(cluster, tiny_zoo, tiny_npz, tmp_path):
    out = tmp_path / "cancelled"
    proc, lines = _start(_args(tiny_zoo, tiny_npz, out, cluster.address, **{"--epochs": "50"}))
    try:
        _wait_for(lambda: len(_epochs(lines)) >= 1, 180, "the first epoch")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # what cancelling a job does to its trainer
        proc.wait(timeout=30)

    from ray.util.state import list_actors

    ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
    try:

        def training_actors() -> list:
            alive = list_actors(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
            return [a for a in alive if "Train" in (a.class_name or "")]

        _wait_for(lambda: not training_actors(), 60, "the run's Ray actors to go")
    finally:
        ray.shutdown()


def test_an_unreachable_cluster_fails_at_once_naming_the_setting(tiny_zoo, tiny_npz, tmp_path):
    start = time.monotonic()
    done = subprocess.run(
        _args(tiny_zoo, tiny_npz, tmp_path / "nowhere", "127.0.0.1:9"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "ZOOPICK_RAY_ADDRESS" in done.stderr and "127.0.0.1:9" in done.stderr
    assert time.monotonic() - start < 60
