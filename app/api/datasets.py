"""``/datasets``: upload (streamed into the store), validate, list, show, delete.

A thin adapter: the upload's body is received here (HTTP streaming), admitting it (format,
quota, insert, validation) is ``service.datasets.admission``'s, as deleting one is."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from zoopick.app.api import pagination
from zoopick.app.api.deps import (
    Caller,
    CallerDep,
    DatasetDep,
    DispatcherDep,
    SessionDep,
    SettingsDep,
)
from zoopick.app.api.jobs import store_down
from zoopick.app.api.schemas import DatasetOut, Page, pattern_of
from zoopick.app.problems import Problem, responses
from zoopick.app.uploads import UNCAPPED_BODY, receive_file
from zoopick.selection import formats
from zoopick.service import storage
from zoopick.service.datasets import admission, store
from zoopick.service.db.models import Dataset, DatasetStatus
from zoopick.service.dispatch import Dispatcher
from zoopick.service.jobs import Rejected
from zoopick.service.settings import Settings

router = APIRouter(prefix="/datasets", tags=["datasets"])

ERRORS = responses(400, 404, 409, 413, 415, 422, 503)

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
    """Stream the file into the store, then validate it with the selection engine's loader.

    Answers 202 with the dataset in status ``uploaded`` while a cpu worker validates it (poll
    ``GET /datasets/{id}`` until ``ready`` or ``invalid``); a deployment that validates in the
    request answers 201 with a ready dataset, or 422 naming what is wrong with the file.
    """
    admitted = await receive_and_admit(request, caller, session, settings, dispatcher)
    ds = admitted.dataset
    body = DatasetOut.model_validate(ds).model_dump(mode="json")
    headers = {"Location": f"{request.url.path}/{ds.id}"}
    if admitted.validated:
        return JSONResponse(body, status_code=201, headers=headers)
    headers["Retry-After"] = str(settings.retry_after_seconds)
    return JSONResponse(body, status_code=202, headers=headers)


STATUS_OF_KIND = {
    "storage-quota": 413,
    "unsupported-format": 415,
    "dataset-in-use": 409,
    "broker-unavailable": 503,
}
"""HTTP status of each refusal of ``service.datasets.admission``; every other kind is a 422
(the file is not a usable dataset)."""


def problem(exc: Rejected) -> Problem:
    """A dataset use case's refusal as the API's problem document."""
    return Problem(STATUS_OF_KIND.get(exc.kind, 422), exc.detail, kind=exc.kind)


async def receive_and_admit(
    request: Request,
    caller: Caller,
    session: Session,
    settings: Settings,
    dispatcher: Dispatcher,
) -> admission.Admitted:
    """The HTTP half of an upload, for both faces (this router and the dashboard's form):
    the caller's upload rate, the room its quota leaves, the body streamed into the store
    (``app.uploads``, under the tenant's prefix); then ``admission.admit``, the use case.
    Refusals are :class:`Problem`; a store that is down answers 503 with ``Retry-After``,
    nothing of the upload kept."""
    request.app.state.rate.check("uploads", str(caller.key_id), "uploads")
    try:
        room = await run_in_threadpool(admission.quota_room, session, caller.tenant_id, settings)
    except Rejected as exc:
        raise problem(exc) from None
    dataset_id = uuid.uuid4()
    full = None if room >= settings.upload_max_bytes else admission.quota_exceeded(settings)
    try:
        # the body streams in as slowly as the client likes: meanwhile the request holds no
        # database connection and no session slot (a few slow uploads must not starve the API)
        async with request.state.session_slot.released(session):
            received = await receive_file(
                request,
                storage.open_store(settings.storage_url),
                lambda filename: store.dataset_key(caller.tenant_id, dataset_id, filename),
                max_bytes=min(settings.upload_max_bytes, room),
                too_large=None if full is None else problem(full),
            )
        upload = admission.Upload(
            dataset_id=dataset_id,
            key=received.key,
            filename=received.filename,
            size=received.size,
            sha256=received.sha256,
            name=received.fields.get("name"),
        )
        return await run_in_threadpool(
            admission.admit,
            session,
            request.app.state.sessionmaker,
            caller.tenant_id,
            upload,
            settings,
            dispatcher,
        )
    except Rejected as exc:
        raise problem(exc) from None
    except storage.StoreUnavailable as exc:
        raise store_down(exc, settings) from None


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
    jobs keep their results, with ``dataset_id`` cleared (``admission.delete``); 503 while
    the store is down (nothing deleted)."""
    try:
        admission.delete(session, ds, settings)
    except Rejected as exc:
        raise problem(exc) from None
    except storage.StoreUnavailable as exc:
        raise store_down(exc, settings) from None
    return Response(status_code=204)
