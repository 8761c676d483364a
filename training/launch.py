"""Launch fine-tuning workers.

``python -m zoopick.training.launch --zoo Z --model ID --data D --out O ...`` is one worker: run it
under ``torchrun`` (one process per GPU with NCCL, or CPU processes with gloo). ``spawn_local``
starts ``torchrun --standalone`` for N local workers, which is what ``zoopick train`` and the
service's training task do; across machines, run torchrun yourself (see README).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import fields

from zoopick.training.config import DEFAULT_WORKERS, EpochRecord, FinetuneConfig, parse_line


def config_to_args(cfg: FinetuneConfig) -> list[str]:
    """The worker command-line arguments that rebuild ``cfg``."""
    args: list[str] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                args.append(flag)
        elif value is None:
            continue
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def parse_args(argv: list[str] | None = None) -> FinetuneConfig:
    defaults = FinetuneConfig(zoo="", model="", data="", out="")
    parser = argparse.ArgumentParser(prog="python -m zoopick.training.launch", description=__doc__)
    for f in fields(FinetuneConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        elif isinstance(default, dict):
            parser.add_argument(flag, type=json.loads, default={})
        elif f.name in ("zoo", "model", "data", "out"):
            parser.add_argument(flag, required=True)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name == "max_per_class":
                kind = int
            parser.add_argument(flag, type=kind, default=default)
    return FinetuneConfig(**vars(parser.parse_args(argv)))


def torchrun_command(cfg: FinetuneConfig, workers: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={workers}",
        "-m",
        "zoopick.training.launch",
        *config_to_args(cfg),
    ]


def spawn_local(
    cfg: FinetuneConfig,
    workers: int | None = None,
    *,
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.Popen[str]:
    """Start ``workers`` local worker processes (default: one per GPU, else 2 CPU workers) in
    their own process session; the caller reads JSON lines from ``proc.stdout``.
    ``preexec_fn`` runs in the child before torchrun starts (the service uses it to tie the
    trainer's life to its worker's)."""
    import torch

    if workers is None:
        workers = torch.cuda.device_count() or DEFAULT_WORKERS
    if workers < 1:
        raise ValueError("workers must be >= 1")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        # share the cores between CPU workers instead of oversubscribing them
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.Popen(
        torchrun_command(cfg, workers),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )


def epoch_records(proc: subprocess.Popen[str]) -> Iterator[EpochRecord]:
    """The per-epoch records a running trainer prints on stdout, as they arrive."""
    assert proc.stdout is not None
    for line in proc.stdout:
        record = parse_line(line)
        if isinstance(record, EpochRecord):
            yield record


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    from zoopick.training.finetune import main_worker  # torch, only in a worker process

    return main_worker(cfg)


if __name__ == "__main__":
    sys.exit(main())
