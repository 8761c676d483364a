"""A finished job with a race and a fine-tune, written row by row as the service writes them.

Why not run one: a real race and fine-tune take minutes of both cores, and the poll's cost
depends only on what the rows hold, not on how they got there. So this writes them through
the service's own writers (``pipeline.upsert_scores``, ``race.plan_for``,
``pipeline.open_run``, ``pipeline.record_epoch``, ``pipeline.record_run_event`` with the
trainer's progress and recipe events) at the sizes a real run leaves: ``EPOCHS`` epochs of
``training.progress.POINTS_PER_EPOCH`` sub-epoch points each (so the stored curve is at its
bound, ``service.progress.MAX_POINTS``, halved once), a recipe with its learning-rate
search, a race of three shortlisted models over two rungs, and the job's scores.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

EPOCHS = 40
"""A long fine-tune: 40 epochs x 10 progress points fills the run's curve to its bound."""
STEPS_PER_EPOCH = 50


def zoo_and_dataset(session: Session, tenant_id: uuid.UUID, models: list[str],
                    num_classes: int) -> uuid.UUID:  # fmt: skip
    """The rows a job stands on: ``models`` as zoo entries and a ready two-class dataset of
    1,000 images whose file is never read (a poll reads only rows); the dataset's id."""
    from zoopick.service.db.models import Dataset, ZooModel

    for m in models:
        session.add(ZooModel(id=m, arch="test_resnet", weights="none", num_classes=num_classes))
    ds = Dataset(
        tenant_id=tenant_id, name="d", format="npz", filename="d.npz", size_bytes=1,
        file_sha256="0" * 64, storage_path="/nonexistent", status="ready",
        classes=["a", "b"], counts={"a": 500, "b": 500}, num_samples=1000,
        digest="d" * 16,
    )  # fmt: skip
    session.add(ds)
    session.flush()
    return ds.id


def build(session: Session, tenant_id: uuid.UUID, dataset_id: uuid.UUID,
          models: list[str]) -> uuid.UUID:  # fmt: skip
    """The job's id: succeeded, its race won by ``models[0]``, fine-tuned for ``EPOCHS``."""
    from zoopick.service import pipeline, race
    from zoopick.service.db.models import Dataset, Job, JobStatus, RaceEntry
    from zoopick.service.db.types import utcnow
    from zoopick.service.jobs import FinetuneOptions
    from zoopick.training.config import EpochRecord, FinetuneConfig, RunEvent
    from zoopick.training.race import SelectionOptions

    options = FinetuneOptions(epochs=EPOCHS, workers=1, compressor="dense")
    selection = SelectionOptions(shortlist=3)
    metrics = ["sms", "isms", "logme"]
    start = utcnow() - timedelta(hours=1)
    job = Job(
        tenant_id=tenant_id, dataset_id=dataset_id, status=JobStatus.succeeded.value,
        progress=1.0, request={"dataset_id": str(dataset_id), "models": models,
                               "finetune": options.model_dump(mode="json"),
                               "selection": selection.model_dump(mode="json")},
        models=models, metrics=metrics, select_by="isms", task_ids=[],
        finetune=options.model_dump(mode="json"), selection=selection.model_dump(mode="json"),
        chosen_model=models[0], created_at=start, started_at=start, finished_at=utcnow(),
    )  # fmt: skip
    session.add(job)
    session.flush()
    for i, m in enumerate(models):
        values = {k: 1.0 - 0.1 * i - 0.01 * j for j, k in enumerate(metrics)}
        pipeline.upsert_scores(session, job.id, m, values, {k: 0.5 for k in metrics})
    # the race: its plan as race.start records it, two rungs of settled candidates
    counts = session.get(Dataset, dataset_id).counts
    shortlist = models[: selection.shortlist]
    plan = race.plan_for(selection, race.race_options(job), counts)
    entries: list[RaceEntry] = []
    alive = list(shortlist)
    for index, rung in enumerate(plan["rungs"]):
        for k, m in enumerate(alive[: rung["candidates"]]):
            entries.append(RaceEntry(
                job_id=job.id, model_id=m, rung=index, status="done",
                target_steps=rung["total_steps"], steps=rung["total_steps"],
                reached_steps=rung["total_steps"], val_accuracy=0.8 - 0.05 * k,
                loss=0.5 + 0.1 * k, seconds=12.5, attempts=1,
            ))  # fmt: skip
        alive = alive[: max(1, rung["candidates"] // 2)]
    session.add_all(entries)
    winner_steps = plan["rungs"][-1]["total_steps"]
    record: dict[str, Any] = {
        **plan, "shortlist": shortlist, "rung": len(plan["rungs"]) - 1, "winner": models[0],
        "why": f"best validation accuracy (0.800) after {winner_steps} steps",
        "spent_steps": sum(e.steps or 0 for e in entries),
    }  # fmt: skip
    session.execute(update(Job).where(Job.id == job.id).values(race=record))
    # the fine-tune: the run's config as the task stores it, its events and its epochs
    config = FinetuneConfig.for_run(
        options, zoo="/srv/zoo.json", model=models[0], data="/srv/data.npz", out="/srv/run",
        resume=False, init_from="/srv/race/checkpoint.pt",
    )  # fmt: skip
    run = pipeline.open_run(session, job, models[0], config.model_dump(mode="json"), 1, "/srv")
    run_id = run.id
    trials = [{"lr": 1e-4 * 2**i, "val_accuracy": 0.5 + 0.03 * i, "val_loss": 1.0 - 0.05 * i}
              for i in range(8)]  # fmt: skip
    chosen = {"plan": {"recipe": "auto", "steps": EPOCHS * STEPS_PER_EPOCH, "warmup_steps": 100,
                       "optimizer": "adamw", "weight_decay": 0.05, "label_smoothing": 0.1,
                       "augment": False, "lr_source": "search", "candidates": 8},
              "lr": 8e-4, "trials": trials, "best_step": 1900, "best_val_accuracy": 0.84,
              "stopped_early": False, "search_seconds": 30.0}  # fmt: skip
    pipeline.record_run_event(session, run_id, RunEvent("recipe", recipe=chosen))
    every = STEPS_PER_EPOCH // 10
    for epoch in range(1, EPOCHS + 1):
        for step in range(every, STEPS_PER_EPOCH, every):
            event = RunEvent("progress", phase="training", host="worker-1", epoch=epoch,
                             epochs=EPOCHS, step=step, steps=STEPS_PER_EPOCH,
                             loss=1.0 / (epoch + step / STEPS_PER_EPOCH),
                             train_acc=0.5)  # fmt: skip
            pipeline.record_run_event(session, run_id, event)
        pipeline.record_epoch(session, run_id, EpochRecord(
            epoch=epoch, loss=1.0 / epoch, train_accuracy=0.5 + epoch / 100,
            test_accuracy=0.5 + epoch / 110, bytes_sent=4.0e6, compute_seconds=1.2,
            select_seconds=0.0, comm_seconds=0.1, workers=1, compressor="dense",
            iterations=STEPS_PER_EPOCH, dense_bytes=4.0e6, val_accuracy=0.5 + epoch / 105,
            steps=epoch * STEPS_PER_EPOCH,
        ))  # fmt: skip
    session.flush()
    pipeline.finish_run(session, job.id, "succeeded", None)
    return job.id
