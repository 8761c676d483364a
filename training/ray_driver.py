"""The ``ray`` backend's driver: one fine-tune run on a Ray cluster with Ray Train.

``python -m zoopick.training.ray_driver --config <out>/run.json --address HOST:PORT`` connects
to the cluster, runs :func:`zoopick.training.finetune.run` in ``cfg.workers`` Ray Train workers
(``TorchTrainer``: gang-scheduled across the cluster's machines, one GPU each where the
cluster has GPUs, else CPU processes with gloo), and prints what the local backend prints:
rank 0's epoch records as they are written (sent to this process through a Ray queue:
:class:`Inbox`), ``{"event": "started", "backend": "ray", "ref": <job id>}`` once connected,
and a ``{"error": ...}`` line on stderr when the run fails. Each worker writes in a private
folder of its machine; ``--inputs`` names the caller's hook that fetches the run's input
files onto that machine (the service's reads them from its store), else the config's paths
are read as given.

A lost worker or node is Ray's to handle (``FailureConfig(max_failures)``): it restarts the
worker group, and each new worker continues from the run's last checkpoint in Ray's storage
(model, optimizer, every rank's residuals and scheme state; rank 0 prints a ``resumed``
event).
Stopping this process ends its Ray job, and Ray removes the job's actors with it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlparse

from zoopick.training.backends import PLACEMENTS, Backend, hook_of, ray_address_problem
from zoopick.training.config import (
    CHECKPOINT,
    COMM_STATE,
    FINAL_CONFIG,
    FINAL_WEIGHTS,
    METRICS,
    FinetuneConfig,
    RunEvent,
    TrainerError,
    failure_text,
    write_line,
)

RUN_NAME = "ray"
"""The run's folder under Ray's storage path (Ray Train's run name)."""


class _Poller:
    """A daemon thread that calls :meth:`poll` every ``interval`` seconds until :meth:`finish`,
    which stops it and polls once more (what came last is handed on too)."""

    name = "poller"

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def poll(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def finish(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()


class MetricsFollower(_Poller):
    """Hands the lines appended to a run's ``metrics.jsonl`` to ``sink`` as they appear
    (complete lines only; the lines already there when it starts are not repeated). Rank 0
    of a Ray run follows its own private folder's file and sends each line to the driver."""

    name = "metrics-follower"

    def __init__(self, path: Path, sink: Callable[[str], object], interval: float = 0.25) -> None:
        super().__init__(interval)
        self.path, self.sink = path, sink
        self.offset = path.stat().st_size if path.exists() else 0
        self.partial = ""

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
                self.sink(line)


class Inbox(_Poller):
    """The run's lines on their way from rank 0, wherever it runs, to this driver: a Ray
    queue, printed on stdout as they arrive. No file is shared between the machines. The
    queue is an actor on the cluster's head node (Ray's ``node:__internal_head__``
    resource, as Ray Serve places its controller), which outlives any training node: a
    lost node must not take the run's lines with it."""

    HEAD = "node:__internal_head__"
    name = "run-lines"

    def __init__(self, interval: float = 0.25) -> None:
        from ray.util.queue import Queue

        super().__init__(interval)
        self.queue = Queue(actor_options={"num_cpus": 0, "resources": {self.HEAD: 0.001}})
        self.lost = False

    def poll(self) -> None:
        from ray.util.queue import Empty

        if self.lost:
            return
        try:
            lines = self.queue.get_nowait_batch(self.queue.qsize())
        except Empty:  # another poll took them
            return
        except Exception as exc:  # noqa: BLE001 - the queue is gone (its node with it)
            self.lost = True
            print(f"the run's lines are lost: {failure_reason(exc)}", file=sys.stderr)
            return
        try:
            for line in lines:
                write_line(sys.stdout, line)
        except BrokenPipeError:  # whoever followed the run is gone (zoopick train stopped):
            os._exit(1)  # the run ends with this process, and Ray removes its actors


def _send(queue: Any) -> Callable[[str], None]:
    """Rank 0's sink: one line to the driver's :class:`Inbox` (a line that cannot be sent,
    the driver gone, is dropped: the run's checkpoints are in storage either way)."""

    def send(line: str) -> None:
        with contextlib.suppress(Exception):  # whatever Ray raised: the run goes on
            queue.put(line, timeout=30)

    return send


def _product(rank: int) -> list[str]:
    """The files of this rank a checkpoint holds: its comm hook's state, and on rank 0 the
    run's checkpoint and, once written, the fine-tuned model. Ray merges every rank's into
    one checkpoint folder in its storage."""
    names = [COMM_STATE.format(rank=rank)]
    return [*names, CHECKPOINT, FINAL_WEIGHTS, FINAL_CONFIG] if rank == 0 else names


def _report(folder: Path, rank: int, metrics: dict[str, Any]) -> None:
    """``ray.train.report``: ``metrics`` and this rank's part of the checkpoint (every rank
    calls it, as Ray requires)."""
    import ray.train
    from ray.train import Checkpoint

    with tempfile.TemporaryDirectory(prefix="zoopick-ray-ckpt-") as tmp:
        for name in _product(rank):
            if (folder / name).is_file():
                shutil.copy2(folder / name, Path(tmp) / name)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))


def _restore(checkpoint: Any, folder: Path, rank: int) -> bool:
    """Copy this rank's part of Ray's latest checkpoint (after a restarted worker group, or a
    run started again on the same storage) into its folder; whether there was one."""
    if checkpoint is None:
        return False
    with checkpoint.as_directory() as where:
        src = Path(where)
        if not (src / CHECKPOINT).is_file():
            return False
        for name in (CHECKPOINT, COMM_STATE.format(rank=rank)):
            if (src / name).is_file():
                shutil.copy2(src / name, folder / name)
    return True


def _placed(cfg: FinetuneConfig, inputs: str | None, folder: Path) -> FinetuneConfig:
    """The run's config with its input files on this machine: the caller's hook
    (``Backend.inputs``: it fetches them, e.g. from a store, beside ``folder``), else as
    given (a folder every machine shares)."""
    if inputs is None:
        return cfg
    module, function, spec = hook_of(inputs)
    hook = getattr(importlib.import_module(module), function)
    return hook(cfg, spec, folder)


def _train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: Ray initialised the process group (gloo, or NCCL on GPUs) and
    picked the device. The run's files are written in a private folder of this machine;
    each epoch's checkpoint goes to Ray's storage (``ray.train.report``), and a restarted
    worker continues from the latest one there (``ray.train.get_checkpoint``). Rank 0's
    lines go to the driver through its :class:`Inbox`."""
    import ray.train
    import ray.train.torch
    import torch

    from zoopick.training.finetune import run

    cfg = FinetuneConfig.from_json(config["config"])
    rank = ray.train.get_context().get_world_rank()
    folder = Path(tempfile.mkdtemp(prefix="zoopick-ray-run-"))
    follower = None
    try:
        resume = _restore(ray.train.get_checkpoint(), folder, rank)
        cfg = _placed(cfg.model_copy(update={"out": str(folder)}), config.get("inputs"), folder)
        if rank == 0:
            follower = MetricsFollower(folder / METRICS, _send(config["lines"])).start()
        device = ray.train.torch.get_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        run(
            cfg.model_copy(update={"resume": resume}),
            device=device,
            checkpointed=lambda record: _report(folder, rank, record.to_dict()),
        )
        _report(folder, rank, {"done": True})  # the product: the model (or a rung's state)
    finally:
        if follower is not None:
            follower.finish()
        shutil.rmtree(folder, ignore_errors=True)


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


STORE_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
)  # fmt: skip
"""The standard variables of an S3 store's client: an inputs hook reads the store with them."""


def _worker_env(start_timeout: float, inputs: str | None = None) -> dict[str, str]:
    """The environment Ray gives the run's processes on every machine: the controller's
    start timeout and, where an inputs hook fetches the run's files (``Backend.inputs``),
    this machine's store variables (``AWS_*``), so the pool's machines need none of their
    own. The trainer's switches travel in its config (``FinetuneConfig``), not in the
    environment, so Ray's processes on other machines get them as a local run's do."""
    env = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(start_timeout)}
    if inputs is not None:
        env.update({k: os.environ[k] for k in STORE_VARIABLES if os.environ.get(k)})
    return env


def _clear_stale_run(out: Path) -> None:
    """A run in its run folder that does not resume starts over (as the local backend
    does): Ray's checkpoints of an earlier run there (and the files a run before this
    backend kept) must not be taken for its own."""
    for path in [out / CHECKPOINT, *out.glob(COMM_STATE.format(rank="*"))]:
        path.unlink(missing_ok=True)
    shutil.rmtree(out / RUN_NAME, ignore_errors=True)


def storage(url: str | None, out: Path) -> tuple[str, Any]:
    """(Ray Train's ``storage_path``, its ``storage_filesystem``): the run folder (None) or
    another absolute path (every machine must share them), or an ``s3://bucket/key`` folder through
    pyarrow's S3 file system (which Ray Train uses), from the standard ``AWS_*`` variables.
    The file system travels to the workers with its settings: they need no variables."""
    if url is None:
        return str(out), None
    if not url.startswith("s3://"):
        return url, None  # a folder every machine shares
    from pyarrow.fs import S3FileSystem

    parsed = urlparse(url)
    options: dict[str, Any] = {}
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        options.update(access_key=key, secret_key=secret)
        if os.environ.get("AWS_SESSION_TOKEN"):
            options["session_token"] = os.environ["AWS_SESSION_TOKEN"]
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        where = urlparse(endpoint)
        options.update(endpoint_override=where.netloc or where.path, scheme=where.scheme or "https")
    return f"{parsed.netloc}/{parsed.path.strip('/')}", S3FileSystem(**options)


def arguments() -> argparse.ArgumentParser:
    """The driver's flags (``backends.spawn`` passes each of them; the defaults are
    ``Backend``'s)."""
    parser = argparse.ArgumentParser(prog="python -m zoopick.training.ray_driver")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--address", required=True, help="The Ray cluster (HOST:PORT).")
    parser.add_argument("--placement", choices=PLACEMENTS, default=Backend.placement)
    parser.add_argument("--max-failures", type=int, default=Backend.max_failures)
    parser.add_argument(
        "--storage",
        help="Where Ray keeps the run's checkpoints: s3://bucket/key or a shared folder.",
    )
    parser.add_argument(
        "--inputs",
        help="How each worker gets the run's input files on its machine (Backend.inputs): "
        '{"hook": "module:function", "spec": {...}}; unset: the paths as given.',
    )
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
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
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
            runtime_env={"env_vars": _worker_env(args.start_timeout, args.inputs)},
        )
    except Exception as exc:  # noqa: BLE001 - whatever Ray raised, the job says where
        return _fail(f"cannot reach {where}: {failure_reason(exc)}")

    if args.storage is None and not cfg.resume:
        _clear_stale_run(out)
    # a run in the store is the job's own (its key is the job's): a driver started again
    # for it (a re-delivered task, on any machine) continues from its latest checkpoint
    storage_path, filesystem = storage(args.storage, out)
    inbox = Inbox()
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
        train_loop_config={"config": cfg.to_json(), "lines": inbox.queue, "inputs": args.inputs},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=use_gpu, placement_strategy=args.placement
        ),
        run_config=RunConfig(
            name=RUN_NAME,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            checkpoint_config=CheckpointConfig(num_to_keep=1),
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
    inbox.start()
    try:
        result = trainer.fit()
    except Exception as exc:  # noqa: BLE001 - the run failed: say why, in the run's words
        return _fail(failure_reason(exc))
    finally:
        inbox.finish()  # the last epochs' lines come out before the error or the exit
    if result.checkpoint is not None:  # the product, into the run folder on this machine
        result.checkpoint.to_directory(str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
