"""The ``ray`` backend's driver: one fine-tune run on a Ray cluster with Ray Train.

``python -m zoopick.training.ray_driver --config <out>/run.json --address HOST:PORT`` connects
to the cluster, runs :func:`zoopick.training.finetune.run` in ``cfg.workers`` Ray Train workers
(``TorchTrainer``: gang-scheduled across the cluster's machines, one GPU each where the
cluster has GPUs, else CPU processes with gloo), and prints what the local backend prints:
rank 0's epoch records as they are written (it follows ``<out>/metrics.jsonl``, on the
folder every machine shares), ``{"event": "started", "backend": "ray", "ref": <job id>}``
once connected, and a ``{"error": ...}`` line on stderr when the run fails.

A lost worker or node is Ray's to handle (``FailureConfig(max_failures)``): it restarts the
worker group, and each new worker continues from the run's last checkpoint in ``<out>`` (model,
optimizer, every rank's residuals and scheme state; rank 0 prints a ``resumed`` event).
Stopping this process ends its Ray job, and Ray removes the job's actors with it.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

from zoopick.training.backends import PLACEMENTS, Backend, ray_address_problem
from zoopick.training.config import (
    CHECKPOINT,
    METRICS,
    FinetuneConfig,
    RunEvent,
    TrainerError,
    failure_text,
    write_line,
)


class MetricsFollower:
    """Copies the lines appended to a run's ``metrics.jsonl`` to stdout as they appear
    (complete lines only; the lines already there when it starts are not repeated)."""

    def __init__(self, path: Path, interval: float = 0.25) -> None:
        self.path = path
        self.interval = interval
        self.offset = path.stat().st_size if path.exists() else 0
        self.partial = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-follower", daemon=True)

    def start(self) -> MetricsFollower:
        self._thread.start()
        return self

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as fh:
            fh.seek(self.offset)
            text = fh.read()
            self.offset = fh.tell()
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            if line.strip():
                write_line(sys.stdout, line)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def finish(self) -> None:
        """Stop following, after copying what was written last."""
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()


def _train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: Ray initialised the process group (gloo, or NCCL on GPUs) and
    picked the device; the run continues from ``<out>``'s checkpoint when one is there (a
    restart after a lost worker)."""
    import ray.train.torch
    import torch

    from zoopick.training.finetune import run

    cfg = FinetuneConfig.from_json(config["config"])
    resume = (Path(cfg.out) / CHECKPOINT).exists()
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    run(cfg.model_copy(update={"resume": resume}), device=device)


def _fail(message: str) -> int:
    write_line(sys.stderr, TrainerError(message).to_json())
    return 1


def failure_reason(exc: BaseException) -> str:
    """The worker's own error out of Ray's wrapping (its last ``SomeError: message`` line),
    else Ray's message."""
    text = str(exc)
    for line in reversed(text.splitlines()):
        head, sep, rest = line.strip().partition(": ")
        named = head.isidentifier() and head.endswith(("Error", "Exception"))
        if sep and named:
            return failure_text(head, rest)
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _worker_env(start_timeout: float) -> dict[str, str]:
    """The environment Ray gives the run's processes on every machine: the controller's
    start timeout. The trainer's switches travel in its config (``FinetuneConfig``), not in
    the environment, so Ray's processes on other machines get them as a local run's do."""
    return {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(start_timeout)}


def _clear_stale_checkpoint(out: Path) -> None:
    """A run that does not resume starts over (as the local backend does): a checkpoint
    left in its folder must not be taken for one of its own by a restarted worker."""
    for path in [out / CHECKPOINT, *out.glob("comm-state-rank*.pt")]:
        path.unlink(missing_ok=True)


def arguments() -> argparse.ArgumentParser:
    """The driver's flags (``backends.spawn`` passes each of them; the defaults are
    ``Backend``'s)."""
    parser = argparse.ArgumentParser(prog="python -m zoopick.training.ray_driver")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--address", required=True, help="The Ray cluster (HOST:PORT).")
    parser.add_argument("--placement", choices=PLACEMENTS, default=Backend.placement)
    parser.add_argument("--max-failures", type=int, default=Backend.max_failures)
    parser.add_argument(
        "--start-timeout",
        type=int,
        default=Backend.start_timeout,
        help="Seconds Ray waits for the machines of a (re)start of the workers.",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    cfg = FinetuneConfig.from_json(args.config.read_text())
    # Ray runs each worker in a folder of its own: every path must be absolute
    cfg = cfg.with_absolute_paths()
    out = Path(cfg.out)

    where = f"the Ray cluster at {args.address} (ZOOPICK_RAY_ADDRESS)"
    problem = ray_address_problem(args.address)
    if problem:
        return _fail(f"cannot reach {where}: {problem}")
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        return _fail("the ray backend needs Ray Train: pip install 'zoopick[ray]'")
    try:
        ray.init(
            address=args.address,
            log_to_driver=False,
            logging_level="WARNING",
            # read by the run's controller actor: how long one start of the worker group may
            # wait for machines (see the failure config below)
            runtime_env={"env_vars": _worker_env(args.start_timeout)},
        )
    except Exception as exc:  # noqa: BLE001 - whatever Ray raised, the job says where
        return _fail(f"cannot reach {where}: {failure_reason(exc)}")

    if not cfg.resume:
        _clear_stale_checkpoint(out)
    follower = MetricsFollower(out / METRICS)
    write_line(
        sys.stdout,
        RunEvent("started", backend="ray", ref=ray.get_runtime_context().get_job_id()).to_json(),
    )
    use_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    # elastic: Ray starts as many workers as the cluster can place, within the range, and
    # restarts with fewer (down to min) when a machine is lost
    lo, hi = cfg.min_workers, cfg.max_workers
    workers = (lo, hi) if lo < hi else hi
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"config": cfg.to_json()},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=use_gpu, placement_strategy=args.placement
        ),
        run_config=RunConfig(
            name="ray",
            storage_path=str(out),
            # max_failures: lost workers or nodes. A start that found too few machines counts
            # too when the run needs all of its workers (else it would wait forever for a
            # machine that is gone); an elastic run goes on with fewer once Ray sees the
            # lost machine dead, so its starts may time out while Ray finds that out
            failure_config=FailureConfig(
                max_failures=args.max_failures,
                controller_failure_limit=-1 if lo < hi else args.max_failures,
            ),
        ),
    )
    follower.start()
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - the run failed: say why, in the run's words
        return _fail(failure_reason(exc))
    finally:
        follower.finish()  # the last epochs' lines come out before the error or the exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
