"""Race candidates trained by the service's own trainer, as a job's rungs train them.

``pool.Pool`` trains candidates with the benchmark's plain loop (Adam at a fixed rate), the
race before issue 39's recipe. A job's rungs now run zoopick's trainer
(``zoopick.training.finetune.run``) on a :class:`~zoopick.training.config.FinetuneConfig`
built by ``workers.tasks.race_step``: the job's fine-tune options as the race takes them
(``service.race.race_options``: one worker, the dense hook), ``max_steps`` the rung's step
count, ``decay_from`` the step the rung starts at (``service.race.rung_start``) and the
selection's validation share. With every option at its default that is the ``auto`` recipe's
rung (``training.recipe.plan(..., rung=True)``): AdamW (weight decay 0.01) at the recipe's
default rate 1e-3, the head at the body's rate, label smoothing 0.1, each rung annealed down a
cosine. This module builds that config with the service's own functions and runs the trainer
in this process (a gloo process group of one), so the benchmark measures the race a job runs,
not a copy of it. Nothing here re-implements a training step.

The same trainer, with ``"finetune": {}`` and no rung, gives :func:`default_finetune`: the
service's default fine-tune of one model, the truth the race is judged against
(``service_run.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from zoopick.training import race

TRAINER_RULES = ("accuracy",)
"""Scores a trainer pool can judge a rung by: the service's (the trainer reports a rung's
validation accuracy; the paired rules' per-image scores are the plain loop's, ``pool.py``)."""


def process_group() -> None:
    """A gloo process group of one in this process, as the trainer needs (once)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


def service_job(finetune: Mapping[str, Any] | None = None, rungs: Sequence[race.Rung] = ()):
    """A job row (never stored) as the service holds one: its ``finetune`` body (``{}``: every
    option at its default) and its race's rungs, so the service's own functions read it."""
    from zoopick.service.db.models import Job
    from zoopick.training.config import FinetuneOptions

    # stored as a submission stores it (validated, every field): a body read back without its
    # recipe field would be taken for a job from before the recipe (FinetuneOptions.stored)
    body = FinetuneOptions(**finetune).model_dump(mode="json") if finetune else {}
    plan = [
        {"candidates": r.candidates, "steps_each": r.steps_each, "total_steps": r.total_steps}
        for r in rungs
    ]
    return Job(finetune=body, race={"rungs": plan})


def options(finetune: Mapping[str, Any] | None = None):
    """How a job's race trains every candidate, and (the same object) how its default fine-tune
    runs on one worker: ``service.race.race_options`` of a job with this ``finetune`` body."""
    from zoopick.service.race import race_options

    return race_options(service_job(finetune))


def rung_config(
    job: Any,
    *,
    level: int,
    zoo: Path,
    model: str,
    data: Path,
    test_data: Path | None,
    out: Path,
    validation_fraction: float,
):
    """A candidate's config for rung ``level`` of ``job``'s race, as ``race_step`` builds it:
    the race's options, the rung's steps (``max_steps``), the step its rate starts to anneal
    from (``decay_from``), the selection's validation share, resuming the candidate's run."""
    from zoopick.service.race import race_options, rung_start
    from zoopick.training.config import CHECKPOINT, FinetuneConfig

    r = job.race["rungs"][level]
    return FinetuneConfig.for_run(
        race_options(job),
        zoo=str(zoo),
        model=model,
        data=str(data),
        test_data=None if test_data is None else str(test_data),
        out=str(out),
        resume=(out / CHECKPOINT).exists(),
        max_steps=int(r["total_steps"]),
        decay_from=rung_start(job, level),
        validation_fraction=validation_fraction,
    )


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The trainer's per-epoch lines (it writes them to stdout for the service) kept out of
    the benchmark's log; they are in the run folder's ``metrics.jsonl``."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


class TrainerPool:
    """The shortlist's candidates under one plan, each trained rung by rung by the service's
    trainer in its own run folder (a rung resumes the candidate's checkpoint, as a job's
    does); trained only as far as some rule needs them, like ``pool.Pool``.
    :meth:`outputs` returns a candidate's validation accuracy after rung ``r`` (the trainer's
    own record) and the steps that rung's segment took (the trainer's count)."""

    def __init__(
        self,
        root: Path,
        target: str,
        rungs: Sequence[race.Rung],
        work: Path,
        *,
        validation_fraction: float,
        finetune: Mapping[str, Any] | None = None,
    ) -> None:
        self.root, self.target, self.rungs = root, target, list(rungs)
        self.work = work
        self.validation_fraction = validation_fraction
        self.job = service_job(finetune, self.rungs)
        self.seen: dict[tuple[str, int], tuple[float, int]] = {}
        self.reached: dict[str, int] = {}
        self.steps = 0
        self.seconds = 0.0
        self.configs: list[Any] = []
        """Every config the pool ran, in order (what a test reads)."""

    def config(self, model_id: str, rung: int):
        return rung_config(
            self.job,
            level=rung,
            zoo=self.root / "zoo.json",
            model=model_id,
            data=self.root / "targets" / f"{self.target}-train.npz",
            test_data=self.root / "targets" / f"{self.target}-test.npz",
            out=self.work / model_id,
            validation_fraction=self.validation_fraction,
        )

    def outputs(self, model_id: str, rung: int) -> tuple[float, int]:
        from zoopick.training.finetune import run

        key = (model_id, rung)
        if key not in self.seen:
            if rung > 0 and (model_id, rung - 1) not in self.seen:
                self.outputs(model_id, rung - 1)
            before = self.reached.get(model_id, 0)
            target_steps = self.rungs[rung].total_steps
            assert before == target_steps - self.rungs[rung].steps_each, "rungs in order"
            cfg = self.config(model_id, rung)
            self.configs.append(cfg)
            process_group()
            t0 = time.perf_counter()
            with quiet():
                record = run(cfg)
            self.seconds += time.perf_counter() - t0
            taken = int(record["steps"]) - before
            assert int(record["steps"]) == target_steps, (record["steps"], target_steps)
            self.reached[model_id] = int(record["steps"])
            self.seen[key] = (float(record["val_acc"]), taken)
            self.steps += taken
        return self.seen[key]

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def default_finetune(
    root: Path, model_id: str, target: str, out: Path, finetune: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The service's default fine-tune of one model on one target (a job's ``"finetune":
    {}``, on the race's one worker): its test accuracy, what the recipe chose, and its compute
    in optimizer steps (the run's, and the rate search's trials)."""
    from zoopick.training.config import FINAL_CONFIG, FinetuneConfig
    from zoopick.training.finetune import run

    cfg = FinetuneConfig.for_run(
        options(finetune),
        zoo=str(root / "zoo.json"),
        model=model_id,
        data=str(root / "targets" / f"{target}-train.npz"),
        test_data=str(root / "targets" / f"{target}-test.npz"),
        out=str(out),
    )
    process_group()
    t0 = time.perf_counter()
    with quiet():
        final = run(cfg)
    seconds = time.perf_counter() - t0
    choices = json.loads((out / FINAL_CONFIG).read_text())["recipe"]
    plan = choices["plan"]
    search = len(choices["trials"]) * int(plan["trial_steps"])
    return {
        "acc": float(final["test_acc"]),
        "steps": int(final["steps"]),
        "search_steps": search,
        "cost_steps": int(final["steps"]) + search,
        "planned_steps": int(plan["steps"]),
        "lr": float(choices["lr"]),
        "lr_source": plan["lr_source"],
        "trials": choices["trials"],
        "best_step": choices["best_step"],
        "stopped_early": bool(choices["stopped_early"]),
        "seconds": round(seconds, 2),
    }
