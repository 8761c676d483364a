"""Where a fine-tune runs: ``local`` (``torchrun --standalone`` on this machine) or ``ray``
(Ray Train's ``TorchTrainer`` on a Ray cluster: a pool of GPU machines).

Both start as one child process that prints the run's lines on stdout (one JSON
:class:`~zoopick.training.config.EpochRecord` per epoch, :class:`RunEvent` lines) and a failing
rank's :class:`TrainerError` on stderr, and both are handed the run as one JSON document
(:class:`FinetuneConfig`, written to ``<out>/run.json``). So whoever follows a run
(``zoopick train``, the service's training task) does the same thing for either, and stopping
the child's process group stops the run (for ``ray``, the driver's exit takes its Ray actors
with it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from zoopick.training.config import FinetuneConfig

Kind = Literal["local", "ray"]
KINDS: tuple[Kind, ...] = ("local", "ray")
Placement = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
PLACEMENTS: tuple[Placement, ...] = get_args(Placement)
"""Ray's placement-group strategies for the run's workers (one bundle per worker)."""
NO_ADDRESS = (
    "the ray backend needs the Ray cluster's address, HOST:PORT "
    "(ZOOPICK_RAY_ADDRESS, or zoopick train's --ray-address)"
)


@dataclass(frozen=True)
class Backend:
    """A deployment's choice of backend (``ZOOPICK_TRAIN_BACKEND``, ``ZOOPICK_RAY_*``; or
    ``zoopick train --backend``). Its field defaults are the only ones: the settings, the
    command line and the Ray driver's flags read them from here (``Backend.placement``...)."""

    kind: Kind = "local"
    ray_address: str | None = None
    placement: Placement = "PACK"
    max_failures: int = 2
    """Worker or node losses a ``ray`` run survives (each resumes from the last epoch's
    checkpoint); one more fails the run."""
    start_timeout: int = 60
    """Seconds one (re)start of a ``ray`` run's workers waits for machines; a start that
    times out counts as a failure (an elastic run then starts with fewer)."""
    storage: str | None = None
    """Where a ``ray`` run keeps its checkpoints (Ray Train's storage path): an
    ``s3://bucket/key`` folder of the deployment's store (the job's), so no machine needs a
    folder shared with another for them, or an absolute path (a local store's, which every
    machine must then share); a run started again there (a lost worker, a re-delivered
    task) continues from its latest checkpoint. None: the run folder (shared too), and a
    run that does not resume starts over."""
    inputs: str | None = None
    """How each worker of a ``ray`` run gets the run's input files (dataset, zoo checkpoint)
    on its own machine: a JSON document ``{"hook": "module:function", "spec": {...}}``; the
    worker imports the hook and calls it with the run's config, ``spec`` and its private
    folder, and trains on the config it returns (the service's hook fetches them from its
    store: ``service.ray_inputs``). None: the config's paths are read as they are, on
    every machine (a shared folder)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown training backend {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind == "ray" and not self.ray_address:
            raise ValueError(NO_ADDRESS)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")
        if self.max_failures < 0:
            raise ValueError("max_failures must be >= 0")
        if self.start_timeout < 1:
            raise ValueError("start_timeout must be >= 1 second")
        if self.storage is not None and not (
            self.storage.startswith("s3://") or os.path.isabs(self.storage)
        ):
            raise ValueError("a ray run's storage is an s3:// URL or an absolute path")
        if self.inputs is not None:
            hook_of(self.inputs)  # ValueError where it names no module:function


def spawn(
    cfg: FinetuneConfig, backend: Backend, *, preexec_fn: Callable[[], object] | None = None
) -> subprocess.Popen[str]:
    """Start ``cfg`` on ``backend`` as a child process in its own session (see module doc)."""
    from zoopick.training.launch import spawn_local, start_run_process, write_config

    if backend.kind == "local":
        return spawn_local(cfg, preexec_fn=preexec_fn)
    command = [
        sys.executable,
        "-m",
        "zoopick.training.ray_driver",
        "--config",
        str(write_config(cfg)),
        "--address",
        str(backend.ray_address),
        "--placement",
        backend.placement,
        "--max-failures",
        str(backend.max_failures),
        "--start-timeout",
        str(backend.start_timeout),
        *(["--storage", backend.storage] if backend.storage else []),
        *(["--inputs", backend.inputs] if backend.inputs else []),
    ]
    return start_run_process(command, dict(os.environ), preexec_fn=preexec_fn)


def hook_of(inputs: str) -> tuple[str, str, dict[str, Any]]:
    """(module, function, spec) of a ``Backend.inputs`` document; ValueError where it is not
    one."""
    try:
        doc = json.loads(inputs)
        module, sep, function = doc["hook"].partition(":")
        spec = doc.get("spec", {})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"a ray run's inputs are not a hook document: {exc}") from None
    if not (sep and module and function.isidentifier() and isinstance(spec, dict)):
        raise ValueError(f"a ray run's inputs hook must be module:function, not {doc['hook']!r}")
    return module, function, spec


def ray_address_problem(address: str | None, timeout: float = 2.0) -> str | None:
    """Whether the Ray cluster at ``address`` (``host:port`` of its head's GCS) answers a
    connection, without importing Ray: None when it does, else what went wrong (the
    readiness check and the driver's first step)."""
    if not address:
        return NO_ADDRESS
    if address == "auto" or "://" in address:
        return None  # resolved by Ray itself (a local head's file, a ray:// client address)
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return f"the Ray address {address!r} is not host:port"
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return None
    except OSError as exc:
        return f"nothing answers at {address}: {exc.strerror or exc}"
