"""The zoo's admin use cases, once for both faces: register a model (``POST /zoo`` and the
dashboard's zoo form) and remove one (``DELETE /zoo/{id}`` and the zoo page's Remove), and
how many of a tenant's jobs used each model (the zoo page's count).

Refusals are ``jobs.Rejected`` kinds: ``zoo-model-exists`` (the API's 409) and
``invalid-zoo-model`` (422), each naming the problem. Who may call them (an admin) is the
face's check."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from zoopick.service import zoo_catalog, zoo_weights
from zoopick.service.db.models import Job, ZooModel
from zoopick.service.jobs import Rejected
from zoopick.service.settings import Settings, get_settings
from zoopick.service.storage import ObjectMissing

EXISTS = "zoo-model-exists"
INVALID = "invalid-zoo-model"


def check_weights(weights: str) -> None:
    """``weights`` is ``hub``, ``none``, an absolute checkpoint path of a known suffix or an
    ``s3://bucket/key`` checkpoint (``zoo_weights.parse``'s rules)."""
    if weights in ("hub", "none"):
        return
    if zoo_weights.is_stored(weights):
        try:
            zoo_weights.parse(weights)
        except ValueError as exc:
            raise Rejected(INVALID, f"weights: {exc}") from None
        return
    path = Path(weights)
    if not path.is_absolute():
        raise Rejected(
            INVALID,
            f"weights {weights!r}: give 'hub', 'none', an absolute checkpoint path on the "
            "workers' file system or s3://bucket/key",
        )
    if path.suffix not in (".safetensors", ".pth", ".bin", ".pt"):
        raise Rejected(
            INVALID, f"weights {weights!r}: a checkpoint must be .safetensors, .pth, .pt or .bin"
        )


def resolved_fields(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a registration's fields, unset ones left out) as the manifest rules take
    them: arch as timm's registry name (a hub name mapped, a pretrained tag checked), the id
    defaulting to it, and hub weights' head size from their pretrained config when not given."""
    # only here: registering a model is rare, and timm pulls in torch
    from zoopick.selection.zoo import ZooError, hub_num_classes, timm_name

    values = dict(values)
    try:
        values["arch"] = timm_name(values["arch"])
        if values.get("num_classes") is None:
            if values.get("weights") != "hub":
                raise ZooError("num_classes: required unless weights is 'hub'")
            values["num_classes"] = hub_num_classes(values["arch"])
            if values["num_classes"] is None:
                raise ZooError(
                    f"num_classes: timm records no head size for {values['arch']!r}: give it"
                )
    except ZooError as exc:
        raise Rejected(INVALID, str(exc)) from None
    values.setdefault("id", values["arch"])
    return values


def _already(model_id: str, row: ZooModel) -> Rejected:
    if row.origin == zoo_catalog.REMOVED_ORIGIN:
        return Rejected(
            EXISTS,
            f"zoo model {model_id!r} was removed, and past jobs name it by this id: "
            "register the model under another id",
        )
    return Rejected(EXISTS, f"zoo model {model_id!r} already exists")


def register(
    session: Session, values: dict[str, Any], settings: Settings | None = None
) -> ZooModel:
    """Add a model to the zoo from a registration's validated fields (the API's
    ``ZooModelIn``, unset ones left out) and commit. The row stores the entry as checked: its
    checkpoint path resolved (no "..", no symbolic link), so the file jobs load is the one
    whose shapes were checked; an ``s3://`` checkpoint is read once here, into ``settings``'
    (default: the process's) scratch folder, checked the same way, and its size and SHA-256
    recorded (``zoo_weights``). ``storage.StoreUnavailable`` passes (the face answers 503)."""
    given = values.get("id")
    if given is not None and (row := session.get(ZooModel, given)) is not None:
        raise _already(given, row)
    check_weights(values["weights"])
    fields = resolved_fields(values)
    if given is None and (row := session.get(ZooModel, fields["id"])) is not None:
        raise _already(fields["id"], row)
    if zoo_weights.is_stored(fields["weights"]):
        entry, columns = _checked_object(fields, settings or get_settings())
    else:
        entry = _checked(fields)
        columns = zoo_catalog.row_values(entry)
    row = ZooModel(id=entry.id, origin="api", **columns)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:  # registered concurrently
        session.rollback()
        raise Rejected(EXISTS, f"zoo model {entry.id!r} already exists") from None
    return row


def _checked(fields: dict[str, Any], shown_as: str | None = None) -> Any:
    """The checked ``ZooEntry`` of ``fields`` (``zoo_catalog.check_fields``), or ``Rejected``;
    ``shown_as``: what the refusal calls the checkpoint (a stored one's URL, not the path of
    the copy that was checked)."""
    from zoopick.selection.zoo import ZooError

    try:
        return zoo_catalog.check_fields(fields)
    except ZooError as exc:
        detail = str(exc)
        if shown_as is not None:
            detail = detail.replace(str(fields["weights"]), shown_as)
        raise Rejected(INVALID, detail) from None


def _checked_object(fields: dict[str, Any], settings: Settings) -> tuple[Any, dict[str, Any]]:
    """The row's columns for a checkpoint in a store: the object copied to a scratch folder
    of ``settings.data_dir`` (removed after), checked as a local checkpoint is, then named by
    its URL with the size and SHA-256 of the bytes checked."""
    import shutil
    import tempfile

    url = fields["weights"]
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="zoo-register-", dir=settings.data_dir))
    try:
        try:
            path, stored = zoo_weights.download(zoo_weights.parse(url), scratch)
        except ObjectMissing:
            raise Rejected(INVALID, f"weights {url!r}: no such object in the store") from None
        entry = _checked({**fields, "weights": str(path)}, shown_as=url)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    columns = zoo_catalog.row_values(entry)
    return entry, {**columns, "weights": url, "weights_sha256": stored.sha256,
                   "weights_size": stored.size}  # fmt: skip


def remove(session: Session, row: ZooModel) -> None:
    """Take the model out of the zoo and commit: no list shows it and no new job may name it;
    the jobs that used it keep their results and downloads (``zoo_catalog.REMOVED_ORIGIN``)."""
    zoo_catalog.remove(row)
    session.commit()


def jobs_using(session: Session, tenant_id: uuid.UUID, model_ids: Iterable[str]) -> dict[str, int]:
    """How many of the tenant's jobs name each of ``model_ids`` among their models. Read
    from the jobs' model lists in batches (a JSON column: the same on SQLite and PostgreSQL)."""
    wanted = set(model_ids)
    counts: Counter[str] = Counter()
    rows = session.execute(
        select(Job.models).where(Job.tenant_id == tenant_id).execution_options(yield_per=1000)
    )
    for (models,) in rows:
        counts.update(wanted.intersection(models or ()))
    return {model_id: counts[model_id] for model_id in wanted}
