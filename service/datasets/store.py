"""Uploaded datasets: where their files live, which formats are accepted, and validation.

A dataset's file is an object of the store (``ZOOPICK_STORAGE_URL``, ``service.storage``)
under its tenant's prefix, ``tenants/<tenant>/datasets/<id>/<file name>`` (its row's
``storage_path`` holds that key), put there as the upload streams in (``app.uploads``). A
dataset uploaded before the store has an absolute local path instead, and is still read (and
its thumbnails and decoded copy written) beside it.

Validation is the selection engine's own loader (``zoopick.selection.data.load_dataset``): a dataset
is ``ready`` exactly when the engine can read it, with its classes, per-class counts and digest
recorded; otherwise ``invalid`` with the loader's message naming the problem.

Validation also keeps the images it decoded (``decoded/``, ``zoopick.selection.decoded``) and
the dashboard's thumbnails (``thumbs/``) beside the file in the store, then writes the
dataset's ``manifest.json`` (the file's and the copy's sizes and SHA-256): every scoring task
of every job on the dataset, and the trainer, read the copy (:func:`for_scoring`,
:func:`run_data`) instead of reading and decoding the archive again, so a job of N models
costs one decode, not N. A worker reads objects as files through its machine's bounded cache
(``service.object_cache``), which checks each against the manifest's digest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from zoopick.selection import formats
from zoopick.service import storage
from zoopick.service.db.models import Dataset, DatasetStatus
from zoopick.service.db.session import session_scope
from zoopick.service.db.types import utcnow
from zoopick.service.object_cache import object_cache
from zoopick.service.settings import Settings

log = logging.getLogger(__name__)

# the formats accepted are the loader's own list (a copy here had refused .tar.bz2/.tar.xz)
format_suffix = formats.file_suffix
detect_format = formats.file_format

DECODED = "decoded"
"""The folder, beside a dataset's file, that holds its images decoded once at validation."""
MANIFEST = "manifest.json"
"""The object, beside a dataset's file, that validation writes last: the file's and the
decoded copy's sizes and SHA-256, which a worker's cache checks its copies against."""
DECODED_FILES = ("index.npz", "pixels.npy")


def safe_filename(filename: str) -> str:
    """The client's file name reduced to a harmless basename that keeps its format's suffix,
    which the loader reads the format from: the stem alone is cleaned, so ``数据.npz`` is
    stored as ``dataset.npz`` (cleaning the whole name left ``npz``, and a valid upload
    failed as of unknown format). It is a valid segment of an object key."""
    base = re.split(r"[\\/]", filename)[-1]
    suffix = format_suffix(base)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", base[: len(base) - len(suffix)]).strip("._-")
    return (stem or "dataset")[: 200 - len(suffix)] + suffix


def dataset_prefix(tenant_id: uuid.UUID, dataset_id: uuid.UUID) -> str:
    """The store prefix of a dataset's objects, under its tenant's."""
    return storage.tenant_key(tenant_id, "datasets", str(dataset_id))


def dataset_key(tenant_id: uuid.UUID, dataset_id: uuid.UUID, filename: str) -> str:
    """The key an upload of ``filename`` is stored under (its row's ``storage_path``)."""
    return f"{dataset_prefix(tenant_id, dataset_id)}/{safe_filename(filename)}"


def is_local(storage_path: str) -> bool:
    """Whether a dataset's ``storage_path`` is the absolute path of a file uploaded before the
    store (read from there), rather than a store key (never absolute)."""
    return Path(storage_path).is_absolute()


def owned_path(ds: Dataset) -> str:
    """``ds.storage_path``, checked to be under its own tenant's and dataset's prefix when it
    is a key: whatever a row says, a request never reaches another tenant's objects."""
    path = ds.storage_path
    if not is_local(path) and not path.startswith(dataset_prefix(ds.tenant_id, ds.id) + "/"):
        raise ValueError(f"dataset {ds.id}: its file {path!r} is not under its own prefix")
    return path


def dataset_dir(settings: Settings, dataset_id: uuid.UUID) -> Path:
    """The local folder of a dataset uploaded before the store (removed with it)."""
    return settings.storage_dir / "datasets" / str(dataset_id)


def decoded_dir(path: str | Path) -> Path:
    """Where the decoded copy of the local dataset file ``path`` lives (beside it)."""
    return Path(path).parent / DECODED


def _prefix(storage_path: str) -> str:
    return storage_path.rsplit("/", 1)[0]


def open_files(settings: Settings) -> storage.Store:
    return storage.open_store(settings.storage_url)


def remove_files(settings: Settings, ds: Dataset) -> None:
    """Remove a dataset's files: its objects (and this machine's copies of them), or the
    folder of a dataset from before the store. ``StoreUnavailable`` where the store cannot
    be reached (what is left is under the dataset's prefix, for an operator to remove)."""
    if is_local(ds.storage_path):
        shutil.rmtree(dataset_dir(settings, ds.id), ignore_errors=True)
        return
    prefix = dataset_prefix(ds.tenant_id, ds.id)
    store = open_files(settings)
    for key in store.list(prefix):
        store.delete(key)
    object_cache(settings).forget(prefix)


def reachable(settings: Settings, ds: Dataset) -> None:
    """``StoreUnavailable`` where the store of the dataset's files cannot be reached now (a
    delete asks before it drops the row)."""
    if not is_local(ds.storage_path):
        open_files(settings).list(dataset_prefix(ds.tenant_id, ds.id))


def remove_quietly(settings: Settings, ds: Dataset) -> None:
    """:func:`remove_files` where a failure must not hide the outcome being reported: the
    store's trouble is logged, naming what is left."""
    try:
        remove_files(settings, ds)
    except storage.StoreError as exc:
        log.error("the files of dataset %s are left in the store: %s", ds.id, exc)


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
        ds = session.get(Dataset, dataset_id)
        if ds is not None:
            session.expunge(ds)
    if done and ds is not None:
        remove_quietly(settings, ds)
        log.warning("dataset %s failed: %s", dataset_id, error)
    return DatasetStatus.invalid.value


# -- reading a dataset's files on a worker ------------------------------------------------------


def manifest(settings: Settings, storage_path: str) -> dict[str, Any] | None:
    """The manifest validation wrote beside the dataset's file in the store; None where there
    is none (not validated yet)."""
    try:
        raw = b"".join(open_files(settings).get(f"{_prefix(storage_path)}/{MANIFEST}"))
    except storage.ObjectMissing:
        return None
    return json.loads(raw)


def local_file(settings: Settings, storage_path: str, *, sha256: str, size: int) -> Path:
    """The dataset's file on this machine, whose size and SHA-256 the row recorded: a file from
    before the store where it is, else the store's object through the machine's cache."""
    if is_local(storage_path):
        return Path(storage_path)
    return object_cache(settings).fetch(storage_path, sha256=sha256, size=size)


def on_this_machine(
    settings: Settings, storage_path: str, *, file: bool = True
) -> tuple[Path | None, Path | None]:
    """(the file, the folder of its decoded copy) of a validated dataset, as files of this
    machine: beside a file from before the store, else the store's objects through the
    machine's cache, checked against the dataset's manifest. The copy is None where
    validation kept none; the file of a remote store is fetched only when ``file`` or there is
    no copy (a local store's is always given: it costs nothing). For
    workers: a store that is unavailable is tried again (``storage.retrying``) before its
    ``StoreUnavailable`` fails the work, naming it."""
    return storage.retrying(lambda: _on_this_machine(settings, storage_path, file=file))


def _on_this_machine(
    settings: Settings, storage_path: str, *, file: bool
) -> tuple[Path | None, Path | None]:
    if is_local(storage_path):
        return Path(storage_path), decoded_dir(storage_path)
    described = manifest(settings, storage_path)
    if described is None:
        raise storage.ObjectMissing(f"{_prefix(storage_path)}/{MANIFEST}")
    cache = object_cache(settings)
    folder = None
    if described.get(DECODED):
        copy = f"{_prefix(storage_path)}/{DECODED}"
        fetched = [cache.fetch(f"{copy}/{n}", **described[DECODED][n]) for n in DECODED_FILES]
        folder = fetched[0].parent
    if file or folder is None:
        return cache.fetch(storage_path, **described["file"]), folder
    return cache.store.local_path(storage_path), folder  # None for a remote store


def for_scoring(path: str | Path, settings: Settings) -> Any:
    """The dataset stored at ``path`` (its row's ``storage_path``) as a scoring task reads it
    (``score_max_per_class`` images a class at most, within the deployment's dataset limits):
    from the copy validation decoded (no archive read, no image decoded; the same digest, so
    the same feature-cache keys), else from the file itself through the loader (a dataset of
    arrays, one validated before copies were kept, one too large for a copy, or a copy over
    today's limits)."""
    from zoopick.selection import decoded
    from zoopick.selection.data import load_dataset

    limits = settings.dataset_limits()
    file, folder = on_this_machine(settings, str(path), file=False)
    if folder is not None:
        kept = decoded.load(folder, max_per_class=settings.score_max_per_class, limits=limits)
        if kept is not None:
            return kept
    if file is None:  # a copy there, but not usable today: the file after all
        file, _ = on_this_machine(settings, str(path))
    return load_dataset(file, max_per_class=settings.score_max_per_class, limits=limits)


def feature_cache(storage_path: str, settings: Settings) -> Any:
    """The shared feature cache (``service.feature_cache``) of the dataset stored at
    ``storage_path``, under its prefix (deleted with it), behind a scoring worker's local
    one; None for a dataset from before the store (the local cache alone, as then) or a
    local store."""
    from zoopick.service import feature_cache

    if is_local(storage_path):
        return None
    prefix = "/".join(storage_path.split("/")[:4])  # tenants/<tenant>/datasets/<dataset>
    return feature_cache.for_dataset(open_files(settings), prefix)


def run_data(storage_path: str, settings: Settings) -> dict[str, str | None]:
    """Where a fine-tune's or a race rung's trainer, started on this machine, reads the
    dataset: ``data`` (its file) and ``decoded`` (the copy validation decoded, or None), as
    ``FinetuneConfig`` takes them, files of this machine. A copy the trainer can read under
    the deployment's limits (those its run config carries) is all it reads: the file of a
    remote store is then not fetched (``data`` names where its copy would be); else the
    file, and no copy."""
    from zoopick.selection import decoded

    file, folder = on_this_machine(settings, storage_path, file=False)
    if folder is not None and decoded.load(folder, limits=settings.dataset_limits()) is None:
        folder = None
    if folder is None and file is None:
        file, _ = on_this_machine(settings, storage_path)
    if file is None:  # not fetched: the trainer reads the copy
        file = object_cache(settings).root / storage_path
    return {"data": str(file), "decoded": None if folder is None else str(folder)}


def _thumbs_where(settings: Settings, ds: Dataset) -> tuple[str, storage.Store | None]:
    from zoopick.service.thumbnails import FOLDER

    path = owned_path(ds)
    if is_local(path):
        return str(Path(path).parent / FOLDER), None
    return f"{dataset_prefix(ds.tenant_id, ds.id)}/{FOLDER}", open_files(settings)


def thumbnails_of(settings: Settings, ds: Dataset) -> dict[str, list[str]]:
    """The dataset's thumbnails, ``{class name: [file, ...]}`` (``service.thumbnails``), read
    from its own prefix only. ``StoreUnavailable`` where the store cannot say."""
    from zoopick.service.thumbnails import thumbnails

    return thumbnails(*_thumbs_where(settings, ds))


def thumbnail_of(settings: Settings, ds: Dataset, file: str) -> Path | bytes | None:
    """One of the dataset's thumbnails (a local file, or its bytes from a remote store), or
    None; only names its index lists, under its own prefix."""
    from zoopick.service.thumbnails import thumbnail

    where, store = _thumbs_where(settings, ds)
    return thumbnail(where, file, store)


# -- validation ---------------------------------------------------------------------------------


def _thumbnails(loaded: Any, ds: Dataset, settings: Settings) -> None:
    """The dashboard's thumbnails, made here from the dataset just loaded (the API never loads
    one); a dataset without them is still ready."""
    from zoopick.service.thumbnails import FOLDER, put_thumbnails, write_thumbnails

    try:
        if is_local(ds.storage_path):
            write_thumbnails(loaded, Path(ds.storage_path).parent / FOLDER)
            return
        with _scratch(settings) as folder:
            write_thumbnails(loaded, folder)
            prefix = f"{dataset_prefix(ds.tenant_id, ds.id)}/{FOLDER}"
            put_thumbnails(folder, open_files(settings), prefix)
    except Exception:  # noqa: BLE001 - thumbnails are a convenience, not validation
        log.warning("thumbnails of dataset %s could not be made", ds.id, exc_info=True)


def _keep_decoded(loaded: Any, ds: Dataset, settings: Settings) -> dict[str, Any] | None:
    """Keep the images just validated, decoded, for the scoring tasks (bounded by the
    deployment's ``max_total_bytes``, ZOOPICK_DATASET_MAX_TOTAL_BYTES: a larger copy is not
    made and scoring reads the file, as before); what the manifest records of it, or None.
    A dataset without it is still ready."""
    from zoopick.selection import decoded

    limit = settings.dataset_limits().max_total_bytes
    try:
        if is_local(ds.storage_path):
            decoded.write(loaded, decoded_dir(ds.storage_path), max_bytes=limit)
            return None
        with _scratch(settings) as folder:
            if not decoded.write(loaded, folder / DECODED, max_bytes=limit):
                return None
            store, prefix = open_files(settings), dataset_prefix(ds.tenant_id, ds.id)
            kept = {}
            for name in DECODED_FILES:
                stored = store.put_file(
                    f"{prefix}/{DECODED}/{name}", folder / DECODED / name, move=True
                )
                kept[name] = {"sha256": stored.sha256, "size": stored.size}
            return kept
    except Exception:  # noqa: BLE001 - a speed-up, not validation: scoring reads the file
        log.warning("the decoded copy of dataset %s could not be made", ds.id, exc_info=True)
        return None


@contextlib.contextmanager
def _scratch(settings: Settings) -> Iterator[Path]:
    """A fresh folder of this machine's scratch (``<data_dir>/scratch``), removed after."""
    path = settings.data_dir / "scratch" / uuid.uuid4().hex
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _write_manifest(ds: Dataset, settings: Settings, kept: dict[str, Any] | None) -> None:
    """The dataset's manifest, last (tried again while the store is unavailable)."""
    if is_local(ds.storage_path):
        return
    body = {
        "file": {"sha256": ds.file_sha256, "size": ds.size_bytes},
        DECODED: kept,
    }
    key = f"{dataset_prefix(ds.tenant_id, ds.id)}/{MANIFEST}"
    data = json.dumps(body).encode()
    storage.retrying(lambda: open_files(settings).put(key, [data]))


def validate(factory: sessionmaker[Session], dataset_id: uuid.UUID, settings: Settings) -> str:
    """Load the dataset with the selection engine, within ``settings``' dataset limits
    (checked before the memory is allocated), and record the outcome; returns the final
    status. Safe to run twice (a re-delivered task simply validates again). A store that
    cannot be read raises ``StoreUnavailable`` (the dataset stays ``validating``: the sweeper
    sends its validation again)."""
    from zoopick.selection.data import DatasetError, load_dataset

    with session_scope(factory) as session:
        ds = session.get(Dataset, dataset_id)
        if ds is None:  # deleted meanwhile
            return "deleted"
        if ds.status in (DatasetStatus.ready.value, DatasetStatus.invalid.value):
            return ds.status  # a re-delivered task of a finished validation
        session.execute(
            update(Dataset)
            .where(Dataset.id == dataset_id)
            .values(status=DatasetStatus.validating.value, error=None, updated_at=utcnow())
        )
        session.expunge(ds)
    values: dict[str, Any]
    try:
        path = local_file(settings, ds.storage_path, sha256=ds.file_sha256, size=ds.size_bytes)
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
        _thumbnails(loaded, ds, settings)
        _write_manifest(ds, settings, _keep_decoded(loaded, ds, settings))
    except DatasetError as exc:
        values = {"status": DatasetStatus.invalid.value, "error": str(exc)}
    except storage.StoreUnavailable:
        raise
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
        remove_quietly(settings, ds)
        return "deleted"
    if values["status"] == DatasetStatus.invalid.value:
        # an invalid upload is never read again: keep its row (the error), not its bytes (they
        # would count against the tenant's storage quota, and may be hostile)
        remove_quietly(settings, ds)
    return values["status"]
