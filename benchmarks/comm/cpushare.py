"""Time dilation: one core per worker, emulated on fewer cores (``run.py --share-cores N``).

With P workers and N < P cores, letting the kernel share the cores makes a worker that is
descheduled stall every peer waiting for its message, which no machine with a core per
worker would do. Here every worker gets a fixed fraction ``f = 1 / ceil(P / N)`` of one core
instead: a CFS bandwidth quota in a cgroup of its own, pinned so that no core carries more
than ``1 / f`` workers, and every link is shaped to ``f`` times its rate. Computation and
transmission then both take ``1 / f`` times as long as with one core per worker at the full
rate, so wall times multiplied by ``f`` estimate that machine (CPU seconds are not dilated).
What does not scale: the quota's period (a throttled worker waits up to ``(1 - f)`` of it, so
the period is kept at the 1 ms minimum quota), and kernel and loopback latencies.
"""

from __future__ import annotations

import math
import os
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
QUOTA_US = 1000  # the smallest quota CFS accepts; the period follows from the fraction


def fraction(workers: int, cores: int) -> float:
    """The share of one core each of ``workers`` gets on ``cores`` cores."""
    if workers < 1 or cores < 1:
        raise ValueError("workers and cores must be positive")
    return 1.0 / math.ceil(workers / cores)


def _root() -> tuple[str, Path]:
    if (V1 / "cpu.cfs_quota_us").exists():
        return "v1", V1
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return "v2", V2
    raise RuntimeError("--share-cores needs a writable cgroup cpu controller (v1 or v2)")


def available() -> tuple[bool, str]:
    try:
        kind, root = _root()
    except RuntimeError as exc:
        return False, str(exc)
    return os.access(root, os.W_OK), f"cgroup {kind} at {root}"


@dataclass
class Shares:
    """Per-worker cgroups with a CFS quota of ``share`` of a core, and the core each worker
    is pinned to (round robin over ``cores``). Use as a context manager: the groups are
    removed on exit (after the workers have ended)."""

    workers: int
    cores: list[int]
    share: float

    def __post_init__(self) -> None:
        self.kind, root = _root()
        self.base = root / f"zoopick-comm-{os.getpid()}"
        self.paths: list[Path] = []

    def __enter__(self) -> Shares:
        self.base.mkdir()
        if self.kind == "v2":
            (self.base / "cgroup.subtree_control").write_text("+cpu")
        period = round(QUOTA_US / self.share)
        for rank in range(self.workers):
            path = self.base / f"w{rank}"
            path.mkdir()
            if self.kind == "v1":
                (path / "cpu.cfs_period_us").write_text(str(period))
                (path / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
            else:
                (path / "cpu.max").write_text(f"{QUOTA_US} {period}")
            self.paths.append(path)
        return self

    def confine(self, rank: int):
        """A ``preexec_fn``: the child joins worker ``rank``'s group and core (both are
        inherited through ``ip netns exec``)."""
        procs = self.paths[rank] / "cgroup.procs"
        core = self.cores[rank % len(self.cores)]

        def enter() -> None:
            procs.write_text(str(os.getpid()))
            os.sched_setaffinity(0, {core})

        return enter

    def __exit__(self, *exc) -> None:
        for path in [*self.paths, self.base]:
            with suppress(OSError):  # a process still inside: the group stays behind
                path.rmdir()
