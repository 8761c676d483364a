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
        select(ZooModel).where(zoo_catalog.listed()),
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


def with_data_config(row: ZooModel, caller: Caller) -> ZooModelOut:
    """``zoo_out`` with timm's resolved data config (imports timm: single-model views only)."""
    out = zoo_out(row, caller)
    out.data_config = zoo_catalog.data_config(row)
    return out


def resolved_fields(body: ZooModelIn) -> dict:
    """The body as the manifest rules take it: arch as timm's registry name (a hub name
    mapped, a pretrained tag checked), the id defaulting to it, and hub weights' head size
    from their pretrained config when not given. 422 naming what is wrong."""
    # only here: registering a model is rare, and timm pulls in torch
    from zoopick.selection.zoo import ZooError, hub_num_classes, timm_name

    values = body.model_dump(exclude_none=True)
    try:
        values["arch"] = timm_name(body.arch)
        if body.num_classes is None:
            if body.weights != "hub":
                raise ZooError("num_classes: required unless weights is 'hub'")
            values["num_classes"] = hub_num_classes(values["arch"])
            if values["num_classes"] is None:
                raise ZooError(
                    f"num_classes: timm records no head size for {values['arch']!r}: give it"
                )
    except ZooError as exc:
        raise Problem(422, str(exc), kind="invalid-zoo-model") from None
    values.setdefault("id", values["arch"])
    return values


def already(model_id: str, row: ZooModel) -> Problem:
    if row.origin == zoo_catalog.REMOVED_ORIGIN:
        return Problem(
            409,
            f"zoo model {model_id!r} was removed, and past jobs name it by this id: "
            "register the model under another id",
            kind="zoo-model-exists",
        )
    return Problem(409, f"zoo model {model_id!r} already exists", kind="zoo-model-exists")


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
    """Add a model to the zoo. The answer carries timm's data config for it."""
    if body.id is not None and (row := session.get(ZooModel, body.id)) is not None:
        raise already(body.id, row)
    check_weights(body.weights)
    fields = resolved_fields(body)
    if body.id is None and (row := session.get(ZooModel, fields["id"])) is not None:
        raise already(fields["id"], row)
    from zoopick.selection.zoo import ZooError

    try:
        entry = zoo_catalog.check_fields(fields)
    except ZooError as exc:
        raise Problem(422, str(exc), kind="invalid-zoo-model") from None
    # the entry as checked: its checkpoint path resolved (no "..", no symbolic link), so the
    # file jobs load is the one whose shapes were checked
    row = ZooModel(id=entry.id, origin="api", **zoo_catalog.row_values(entry))
    session.add(row)
    try:
        session.commit()
    except IntegrityError:  # registered concurrently
        session.rollback()
        raise Problem(
            409, f"zoo model {entry.id!r} already exists", kind="zoo-model-exists"
        ) from None
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
    zoo_catalog.remove(row)
    session.commit()
    return Response(status_code=204)
