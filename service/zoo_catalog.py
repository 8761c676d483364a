"""The zoo in the database: synced from the manifest at start, extended through ``POST /zoo``,
and turned back into ``zoopick.selection.zoo.ZooEntry`` objects for the workers.

A manifest's relative checkpoint paths are resolved by ``zoopick.selection.zoo.load_zoo``; the rows
store the resolved paths, so workers need no manifest, only the same file system. A model
registered through the API is stored the same way (``check_fields`` returns the entry it
checked): the real path of the file whose shapes were checked, never a ``..`` path or a
symbolic link that could later be re-pointed at another file.

Where the deployment's store is S3, a manifest's checkpoints are put there and the rows name
the objects (``s3://bucket/key`` with their size and SHA-256), as an admin's registered
``s3://`` checkpoint is: the workers then share no folder, and :func:`to_entry` gives the
library a file of this machine's object cache (``service.zoo_weights``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from zoopick.service import zoo_weights
from zoopick.service.db.models import ZooModel
from zoopick.service.settings import Settings, get_settings
from zoopick.service.storage import S3Store, open_store, retrying

MANIFEST_ORIGIN = "manifest"
REMOVED_ORIGIN = "removed"
"""A model an admin removed (``DELETE /zoo/{id}``). Its row stays, out of every list, lookup
and new job: jobs refer to models by id (``Job.models``, ``Job.chosen_model``, each score's
``model_id``), so past jobs keep their ranking, and their fine-tuned model can still be
exported to timm or ONNX, which needs the architecture the row records. A job submitted before
the removal still scores and trains it. Its id is not given to another model: past jobs would
then name a model they never used."""


def row_values(entry: Any) -> dict[str, Any]:
    """A ``ZooModel`` row's columns (all but id and origin) for a checked ``ZooEntry`` whose
    weights are where the row finds them (a caller that checked a copy of a stored
    checkpoint sets its URL, size and SHA-256 over these)."""
    return {
        "arch": entry.arch,
        "weights": str(entry.weights),
        "weights_sha256": None,
        "weights_size": None,
        "num_classes": int(entry.num_classes),
        "overrides": dict(entry.overrides or {}),
        "source": entry.source,
        "tags": list(entry.tags or []),
    }


def sync_manifest(session: Session, manifest: Path, settings: Settings | None = None) -> list[str]:
    """Insert or update every model of ``manifest``; returns their ids. Models registered
    through the API are left alone, and so are manifest models no longer listed (jobs may
    still name them) and those an admin removed (``REMOVED_ORIGIN``: not returned).

    Where ``settings``' store (default: the process's) is S3, each local checkpoint is put
    there first (``zoo_weights.put_checkpoint``: once, keyed by its digest) and the row names
    the object, so no worker needs this machine's files (the demo zoo is built in its
    private ``data_dir``)."""
    from zoopick.selection.zoo import load_zoo

    store = open_store((settings or get_settings()).storage_url)
    ids = []
    for entry in load_zoo(manifest):
        values = row_values(entry)
        if isinstance(store, S3Store) and entry.is_checkpoint:
            url, stored = zoo_weights.put_checkpoint(store, Path(entry.weights))
            values.update(weights=url, weights_sha256=stored.sha256, weights_size=stored.size)
        row = session.get(ZooModel, entry.id)
        if row is not None and row.origin == REMOVED_ORIGIN:
            continue  # an admin removed it: the manifest does not bring it back
        if row is None:
            session.add(ZooModel(id=entry.id, origin=MANIFEST_ORIGIN, **values))
        elif row.origin == MANIFEST_ORIGIN:
            for key, value in values.items():
                setattr(row, key, value)
        ids.append(entry.id)
    session.flush()
    return ids


def to_entry(row: ZooModel, settings: Settings | None = None) -> Any:
    """The ``zoopick.selection.zoo.ZooEntry`` of a row (what extraction, ranking and the
    trainer consume), its weights a file of this machine: a checkpoint in a store is fetched
    into ``settings``' (default: the process's) object cache first, checked against the size
    and SHA-256 recorded at registration, a store that is unavailable tried again
    (``storage.retrying``). The store's errors then pass (``StoreUnavailable``,
    ``ObjectMissing``, ``object_cache.DamagedObject``), naming the object."""
    weights = row.weights
    if zoo_weights.is_stored(weights):
        cfg = settings or get_settings()
        sha256, size = row.weights_sha256, row.weights_size
        path = retrying(lambda: zoo_weights.local_copy(cfg, weights, sha256=sha256, size=size))
        weights = str(path)
    return registered_entry(row, weights)


def registered_entry(row: ZooModel, weights: str | None = None) -> Any:
    """The row's ``ZooEntry`` with its weights as given, by default as registered (a store's
    key is not fetched: a manifest for a machine that fetches it itself, ``ray_inputs``)."""
    from zoopick.selection.zoo import ZooEntry

    return ZooEntry(
        id=row.id,
        arch=row.arch,
        weights=row.weights if weights is None else weights,
        num_classes=row.num_classes,
        overrides=dict(row.overrides or {}),
        source=row.source,
        tags=list(row.tags or []),
    )


def write_manifest(rows: list[ZooModel], path: Path, settings: Settings | None = None) -> Path:
    """A zoo manifest holding ``rows`` (the trainer takes a manifest path and a model id), their
    checkpoints files of this machine (:func:`to_entry` with ``settings``)."""
    from zoopick.selection.zoo import write_zoo

    return write_zoo([to_entry(row, settings) for row in rows], path)


def check_fields(values: dict[str, Any]) -> Any:
    """Validate one manifest entry with the engine's own rules, the checkpoint included: it
    must exist on this machine's file system (the service's machines share their storage) and
    fit the architecture and ``num_classes`` (its tensor shapes are read, not its weights).
    A checkpoint that does not fit would otherwise fail every job that scores "all" models.

    Returns the checked ``zoopick.selection.zoo.ZooEntry``, whose ``weights`` is the resolved
    path that was opened: store that (``row_values``), not the path as given. Raises
    ``zoopick.selection.zoo.ZooError`` naming the problem."""
    import tempfile

    from zoopick.selection.zoo import load_zoo, write_zoo

    with tempfile.TemporaryDirectory() as tmp:
        manifest = write_zoo([values], Path(tmp) / "zoo.json")
        (entry,) = load_zoo(manifest)  # opens the checkpoint and compares its shapes
    return entry


def listed() -> Any:
    """The condition of a model that is in the zoo (not removed)."""
    return ZooModel.origin != REMOVED_ORIGIN


def all_ids(session: Session) -> list[str]:
    """The zoo's model ids (what ``"models": "all"`` scores), removed ones left out."""
    return list(session.scalars(select(ZooModel.id).where(listed()).order_by(ZooModel.id)))


def remove(row: ZooModel) -> None:
    """Take ``row`` out of the zoo, keeping it for the jobs that used it (``REMOVED_ORIGIN``)."""
    row.origin = REMOVED_ORIGIN


def data_config(row: ZooModel) -> dict[str, Any]:
    """timm's eval data config of the model (its pretrained config, its tag's for a tagged
    name), with the entry's overrides applied, as JSON: what scoring resizes, crops and
    normalises each image with. Read from timm's registry, nothing downloaded."""
    cfg = registered_entry(row).data_config()  # reads no weights: nothing fetched
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}
