"""``/datasets``: upload (streamed to storage), validate, list, show, delete."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from zoopick.app.api import pagination
from zoopick.app.api.deps import CallerDep, DatasetDep, DispatcherDep, SessionDep, SettingsDep
from zoopick.app.api.schemas import DatasetOut, Page, pattern_of
from zoopick.app.problems import Problem, responses
from zoopick.app.uploads import UNCAPPED_BODY, receive_file
from zoopick.selection import formats
from zoopick.service import datasets as store
from zoopick.service import pipeline, quotas
from zoopick.service.db.models import Dataset, DatasetStatus
from zoopick.service.settings import Settings

router = APIRouter(prefix="/datasets", tags=["datasets"])

ERRORS = responses(400, 404, 409, 413, 415, 422)

UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": ".npz (x/y) or an ImageFolder archive "
                            f"({formats.listed(formats.ARCHIVE_SUFFIXES)}: one sub-folder "
                            "per class)",
                        },
                        "name": {"type": "string", "description": "Default: the file name."},
                    },
                }
            }
        },
    }
}


@router.post(
    "",
    status_code=202,
    response_model=DatasetOut,
    responses={201: {"model": DatasetOut, "description": "Validated in the request"}, **ERRORS},
    openapi_extra=UPLOAD_BODY,
    summary="Upload a dataset",
    max_body_size=UNCAPPED_BODY,
)
async def upload_dataset(
    request: Request,
    caller: CallerDep,
    session: SessionDep,
    settings: SettingsDep,
    dispatcher: DispatcherDep,
) -> Response:
    """Stream the file to storage, then validate it with the selection engine's loader.

    Answers 202 with the dataset in status ``uploaded`` while a cpu worker validates it (poll
    ``GET /datasets/{id}`` until ``ready`` or ``invalid``); a deployment that validates in the
    request answers 201 with a ready dataset, or 422 naming what is wrong with the file.
    """
    request.app.state.rate.check("uploads", str(caller.key_id), "uploads")
    room = await run_in_threadpool(quota_room, session, caller.tenant_id, settings)
    dataset_id = uuid.uuid4()
    folder = store.dataset_dir(settings, dataset_id)
    try:
        # the body streams in as slowly as the client likes: meanwhile the request holds no
        # database connection and no session slot (a few slow uploads must not starve the API)
        async with request.state.session_slot.released(session):
            upload = await receive_file(
                request,
                folder / "upload.part",
                max_bytes=min(settings.upload_max_bytes, room),
                too_large=None if room >= settings.upload_max_bytes else quota_exceeded(settings),
            )
        fmt = store.detect_format(upload.filename)
        if fmt is None:
            raise Problem(
                415,
                f"unsupported file {upload.filename!r}: expected {formats.listed()}",
                kind="unsupported-format",
            )
        if upload.size == 0:
            raise Problem(422, "the uploaded file is empty", kind="invalid-dataset")
        name = (upload.fields.get("name") or "").strip() or upload.filename
        path = folder / store.safe_filename(upload.filename)
        upload.path.rename(path)
        ds = Dataset(
            id=dataset_id,
            tenant_id=caller.tenant_id,
            name=name[:200],
            format=fmt,
            filename=upload.filename[:255],
            size_bytes=upload.size,
            file_sha256=upload.sha256,
            storage_path=str(path),
            status=DatasetStatus.uploaded.value,
        )
        await run_in_threadpool(insert_within_quota, session, ds, settings)
    except BaseException:
        await run_in_threadpool(store.remove_files, settings, dataset_id)
        raise

    location = {"Location": f"{request.url.path}/{dataset_id}"}
    if settings.validate_inline:
        status = await run_in_threadpool(
            store.validate, request.app.state.sessionmaker, dataset_id, settings
        )
        session.expire_all()
        ds = session.get(Dataset, dataset_id)
        if status == DatasetStatus.invalid.value:
            error = ds.error or "not a dataset"
            session.delete(ds)
            session.commit()
            await run_in_threadpool(store.remove_files, settings, dataset_id)
            raise Problem(422, f"not a usable dataset: {error}", kind="invalid-dataset")
        body = DatasetOut.model_validate(ds).model_dump(mode="json")
        return JSONResponse(body, status_code=201, headers=location)
    try:
        dispatcher.validate_dataset(str(dataset_id))
    except Exception as exc:  # noqa: BLE001 - the broker is down: do not keep a dead upload
        session.delete(ds)
        session.commit()
        await run_in_threadpool(store.remove_files, settings, dataset_id)
        raise Problem(
            503, f"could not queue validation: {exc}", kind="broker-unavailable"
        ) from None
    body = DatasetOut.model_validate(ds).model_dump(mode="json")
    headers = {**location, "Retry-After": str(settings.retry_after_seconds)}
    return JSONResponse(body, status_code=202, headers=headers)


def quota_exceeded(settings: Settings, what: str = "bytes") -> Problem:
    limit = (
        f"{settings.quota_datasets} datasets (ZOOPICK_QUOTA_DATASETS)"
        if what == "datasets"
        else f"{settings.quota_bytes} bytes (ZOOPICK_QUOTA_BYTES)"
    )
    return Problem(
        413,
        f"storage quota exceeded: a tenant may keep {limit}; delete datasets to make room",
        kind="storage-quota",
    )


def quota_room(session: Session, tenant_id: uuid.UUID, settings: Settings) -> int:
    """Bytes this tenant may still upload (413 naming the quota when nothing is left)."""
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


@router.get("", response_model=Page[DatasetOut], responses=ERRORS, summary="List datasets")
def list_datasets(
    caller: CallerDep,
    session: SessionDep,
    settings: SettingsDep,
    page_size: Annotated[int | None, Query(ge=1)] = None,
    page_token: str | None = None,
    status: Annotated[str | None, Query(pattern=pattern_of(DatasetStatus))] = None,
) -> dict:
    stmt = select(Dataset).where(Dataset.tenant_id == caller.tenant_id)
    if status:
        stmt = stmt.where(Dataset.status == status)
    return pagination.list_page(
        session,
        stmt,
        Dataset,
        token=page_token,
        page_size=page_size,
        settings=settings,
        out=DatasetOut.model_validate,
    )


@router.get("/{dataset_id}", response_model=DatasetOut, responses=ERRORS, summary="Show a dataset")
def get_dataset(ds: DatasetDep) -> DatasetOut:
    return DatasetOut.model_validate(ds)


@router.delete("/{dataset_id}", status_code=204, responses=ERRORS, summary="Delete a dataset")
def delete_dataset(ds: DatasetDep, session: SessionDep, settings: SettingsDep) -> Response:
    """Delete the dataset and its files; refused (409) while a job still uses it. Finished
    jobs keep their results, with ``dataset_id`` cleared. Checked and deleted under the
    tenant's lock, the one a job's submission inserts under: a job submitted meanwhile either
    counts here (409) or finds the dataset gone (422), never a job on a deleted dataset."""
    with quotas.tenant_lock(session, ds.tenant_id):
        active = pipeline.active_jobs_for_dataset(session, ds.id)
        if active:
            session.rollback()
            raise Problem(
                409,
                f"dataset is used by {active} unfinished job(s); cancel them first",
                kind="dataset-in-use",
            )
        session.delete(ds)
        session.commit()
    store.remove_files(settings, ds.id)
    return Response(status_code=204)
