"""A dataset's use cases: admit an upload (format, quota, insert, then validate in the request or
queue its validation) and delete one. The REST router (``app/api/datasets.py``) and the dashboard
(``app/dashboard/pages.py``) receive the file (HTTP streaming, ``app.uploads``) and call these,
so both faces admit a dataset the same way, in one place.

A refusal raises ``service.jobs.Rejected`` with a ``kind`` (the HTTP face maps it to a status:
``storage-quota`` 413, ``unsupported-format`` 415, ``invalid-dataset`` 422, ``dataset-in-use``
409, ``broker-unavailable`` 503) and a message naming the problem. Whatever is refused, the
files received for it are removed: a refused upload keeps no bytes in the store. A store that
is down raises ``storage.StoreUnavailable`` (the HTTP face answers 503).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from zoopick.selection import formats
from zoopick.service import pipeline, quotas, storage
from zoopick.service.datasets import store
from zoopick.service.db.models import Dataset, DatasetStatus
from zoopick.service.dispatch import Dispatcher
from zoopick.service.jobs import Rejected
from zoopick.service.settings import Settings


def quota_exceeded(settings: Settings, what: str = "bytes") -> Rejected:
    """The refusal of an upload over the tenant's storage quota, naming the setting."""
    limit = (
        f"{settings.quota_datasets} datasets (ZOOPICK_QUOTA_DATASETS)"
        if what == "datasets"
        else f"{settings.quota_bytes} bytes (ZOOPICK_QUOTA_BYTES)"
    )
    return Rejected(
        "storage-quota",
        f"storage quota exceeded: a tenant may keep {limit}; delete datasets to make room",
    )


def quota_room(session: Session, tenant_id: uuid.UUID, settings: Settings) -> int:
    """Bytes this tenant may still upload (refused, naming the quota, when nothing is left).
    Read before the upload streams in, so a full tenant is refused before sending its bytes."""
    count, used = quotas.stored(session, tenant_id)
    session.rollback()  # end the read transaction before the (long) upload
    if count >= settings.quota_datasets:
        raise quota_exceeded(settings, "datasets")
    if used >= settings.quota_bytes:
        raise quota_exceeded(settings)
    return settings.quota_bytes - used


def insert_within_quota(session: Session, ds: Dataset, settings: Settings) -> None:
    """Insert ``ds`` if the tenant's quota still holds, counted under the tenant's lock (two
    uploads that each fit alone must not both be kept when together they do not)."""
    with quotas.tenant_lock(session, ds.tenant_id):
        count, used = quotas.stored(session, ds.tenant_id)
        if count + 1 > settings.quota_datasets:
            session.rollback()
            raise quota_exceeded(settings, "datasets")
        if used + ds.size_bytes > settings.quota_bytes:
            session.rollback()
            raise quota_exceeded(settings)
        session.add(ds)
        session.commit()


@dataclass(frozen=True)
class Upload:
    """A file a face received for dataset ``dataset_id``, stored under ``key``
    (``store.dataset_key``): the client's file name, the optional ``name`` field, its size and
    sha256 as they streamed in."""

    dataset_id: uuid.UUID
    key: str
    filename: str
    size: int
    sha256: str
    name: str | None = None


@dataclass(frozen=True)
class Admitted:
    """An admitted dataset: ``validated`` when the request validated it (it is ``ready``),
    else its validation is queued (``uploaded``: poll it)."""

    dataset: Dataset
    validated: bool


def admit(
    session: Session,
    factory: sessionmaker[Session],
    tenant_id: uuid.UUID,
    upload: Upload,
    settings: Settings,
    dispatcher: Dispatcher,
) -> Admitted:
    """Check the received file's format, keep it within the tenant's quota, then validate it
    here (``ZOOPICK_VALIDATE_INLINE``) or queue its validation. A refusal removes its files."""
    try:
        ds = _insert(session, tenant_id, upload, settings)
    except BaseException:
        store.remove_quietly(settings, _received(tenant_id, upload))
        raise
    if settings.validate_inline:
        try:
            status = store.validate(factory, ds.id, settings)
        except storage.StoreUnavailable:
            session.expire_all()
            _forget(session, ds, settings)
            raise
        session.expire_all()
        ds = session.get(Dataset, upload.dataset_id)
        if status == DatasetStatus.invalid.value:
            error = ds.error or "not a dataset"
            _forget(session, ds, settings)
            raise Rejected("invalid-dataset", f"not a usable dataset: {error}")
        return Admitted(ds, validated=True)
    try:
        dispatcher.validate_dataset(str(ds.id))
    except Exception as exc:  # noqa: BLE001 - the broker is down: do not keep a dead upload
        _forget(session, ds, settings)
        raise Rejected("broker-unavailable", f"could not queue validation: {exc}") from None
    return Admitted(ds, validated=False)


def _insert(session: Session, tenant_id: uuid.UUID, upload: Upload, settings: Settings) -> Dataset:
    fmt = store.detect_format(upload.filename)
    if fmt is None:
        raise Rejected(
            "unsupported-format",
            f"unsupported file {upload.filename!r}: expected {formats.listed()}",
        )
    if upload.size == 0:
        raise Rejected("invalid-dataset", "the uploaded file is empty")
    name = (upload.name or "").strip() or upload.filename
    ds = Dataset(
        id=upload.dataset_id,
        tenant_id=tenant_id,
        name=name[:200],
        format=fmt,
        filename=upload.filename[:255],
        size_bytes=upload.size,
        file_sha256=upload.sha256,
        storage_path=upload.key,
        status=DatasetStatus.uploaded.value,
    )
    insert_within_quota(session, ds, settings)
    return ds


def _received(tenant_id: uuid.UUID, upload: Upload) -> Dataset:
    """The row an upload not yet inserted would have, as far as its files go."""
    return Dataset(id=upload.dataset_id, tenant_id=tenant_id, storage_path=upload.key)


def _forget(session: Session, ds: Dataset, settings: Settings) -> None:
    """Drop a dataset that was not admitted after all: its row and its files (a store that is
    down meanwhile leaves them, logged)."""
    session.delete(ds)
    session.commit()
    store.remove_quietly(settings, ds)


def delete(session: Session, ds: Dataset, settings: Settings) -> None:
    """Delete the dataset and its files; refused (``dataset-in-use``) while a job still uses
    it. Finished jobs keep their results, with ``dataset_id`` cleared. Checked and deleted
    under the tenant's lock, the one a job's submission inserts under: a job submitted
    meanwhile either counts here or finds the dataset gone, never a job on a deleted
    dataset. A store that is down is found before the row goes (``StoreUnavailable``: nothing
    deleted); one that fails after it leaves the files, logged."""
    with quotas.tenant_lock(session, ds.tenant_id):
        active = pipeline.active_jobs_for_dataset(session, ds.id)
        if active:
            session.rollback()
            raise Rejected(
                "dataset-in-use",
                f"dataset is used by {active} unfinished job(s); cancel them first",
            )
        try:
            store.reachable(settings, ds)
        except storage.StoreUnavailable:
            session.rollback()
            raise
        session.delete(ds)
        session.commit()
    store.remove_quietly(settings, ds)
