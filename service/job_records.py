"""A job as its owner keeps it: its name, tags and notes (set at submission, edited later),
the list's search by them, and deleting a finished job with its files.

Why apart from ``service.jobs``: these touch no job's work (no task, no status), only what
its owner wrote and, once it is over, what it left behind.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field
from sqlalchemy import Select, String, cast, func, or_, select
from sqlalchemy import update as update_rows
from sqlalchemy.orm import Session

from zoopick.service import exports, storage
from zoopick.service.db.models import TERMINAL, Artefact, Job, TrainingRun
from zoopick.service.db.types import utcnow
from zoopick.service.inputs import NoNulModel
from zoopick.service.jobs import TAGS_DESCRIPTION, JobName, Notes, Rejected, Tags
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)

ORDERS = ("newest", "oldest")
"""How the list may be ordered: both keep its keyset pages (``created_at``, ``id``)."""


class JobPatch(NoNulModel):
    """``PATCH /jobs/{id}``: the fields given replace the job's (``null`` clears a name or
    notes, ``[]`` the tags); a field left out is kept."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: JobName | None = Field(None, description="The job's name; null clears it.")
    tags: Tags | None = Field(None, description=TAGS_DESCRIPTION + " Replaces the job's.")
    notes: Notes | None = Field(None, description="Free text; null clears it.")


def update(session: Session, job: Job, patch: JobPatch) -> Job:
    """Apply ``patch`` (any job, finished or not: the words are its owner's). Moves
    ``updated_at``, which a kept view of a finished job is keyed on."""
    given = patch.model_dump(exclude_unset=True)
    if not given:
        raise Rejected("empty-patch", "give at least one of name, tags, notes")
    if given.get("tags") is not None:
        given["tags"] = list(dict.fromkeys(given["tags"]))
    elif "tags" in given:
        given["tags"] = []
    session.execute(update_rows(Job).where(Job.id == job.id).values(**given, updated_at=utcnow()))
    session.commit()
    session.refresh(job)
    return job


def _json_text(value: str) -> str:
    """``value`` as the JSON column stores it (quotes and ``\\u`` escapes included)."""
    return json.dumps(value)


def search(stmt: Select[tuple[Job]], q: str | None, tag: str | None) -> Select[tuple[Job]]:
    """``stmt`` narrowed to jobs whose name or a tag contains ``q`` (any case), and that
    carry the tag ``tag`` exactly. The tags are matched in the column's JSON text, the same
    on PostgreSQL and SQLite."""
    tags_text = cast(Job.tags, String)
    if q:
        needle = q.strip().lower()
        in_tags = func.lower(tags_text).contains(_json_text(needle)[1:-1], autoescape=True)
        stmt = stmt.where(or_(func.lower(Job.name).contains(needle, autoescape=True), in_tags))
    if tag:
        stmt = stmt.where(tags_text.contains(_json_text(tag.strip()), autoescape=True))
    return stmt


def delete(session: Session, job: Job, settings: Settings) -> None:
    """Delete a finished job: its row (scores, runs, artefacts and deliveries go with it) and
    its files (the trainer's runs, the model and its exports, in the storage folder and the
    store). Refused (``job-not-finished``) while it runs: cancel it first. The files go after
    the row, so a failure to remove one leaves a file behind, never a job without its files."""
    if job.status not in TERMINAL:
        raise Rejected("job-not-finished", f"job is {job.status}; cancel it first, then delete it")
    folders = {settings.storage_dir / "jobs" / str(job.id)}
    folders |= {Path(p) for p in session.scalars(
        select(TrainingRun.output_dir).where(TrainingRun.job_id == job.id)
    )}  # fmt: skip
    files = [a.path for a in session.scalars(select(Artefact).where(Artefact.job_id == job.id))]
    tenant, job_id = job.tenant_id, job.id
    session.delete(job)
    session.commit()
    for key in files:  # a model made before the store: a file, its exports beside it
        if Path(key).is_absolute():
            Path(key).unlink(missing_ok=True)
            folders.add(exports.export_dir(key))
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    _remove_stored(settings, tenant, job_id)


def _remove_stored(settings: Settings, tenant: uuid.UUID, job_id: uuid.UUID) -> None:
    """The job's objects in the store (a store that is down keeps them: logged)."""
    try:
        store = storage.open_store(settings.storage_url)
        folder = storage.tenant_key(tenant, "jobs", str(job_id))
        for key in store.list(folder):
            store.delete(key)
    except storage.StoreUnavailable as exc:
        log.error("job %s deleted, its stored files not: %s", job_id, exc)


def ordered(order: str | None) -> Literal["newest", "oldest"]:
    """The list's order, or a ``Rejected`` naming the ones there are."""
    if order in (None, "", "newest"):
        return "newest"
    if order == "oldest":
        return "oldest"
    raise Rejected("unknown-order", f"unknown order {order!r}; one of {', '.join(ORDERS)}")
