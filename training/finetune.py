"""Data-parallel fine-tuning of a zoo model on a target dataset with a sparse comm hook.

One process per worker (started by ``torchrun`` or by :func:`zoopick.training.launch.spawn_local`);
each runs :func:`run` after the process group exists. Rank 0 streams one JSON line per epoch
(loss, accuracies, bytes sent, seconds split into compute / select / communicate) to stdout and
to ``metrics.jsonl`` so the service can store the curve as it grows, writes a resumable
checkpoint every epoch, and finally the model as safetensors beside its data config.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from zoopick.selection.extract import normalise, preprocess
from zoopick.training.config import (
    CHECKPOINT,
    FINAL_CONFIG,
    FINAL_WEIGHTS,
    METRICS,
    EpochRecord,
    FinetuneConfig,
    RunEvent,
    TrainerError,
    failure_text,
    write_line,
)
from zoopick.training.progress import Reporter
from zoopick.training.race import rung_lr_factor


def _log(record: EpochRecord | RunEvent, out: Path) -> None:
    line = record.to_json()
    write_line(sys.stdout, line)
    with open(out / METRICS, "a") as fh:
        fh.write(line + "\n")


def _load_data(cfg: FinetuneConfig):
    """(train, held out): the held-out part is the test data (or split), or, for a run with
    ``validation_fraction`` (a race), a stratified share of the training split, so the test
    split is never looked at. The training split is the same either way (same seed), which is
    what lets the final fine-tune start from a race checkpoint without having seen its test
    images."""
    from zoopick.selection.data import load_dataset, load_test_data, split_dataset

    train = load_dataset(cfg.data, max_per_class=cfg.max_per_class, seed=cfg.seed)
    if cfg.test_data:
        test = load_test_data(cfg.test_data, cfg.data, train.class_names)
    else:
        train, test = split_dataset(train, cfg.test_fraction, cfg.seed)
    if cfg.validation_fraction is not None:
        return split_dataset(train, cfg.validation_fraction, cfg.seed + 1)
    return train, test


def _tensors(dataset, data_config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset through the model's eval transform, decoded once, as uint8 NCHW (1 byte a
    pixel) plus labels; normalisation happens per batch."""
    return preprocess(dataset, data_config), torch.as_tensor(dataset.labels, dtype=torch.long)


class _CommTimer:
    """Sums a hook's per-iteration stats over an epoch (bytes and select / comm seconds) as
    the difference of two snapshots of ``stats.cumulative`` (the stats keep only recent
    records, so a long epoch cannot be summed from the record list)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.mark = self._snapshot()

    def _snapshot(self) -> dict[str, float]:
        from zoopick.training.comm import sum_stats

        stats = getattr(self.state, "stats", None)
        if stats is None:
            return sum_stats([])
        stats.resolve()  # once per epoch: waits for CUDA timing events, if any
        return dict(stats.cumulative)

    def take(self) -> dict[str, float]:
        now = self._snapshot()
        total = {key: value - self.mark.get(key, 0) for key, value in now.items()}
        self.mark = now
        return total


def _evaluate(model, x, y, data_config, device, batch_size, amp) -> tuple[int, int]:
    """(correct, count) on this rank's shard."""
    model.eval()
    correct = 0
    with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=amp):
        for start in range(0, len(y), batch_size):
            xb = normalise(x[start : start + batch_size], data_config, device)
            pred = model(xb).argmax(1).cpu()
            correct += int((pred == y[start : start + batch_size]).sum())
    return correct, len(y)


def _all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


class Diverged(RuntimeError):
    """The training loss became NaN or infinite: nothing the run goes on to write (an epoch
    record, a checkpoint, the model) would be usable. (A run of NaN weights used to end with
    exit 0 and a saved model, its metrics holding bare ``NaN`` no JSON parser takes.)"""


def run(cfg: FinetuneConfig, device: torch.device | None = None) -> dict[str, Any]:
    """Fine-tune on this rank; the process group must be initialised (by torchrun's
    :func:`main_worker`, or by Ray Train in the ``ray`` backend, which passes the ``device``
    it assigned). Always wrapped in DDP with the run's comm hook, at every world size (one
    included). Returns the last epoch's record (the same on every rank)."""
    from zoopick.selection.zoo import load_zoo, save_checkpoint
    from zoopick.training.comm import make_hook
    from zoopick.training.comm.stats import dense_allreduce_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    if device is None:
        device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
    amp = device.type == "cuda"
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    report = Reporter(lambda event: _log(event, out), active=rank == 0)
    report.phase("loading data")

    entry = load_zoo(cfg.zoo)[cfg.model]
    train, test = _load_data(cfg)
    model = entry.create_model(num_classes=len(train.class_names))
    data_config = entry.data_config(model)
    x_train, y_train = _tensors(train, data_config)
    x_test, y_test = _tensors(test, data_config)
    # each rank evaluates its own contiguous shard of the test set
    lo, hi = rank * len(y_test) // world, (rank + 1) * len(y_test) // world
    x_test, y_test = x_test[lo:hi], y_test[lo:hi]

    model.to(device)
    if amp:
        model.to(memory_format=torch.channels_last)
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
    )
    state, hook = make_hook(cfg.compressor, density=cfg.density, **cfg.comm_options())
    ddp.register_comm_hook(state, hook)
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(
            ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    start_epoch = start_step = 0
    if cfg.resume and (out / CHECKPOINT).exists():
        start_epoch, start_step = _restore(out, cfg, model, opt, state, rank, world)
        if rank == 0:
            _log(RunEvent("resumed", epoch=start_epoch, workers=world), out)
    elif cfg.init_from:
        _init_from(Path(cfg.init_from), cfg, model, opt)
    timer = _CommTimer(state)

    # every rank runs the same number of equally sized batches (DDP needs it); the last
    # partial batch is dropped (a batch of one breaks batch norm)
    per_rank = len(y_train) // world
    if per_rank < 2:
        raise ValueError(f"{len(y_train)} training images cannot feed {world} workers")
    batch = min(cfg.batch_size, per_rank)
    steps = per_rank // batch
    # max_steps, when set, is the run's length (epochs then only says what a full run is)
    limit = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * steps
    epochs = -(-limit // steps)
    held = "val_accuracy" if cfg.validation_fraction is not None else "test_accuracy"
    record: EpochRecord | None = None
    for epoch in range(start_epoch, epochs):
        first = start_step if epoch == start_epoch else 0
        last = min(steps, limit - epoch * steps)  # a run with max_steps may stop mid-epoch
        if last <= first:
            break
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
        order = torch.randperm(len(y_train), generator=gen)[rank * per_rank : (rank + 1) * per_rank]
        ddp.train()
        t0 = time.perf_counter()
        report.phase("training", epoch=epoch + 1, epochs=cfg.epochs, step=first, steps=steps)
        # summed on the device: a step never waits for the GPU (a report reads them)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.float64, device=device)
        for step in range(first, last):
            idx = order[step * batch : (step + 1) * batch]
            xb = normalise(x_train[idx], data_config, device)
            if amp:
                xb = xb.contiguous(memory_format=torch.channels_last)
            yb = y_train[idx].to(device)
            if cfg.decay_from is not None:  # a race's rung anneals (training.race)
                factor = rung_lr_factor(epoch * steps + step, cfg.decay_from, limit)
                for group in opt.param_groups:
                    group["lr"] = cfg.lr * factor
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, torch.bfloat16, enabled=amp):
                logits = ddp(xb)
                loss = torch.nn.functional.cross_entropy(logits, yb)
            loss.backward()
            opt.step()
            loss_sum += loss.detach().double() * len(idx)
            correct += (logits.argmax(1) == yb).sum()
            if report.due(step, first, last):
                report.step(
                    epoch=epoch + 1,
                    epochs=cfg.epochs,
                    step=step + 1,
                    steps=steps,
                    loss_sum=loss_sum,
                    correct=correct,
                    seen=(step + 1 - first) * batch,
                )
        used = (last - first) * batch
        wall = time.perf_counter() - t0
        comm = timer.take()
        report.phase("evaluating", epoch=epoch + 1, epochs=cfg.epochs)
        test_correct, test_n = _evaluate(
            model, x_test, y_test, data_config, device, cfg.batch_size * 2, amp
        )
        totals = _all_sum(
            [float(loss_sum), float(correct), used, test_correct, test_n, comm["bytes_sent"]],
            device,
        )
        if not math.isfinite(totals[0]):  # the same sum on every rank: all of them stop
            raise Diverged(
                f"the training loss is not finite in epoch {epoch + 1} ({totals[0] / totals[2]}):"
                f" the run diverged (lr {cfg.lr}, weight_decay {cfg.weight_decay}); no model "
                "is written"
            )
        record = EpochRecord(
            epoch=epoch + 1,
            loss=totals[0] / totals[2],
            train_accuracy=totals[1] / totals[2],
            bytes_sent=totals[5] / world,  # per worker
            compute_seconds=max(wall - comm["select_s"] - comm["comm_s"], 0.0),
            select_seconds=comm["select_s"],
            comm_seconds=comm["comm_s"],
            workers=world,
            compressor=cfg.compressor,
            iterations=int(comm["iterations"]),
            dense_bytes=dense_allreduce_bytes(comm["numel"], world),
            steps=epoch * steps + last,
            **{held: totals[3] / max(totals[4], 1)},
        )
        if rank == 0:
            _log(record, out)
        finished = last == steps
        _save(out, cfg, model, opt, state, epoch + finished, 0 if finished else last, rank, world)
        if not finished:
            break
    if record is None and cfg.max_steps is not None:
        # nothing left to train (a re-delivered rung that had already finished): say where
        # the run stands, so whoever waits for this rung gets its validation accuracy
        held_correct, held_n = _evaluate(
            model, x_test, y_test, data_config, device, cfg.batch_size * 2, amp
        )
        totals = _all_sum([held_correct, held_n], device)
        record = EpochRecord(
            epoch=start_epoch + (1 if start_step else 0),
            steps=start_epoch * steps + start_step,
            workers=world,
            compressor=cfg.compressor,
            **{held: totals[0] / max(totals[1], 1)},
        )
        if rank == 0:
            _log(record, out)

    if cfg.max_steps is not None:  # a rung: its checkpoint is the product, not a model file
        dist.barrier()
        return record.to_dict() if record else {}

    # every replica must end with the same parameters (the hooks apply the same averaged
    # update on every rank): recorded, so a run whose replicas drifted apart can be told
    digests: list[str | None] = [None] * world
    dist.all_gather_object(digests, _parameter_digest(model))
    if rank == 0:
        report.phase("saving the model")
        save_checkpoint(model, out / FINAL_WEIGHTS)
        meta = {
            "rank_digests": digests,
            "arch": entry.arch,
            "source_model": entry.id,
            "num_classes": len(train.class_names),
            "class_names": list(train.class_names),
            "data_config": {
                k: list(v) if isinstance(v, tuple) else v for k, v in data_config.items()
            },
            "final": record.to_dict() if record else None,
        }
        (out / FINAL_CONFIG).write_text(json.dumps(meta, indent=2))
    dist.barrier()
    return record.to_dict() if record else {}


def _parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters, in order. Buffers are left out: batch norm's
    running statistics follow each rank's own last batches (DDP copies rank 0's at each
    forward, and the forward then updates them locally), and rank 0's are the ones saved."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in model.named_parameters():
        h.update(name.encode())
        h.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _state_file(out: Path, rank: int) -> Path:
    return out / f"comm-state-rank{rank}.pt"


def _save(out, cfg, model, opt, state, epoch, step, rank, world) -> None:
    """Model + optimizer from rank 0 (identical everywhere); each rank's error-feedback
    residuals beside it, since those differ per worker and a resumed run needs them.
    ``epoch`` epochs are complete, and ``step`` steps of the next one (a run that stopped at
    ``max_steps``)."""
    _atomic_save(state.state_dict(model), _state_file(out, rank))
    if rank == 0:
        blob = {
            "epoch": epoch,
            "step": step,
            "world": world,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "config": cfg.model_dump(mode="json"),
        }
        _atomic_save(blob, out / CHECKPOINT)
    dist.barrier()


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _restore(out, cfg, model, opt, state, rank, world) -> tuple[int, int]:
    """(epochs done, steps done of the next epoch) to continue after. The hook's residuals
    and scheme state come back too, unless the run continues on another number of workers (an
    elastic run that lost or gained one): each rank's residuals belong to its shard of the
    data, so they start from zero then, as at the start of a run."""
    blob = torch.load(out / CHECKPOINT, map_location="cpu", weights_only=False)
    changed = cfg.same_run(blob["config"])
    if changed:
        raise ValueError(f"--resume: the run's settings changed since the checkpoint: {changed}")
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    where = int(blob["epoch"]), int(blob.get("step", 0))
    if blob.get("world", world) != world:
        return where
    path = _state_file(out, rank)
    if not path.exists():
        raise ValueError(f"--resume: {path.name} is missing (was the run on more workers?)")
    state.load_state_dict(model, torch.load(path, map_location="cpu", weights_only=True))
    return where


def _init_from(path: Path, cfg: FinetuneConfig, model, opt) -> None:
    """Start from another run's checkpoint (a race winner's): its model, and its optimizer
    state (momentum, Adam's moments) when it used the same optimizer, so no step it took is
    lost; this run's own learning rate and weight decay apply from here on. The comm hook's
    residuals start from zero (the other run had its own workers)."""
    blob = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(blob["model"])
    if blob.get("config", {}).get("optimizer") == cfg.optimizer:
        opt.load_state_dict(blob["optimizer"])
        for group in opt.param_groups:
            group["lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
            if "momentum" in group:
                group["momentum"] = cfg.momentum


def main_worker(cfg: FinetuneConfig) -> int:
    """Entry point of one worker process under torchrun: init the group, run, clean up."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        run(cfg)
    except Exception as exc:
        error = TrainerError(failure_text(type(exc).__name__, str(exc)), dist.get_rank())
        write_line(sys.stderr, error.to_json())
        raise
    finally:
        dist.destroy_process_group()
        # DDP, its reducer and the hook's futures form reference cycles that hold the process
        # group and gloo's work objects: freed here, while the interpreter is whole, not by
        # its finalisation (see ``launch.exit_now``)
        gc.collect()
    return 0
