"""``/zoo``: the candidate models (everyone reads; an admin key registers)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

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
from zoopick.service import zoo_catalog
from zoopick.service.db.models import ZooModel

router = APIRouter(prefix="/zoo", tags=["zoo"])

ERRORS = responses(400, 403, 404, 409, 422)


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
        select(ZooModel),
        ZooModel,
        token=page_token,
        page_size=page_size,
        settings=settings,
        out=lambda row: zoo_out(row, caller),
    )


def check_weights(weights: str) -> None:
    if weights in ("hub", "none"):
        return
    path = Path(weights)
    if not path.is_absolute():
        raise Problem(
            422,
            f"weights {weights!r}: give 'hub', 'none' or an absolute checkpoint path on the "
            "workers' file system",
            kind="invalid-zoo-model",
        )
    if path.suffix not in (".safetensors", ".pth", ".bin", ".pt"):
        raise Problem(
            422,
            f"weights {weights!r}: a checkpoint must be .safetensors, .pth, .pt or .bin",
            kind="invalid-zoo-model",
        )


def check_arch(arch: str) -> None:
    import timm  # only here: registering a model is rare, and timm pulls in torch

    if not timm.is_model(arch):
        raise Problem(422, f"unknown timm architecture {arch!r}", kind="invalid-zoo-model")


@router.post(
    "",
    status_code=201,
    response_model=ZooModelOut,
    responses=ERRORS,
    summary="Register a model (admin)",
)
def register_model(
    body: ZooModelIn, request: Request, response: Response, admin: AdminDep, session: SessionDep
) -> ZooModelOut:
    if session.get(ZooModel, body.id) is not None:
        raise Problem(409, f"zoo model {body.id!r} already exists", kind="zoo-model-exists")
    check_weights(body.weights)
    check_arch(body.arch)
    from zoopick.selection.zoo import ZooError

    try:
        entry = zoo_catalog.check_fields(body.model_dump(exclude_none=True))
    except ZooError as exc:
        raise Problem(422, str(exc), kind="invalid-zoo-model") from None
    # the entry as checked: its checkpoint path resolved (no "..", no symbolic link), so the
    # file jobs load is the one whose shapes were checked
    row = ZooModel(id=body.id, origin="api", **zoo_catalog.row_values(entry))
    session.add(row)
    try:
        session.commit()
    except IntegrityError:  # registered concurrently
        session.rollback()
        raise Problem(
            409, f"zoo model {body.id!r} already exists", kind="zoo-model-exists"
        ) from None
    response.headers["Location"] = f"{request.url.path}/{row.id}"
    return ZooModelOut.model_validate(row)


@router.get("/{model_id}", response_model=ZooModelOut, responses=ERRORS, summary="Show a model")
def get_model(row: ZooModelDep, caller: CallerDep) -> ZooModelOut:
    return zoo_out(row, caller)
