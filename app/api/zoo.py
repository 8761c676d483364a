"""``/zoo``: the candidate models (everyone reads; an admin key registers)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from app import zoo_catalog
from app.api import pagination
from app.api.deps import AdminDep, CallerDep, SessionDep, SettingsDep
from app.api.schemas import Page, ZooModelIn, ZooModelOut
from app.db.models import ZooModel
from app.problems import Problem, ProblemDetail

router = APIRouter(prefix="/zoo", tags=["zoo"])

ERRORS = {
    code: {"model": ProblemDetail, "content": {"application/problem+json": {}}}
    for code in (400, 401, 403, 404, 409, 422)
}


@router.get("", response_model=Page[ZooModelOut], responses=ERRORS, summary="List the zoo")
def list_zoo(
    caller: CallerDep,
    session: SessionDep,
    settings: SettingsDep,
    page_size: Annotated[int | None, Query(ge=1)] = None,
    page_token: str | None = None,
) -> Page[ZooModelOut]:
    size = min(page_size or settings.page_size_default, settings.page_size_max)
    stmt = pagination.page(select(ZooModel), ZooModel, page_token, size, uuid_ids=False)
    items, token = pagination.split(list(session.scalars(stmt)), size)
    return Page[ZooModelOut](
        items=[ZooModelOut.model_validate(m) for m in items], next_page_token=token
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
    from selection.zoo import ZooError

    try:
        zoo_catalog.check_fields(body.model_dump(exclude_none=True))
    except ZooError as exc:
        raise Problem(422, str(exc), kind="invalid-zoo-model") from None
    row = ZooModel(
        id=body.id,
        arch=body.arch,
        weights=body.weights,
        num_classes=body.num_classes,
        overrides=body.overrides(),
        source=body.source,
        tags=body.tags,
        origin="api",
    )
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
def get_model(model_id: str, caller: CallerDep, session: SessionDep) -> ZooModelOut:
    row = session.get(ZooModel, model_id)
    if row is None:
        raise Problem(404, f"no zoo model {model_id!r}", kind="zoo-model-not-found")
    return ZooModelOut.model_validate(row)
