"""``/zoo``: the candidate models (everyone reads; an admin key registers)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy import select

from zoopick.app.api import pagination
from zoopick.app.api.deps import (
    AdminDep,
    Caller,
    CallerDep,
    SessionDep,
    SettingsDep,
    ZooModelDep,
)
from zoopick.app.api.schemas import Page, ZooModelIn, ZooModelOut
from zoopick.app.problems import Problem, responses
from zoopick.service import storage, zoo_admin, zoo_catalog
from zoopick.service.db.models import ZooModel
from zoopick.service.jobs import Rejected

router = APIRouter(prefix="/zoo", tags=["zoo"])

ERRORS = responses(400, 403, 404, 409, 422, 503)

STATUS_OF_KIND = {zoo_admin.EXISTS: 409, zoo_admin.INVALID: 422}
"""HTTP status of each ``jobs.Rejected`` kind ``zoo_admin`` raises."""


HIDDEN_WEIGHTS = "checkpoint"


def zoo_out(row: ZooModel, caller: Caller) -> ZooModelOut:
    """A zoo entry as ``caller`` may see it: a checkpoint's server path only for admins (a
    tenant learns that the model has local weights, not where the server keeps its files)."""
    out = ZooModelOut.model_validate(row)
    if not caller.admin and out.weights not in ("hub", "none"):
        out.weights = HIDDEN_WEIGHTS
    return out


@router.get("", response_model=Page[ZooModelOut], responses=ERRORS, summary="List the zoo")
def list_zoo(
    caller: CallerDep,
    session: SessionDep,
    settings: SettingsDep,
    page_size: Annotated[int | None, Query(ge=1)] = None,
    page_token: str | None = None,
) -> dict:
    return pagination.list_page(
        session,
        select(ZooModel).where(zoo_catalog.listed()),
        ZooModel,
        token=page_token,
        page_size=page_size,
        settings=settings,
        out=lambda row: zoo_out(row, caller),
    )


def with_data_config(row: ZooModel, caller: Caller) -> ZooModelOut:
    """``zoo_out`` with timm's resolved data config (imports timm: single-model views only)."""
    out = zoo_out(row, caller)
    out.data_config = zoo_catalog.data_config(row)
    return out


@router.post(
    "",
    status_code=201,
    response_model=ZooModelOut,
    responses=ERRORS,
    summary="Register a model (admin)",
)
def register_model(
    body: ZooModelIn,
    request: Request,
    response: Response,
    admin: AdminDep,
    session: SessionDep,
    settings: SettingsDep,
) -> ZooModelOut:
    """Add a model to the zoo (``service.zoo_admin.register``, the dashboard's zoo form's
    use case too). The answer carries timm's data config for it. A checkpoint in a store
    (``s3://bucket/key``) is read here to check it: 503 ``store-unavailable``, naming the
    store's error, where it cannot be read."""
    try:
        row = zoo_admin.register(session, body.model_dump(exclude_none=True), settings)
    except Rejected as exc:
        raise Problem(STATUS_OF_KIND[exc.kind], exc.detail, kind=exc.kind) from None
    except storage.StoreUnavailable as exc:  # an admin reads the store's own words (a
        # bucket misspelt, credentials refused), where a tenant's 503 names nothing
        retry = {"Retry-After": str(settings.retry_after_seconds)}
        raise Problem(503, str(exc), kind="store-unavailable", headers=retry) from None
    response.headers["Location"] = f"{request.url.path}/{row.id}"
    return with_data_config(row, admin)


@router.get("/{model_id}", response_model=ZooModelOut, responses=ERRORS, summary="Show a model")
def get_model(row: ZooModelDep, caller: CallerDep) -> ZooModelOut:
    """One model, with the data config timm resolves for it."""
    return with_data_config(row, caller)


@router.delete("/{model_id}", status_code=204, responses=ERRORS, summary="Remove a model (admin)")
def remove_model(row: ZooModelDep, admin: AdminDep, session: SessionDep) -> Response:
    """Take the model out of the zoo: no list shows it and no new job may name it. Jobs that
    used it keep their results and downloads, and one submitted before still runs with it;
    its id stays taken (past jobs name it). A manifest model stays out at the next start:
    take it out of the manifest as well."""
    zoo_admin.remove(session, row)
    return Response(status_code=204)
