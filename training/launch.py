"""Launch fine-tuning workers.

``python -m zoopick.training.launch --config run.json`` is one worker: run it under ``torchrun``
(one process per GPU with NCCL, or CPU processes with gloo). The run is one JSON document, a
:class:`~zoopick.training.config.FinetuneConfig`, never a list of flags. ``spawn_local``
writes it into the run folder and starts ``torchrun --standalone`` for N local workers, which
is what the ``local`` backend does; across machines, use the ``ray`` backend or run torchrun
yourself on every node (see docs/guide/finetune.md).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import ValidationError

from zoopick.training.config import (
    DEFAULT_WORKERS,
    RUN_CONFIG,
    EpochRecord,
    FinetuneConfig,
    RunEvent,
    describe,
    parse_line,
)


def write_config(cfg: FinetuneConfig) -> Path:
    """The run's config as one JSON document in its run folder (:data:`RUN_CONFIG`): what
    every worker reads (``--config``), and the record of what ran."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RUN_CONFIG
    tmp = path.with_suffix(".tmp")
    tmp.write_text(cfg.to_json())
    os.replace(tmp, path)
    return path


def parse_args(argv: list[str] | None = None) -> FinetuneConfig:
    parser = argparse.ArgumentParser(prog="python -m zoopick.training.launch", description=__doc__)
    parser.add_argument(
        "--config",
        required=True,
        type=Path,
        help="The run's FinetuneConfig as JSON (zoopick train --write-config writes one).",
    )
    args = parser.parse_args(argv)
    try:
        return FinetuneConfig.from_json(args.config.read_text())
    except OSError as exc:
        parser.error(f"--config {args.config}: {exc.strerror}")
    except ValidationError as exc:
        parser.error(f"--config {args.config}: {describe(exc)}")


def torchrun_command(config: Path, workers: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={workers}",
        "-m",
        "zoopick.training.launch",
        "--config",
        str(config),
    ]


def spawn_local(
    cfg: FinetuneConfig, *, preexec_fn: Callable[[], object] | None = None
) -> subprocess.Popen[str]:
    """Start ``cfg.max_workers`` local worker processes (under torchrun; a run of one worker is
    the one process) in their own process session; the caller reads JSON lines from
    ``proc.stdout``. ``preexec_fn`` runs in the child before torchrun
    starts (the service uses it to tie the trainer's life to its worker's)."""
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        # share the cores between CPU workers instead of oversubscribing them
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.max_workers)))
    config = write_config(cfg)
    if cfg.max_workers == 1:
        # one worker needs no launcher: the process is rank 0 of a group of one (torchrun
        # would start a second Python and import torch twice; a race's rungs are many short
        # one-worker runs)
        env.update(single_process_env())
        return start_run_process(single_process_command(config), env, preexec_fn=preexec_fn)
    return start_run_process(torchrun_command(config, cfg.max_workers), env, preexec_fn=preexec_fn)


def single_process_command(config: Path) -> list[str]:
    return [sys.executable, "-m", "zoopick.training.launch", "--config", str(config)]


def single_process_env() -> dict[str, str]:
    """What torchrun would set for the only worker of a run (``env://`` rendezvous on a free
    local port)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }


def start_run_process(
    command: list[str],
    env: dict[str, str],
    *,
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.Popen[str]:
    """A run's child process (any backend's): its own process session (stopping the group
    stops the run), unbuffered text lines on stdout and stderr."""
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
        preexec_fn=preexec_fn,
    )


def local_workers() -> int:
    """One worker per GPU, else :data:`DEFAULT_WORKERS` CPU workers."""
    import torch

    return torch.cuda.device_count() or DEFAULT_WORKERS


def run_records(proc: subprocess.Popen[str]) -> Iterator[EpochRecord | RunEvent]:
    """The epoch records and run events a running trainer prints on stdout, as they
    arrive."""
    assert proc.stdout is not None
    for line in proc.stdout:
        record = parse_line(line)
        if isinstance(record, EpochRecord | RunEvent):
            yield record


def epoch_records(proc: subprocess.Popen[str]) -> Iterator[EpochRecord]:
    """The per-epoch records alone."""
    for record in run_records(proc):
        if isinstance(record, EpochRecord):
            yield record


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    # a worker killed by a fatal signal (SIGABRT, SIGSEGV) writes every thread's Python stack
    # to stderr, which the run's log keeps: torchrun's own summary says only the signal
    faulthandler.enable(all_threads=True)
    from zoopick.training.finetune import main_worker  # torch, only in a worker process

    return main_worker(cfg)


def exit_now(code: int) -> None:
    """End a worker that has finished (its files written and closed, its process group
    destroyed) without the interpreter's finalisation: output flushed, then ``os._exit``.

    Why: a finished gloo worker sometimes died at exit with ``terminate called without an
    active exception`` (SIGABRT; 3 of about 320 service fine-tunes of the transfer suite, after
    the last epoch and the saved model, never in a rerun). That is the signature of a C++
    thread (gloo's, or torch's) dropping an object that needs the GIL while the interpreter
    is being torn down: Python then ends the thread with ``pthread_exit``, whose unwinding
    through a ``noexcept`` destructor calls ``std::terminate``. torchrun reports the whole run
    failed although its work is done. Nothing after a finished run needs finalisation (no
    ``atexit`` work of ours), so the worker skips it. A failed run raises instead and exits
    the ordinary way, with its traceback."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
