"""Uploaded datasets: where they live on disk, which formats are accepted, and validation.

Validation is the selection engine's own loader (``zoopick.selection.data.load_dataset``): a dataset
is ``ready`` exactly when the engine can read it, with its classes, per-class counts and digest
recorded; otherwise ``invalid`` with the loader's message naming the problem.

Validation also keeps the images it decoded, beside the file (``decoded/``,
``zoopick.selection.decoded``): every scoring task of every job on the dataset reads them
(:func:`for_scoring`) instead of reading and decoding the archive again, so a job of N models
costs one decode, not N.
"""

from __future__ import annotations

import logging
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from zoopick.selection import formats
from zoopick.service.db.models import Dataset, DatasetStatus
from zoopick.service.db.session import session_scope
from zoopick.service.db.types import utcnow
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)

# the formats accepted are the loader's own list (a copy here had refused .tar.bz2/.tar.xz)
format_suffix = formats.file_suffix
detect_format = formats.file_format


def safe_filename(filename: str) -> str:
    """The client's file name reduced to a harmless basename that keeps its format's suffix,
    which the loader reads the format from: the stem alone is cleaned, so ``数据.npz`` is
    stored as ``dataset.npz`` (cleaning the whole name left ``npz``, and a valid upload
    failed as of unknown format)."""
    base = re.split(r"[\\/]", filename)[-1]
    suffix = format_suffix(base)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", base[: len(base) - len(suffix)]).strip("._")
    return (stem or "dataset")[: 200 - len(suffix)] + suffix


def dataset_dir(settings: Settings, dataset_id: uuid.UUID) -> Path:
    return settings.storage_dir / "datasets" / str(dataset_id)


DECODED = "decoded"
"""The folder, beside a dataset's file, that holds its images decoded once at validation."""


def decoded_dir(path: str | Path) -> Path:
    """Where the decoded copy of the dataset file ``path`` lives."""
    return Path(path).parent / DECODED


def remove_files(settings: Settings, dataset_id: uuid.UUID) -> None:
    shutil.rmtree(dataset_dir(settings, dataset_id), ignore_errors=True)


def _counts(dataset: Any) -> dict[str, int]:
    counts = dataset.class_counts()
    names = list(dataset.class_names)
    if isinstance(counts, Mapping):
        return {str(names[k] if isinstance(k, int) else k): int(v) for k, v in counts.items()}
    return {str(name): int(n) for name, n in zip(names, list(counts), strict=True)}


def fail_validation(
    factory: sessionmaker[Session], dataset_id: uuid.UUID, settings: Settings, error: str
) -> str:
    """Mark a dataset that is not (or no longer) being validated ``invalid`` with ``error``,
    its files deleted; a dataset already ready or invalid is left as it is."""
    with session_scope(factory) as session:
        done = session.execute(
            update(Dataset)
            .where(
                Dataset.id == dataset_id,
                Dataset.status.in_([DatasetStatus.uploaded.value, DatasetStatus.validating.value]),
            )
            .values(status=DatasetStatus.invalid.value, error=error, updated_at=utcnow())
        ).rowcount
    if done:
        remove_files(settings, dataset_id)
        log.warning("dataset %s failed: %s", dataset_id, error)
    return DatasetStatus.invalid.value


def _thumbnails(loaded: Any, path: Path) -> None:
    """The dashboard's thumbnails, made here from the dataset just loaded (the API never loads
    one); a dataset without them is still ready."""
    from zoopick.service.thumbnails import write_thumbnails

    try:
        write_thumbnails(loaded, path)
    except Exception:  # noqa: BLE001 - thumbnails are a convenience, not validation
        log.warning("thumbnails of %s could not be made", path, exc_info=True)


def _keep_decoded(loaded: Any, path: Path, settings: Settings) -> None:
    """Keep the images just validated, decoded, for the scoring tasks (bounded by the
    deployment's ``max_total_bytes``, ZOOPICK_DATASET_MAX_TOTAL_BYTES: a larger copy is not
    made and scoring reads the file, as before). A dataset without it is still ready."""
    from zoopick.selection import decoded

    try:
        limit = settings.dataset_limits().max_total_bytes
        decoded.write(loaded, decoded_dir(path), max_bytes=limit)
    except Exception:  # noqa: BLE001 - a speed-up, not validation: scoring reads the file
        log.warning("the decoded copy of %s could not be made", path, exc_info=True)


def for_scoring(path: str | Path, settings: Settings) -> Any:
    """The dataset at ``path`` as a scoring task reads it (``score_max_per_class`` images a
    class at most, within the deployment's dataset limits): from the copy validation decoded
    (no archive read, no image decoded; the same digest, so the same feature-cache keys), else
    from the file itself through the loader (a dataset of arrays, one validated before copies
    were kept, one too large for a copy, or a copy over today's limits)."""
    from zoopick.selection import decoded
    from zoopick.selection.data import load_dataset

    limits = settings.dataset_limits()
    kept = decoded.load(
        decoded_dir(path), max_per_class=settings.score_max_per_class, limits=limits
    )
    if kept is not None:
        return kept
    return load_dataset(path, max_per_class=settings.score_max_per_class, limits=limits)


def validate(factory: sessionmaker[Session], dataset_id: uuid.UUID, settings: Settings) -> str:
    """Load the dataset with the selection engine, within ``settings``' dataset limits
    (checked before the memory is allocated), and record the outcome; returns the final
    status. Safe to run twice (a re-delivered task simply validates again)."""
    from zoopick.selection.data import DatasetError, load_dataset

    with session_scope(factory) as session:
        ds = session.get(Dataset, dataset_id)
        if ds is None:  # deleted meanwhile
            return "deleted"
        if ds.status in (DatasetStatus.ready.value, DatasetStatus.invalid.value):
            return ds.status  # a re-delivered task of a finished validation
        path = Path(ds.storage_path)
        session.execute(
            update(Dataset)
            .where(Dataset.id == dataset_id)
            .values(status=DatasetStatus.validating.value, error=None, updated_at=utcnow())
        )
    values: dict[str, Any]
    try:
        loaded = load_dataset(path, limits=settings.dataset_limits())
        labels = loaded.labels
        counts = _counts(loaded)  # no class is empty: min_per_class (>= 1) refuses that
        values = {
            "status": DatasetStatus.ready.value,
            "classes": [str(c) for c in loaded.class_names],
            "counts": counts,
            "num_samples": int(len(labels)),
            "digest": str(loaded.digest),
            "error": None,
        }
        _thumbnails(loaded, path)
        _keep_decoded(loaded, path, settings)
    except DatasetError as exc:
        values = {"status": DatasetStatus.invalid.value, "error": str(exc)}
    except Exception:  # noqa: BLE001 - an unreadable upload must not stay "validating"
        log.exception("validating dataset %s", dataset_id)
        # the exception's text is for the server log, not the tenant (internals, paths)
        values = {
            "status": DatasetStatus.invalid.value,
            "error": "could not read the dataset: the file is malformed in an unexpected way",
        }
    with session_scope(factory) as session:
        recorded = session.execute(
            update(Dataset).where(Dataset.id == dataset_id).values(**values, updated_at=utcnow())
        ).rowcount
    if not recorded:
        # deleted while it was validated: the delete removed the files it found, not the
        # thumbnails written since; nothing else would ever remove them (no row, no quota)
        remove_files(settings, dataset_id)
        return "deleted"
    if values["status"] == DatasetStatus.invalid.value:
        # an invalid upload is never read again: keep its row (the error), not its bytes (they
        # would count against the tenant's storage quota, and may be hostile)
        remove_files(settings, dataset_id)
    return values["status"]
