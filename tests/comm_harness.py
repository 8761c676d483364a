"""Launch P real gloo processes on 127.0.0.1 and collect what each one returns.

Spawning a process costs a few seconds (torch import), so tests batch many checks into one
launch: ``launch(fn, P, *args)`` runs ``fn(rank, P, *args)`` in P spawned processes joined by a
gloo process group and returns the list of per-rank results (anything ``torch.save`` can
store). ``launch_cached`` memoises launches by (function, P, args) inside one pytest process
so several test functions can assert different parts of one run.

``fn`` must be importable by name from the child (a module-level function of a test module or
of this file). The children are forked from a ``forkserver`` that imported torch once
(``_PRELOAD``), not spawned: a spawned child imports torch itself, a few seconds of CPU each,
which at P = 7 on two cores made the launch, not the check, the cost of a test. The server
forks before any thread pool starts, so each child begins clean, as a spawned one would.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CACHE: dict[tuple[Any, ...], list[Any]] = {}

_PRELOAD = ["torch", "torch.distributed", "zoopick.training.comm", "tests.comm_harness"]
multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def world_of_one(cuda: bool) -> Iterator[None]:
    """A process group of one in this process (NCCL on GPU 0 with ``cuda``, else gloo), for
    a module's fixture: skips when one is already initialised (another module's, in the same
    xdist worker), destroyed when the fixture ends."""
    import pytest

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _entry(
    rank: int, fn: Callable[..., Any], world: int, port: int, outdir: str, args: tuple
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    result = fn(rank, world, *args)
    torch.save(result, Path(outdir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter teardown (seconds with torch loaded); the result is on disk.
    os._exit(0)


def launch(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return results by rank.

    A failure in any child is re-raised here (``torch.multiprocessing`` reports the child's
    traceback)."""
    with tempfile.TemporaryDirectory(prefix="comm_harness_") as outdir:
        mp.start_processes(
            _entry,
            args=(fn, world, free_port(), outdir, args),
            nprocs=world,
            join=True,
            start_method="forkserver",
        )
        return [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def launch_cached(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``launch`` memoised on (module, name, world, args) for this pytest process."""
    key = (fn.__module__, fn.__qualname__, world, args)
    if key not in _CACHE:
        _CACHE[key] = launch(fn, world, *args)
    return _CACHE[key]
