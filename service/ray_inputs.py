"""A Ray run's input files fetched from the store on each node of the pool (issue 40).

A fine-tune reads two inputs as files: the dataset (its file, or the copy validation decoded)
and the zoo model's checkpoint. The gpu worker reads them through its own object cache; a
Ray Train worker runs on another machine, which shares no folder with it. So the gpu worker
hands the Ray driver an ``inputs`` document (:func:`document`: this module's :func:`place`
and what it needs, store keys and digests, never a path of the gpu worker's), and every Ray
worker calls :func:`place` on its node before it trains: the same fetches a gpu worker makes
(``datasets.store.run_data``, ``zoo_catalog.write_manifest``), through the node's own bounded,
digest-checked object cache in its ``ZOOPICK_DATA_DIR`` (else ``<tmp>/zoopick``).

The store is reached as on any machine of the deployment: the document names its URL, and
the ``AWS_*`` variables reach the node with the run (the driver forwards its own).

A race's rungs run with the same document, and a race winner's fine-tune names in it the
store's copy of the checkpoint it starts from (``init_from``: the winner's
``run_checkpoints.race_key``), which each worker fetches into its private folder: no file of
the gpu worker's is read on the pool.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from zoopick.service import run_checkpoints, storage, zoo_catalog
from zoopick.service.datasets import store
from zoopick.service.db.models import ZooModel
from zoopick.service.settings import Settings
from zoopick.training.config import CHECKPOINT, FinetuneConfig

HOOK = f"{__name__}:place"
"""What the Ray driver imports and calls on each node (``training.ray_driver``)."""

ZOO_COLUMNS = (
    "id", "arch", "weights", "weights_sha256", "weights_size", "num_classes", "overrides",
    "source", "tags",
)  # fmt: skip
"""The zoo row's columns a node needs to fetch and load its checkpoint (``to_entry``'s)."""


INIT_FROM = "init_from"
"""The folder of a worker's private folder where it unpacks the checkpoint its run starts
from (``FinetuneConfig.init_from``)."""


def document(
    settings: Settings, row: ZooModel, storage_path: str, init_from: str | None = None
) -> str:
    """The Ray backend's ``inputs`` (``Backend.inputs``) for a run of ``row`` on the dataset
    stored at ``storage_path`` (its row's key) in ``settings``' store; ``init_from``: the key
    of a checkpoint packed by ``run_checkpoints`` (a race winner's) that the run starts from."""
    spec = {
        "storage_url": settings.storage_url,
        "dataset": storage_path,
        "zoo": {name: getattr(row, name) for name in ZOO_COLUMNS},
    }
    if init_from is not None:
        spec["init_from"] = init_from
    return json.dumps({"hook": HOOK, "spec": spec})


def unplaced(row: ZooModel, storage_path: str, folder: Path) -> dict[str, str | None]:
    """The zoo manifest and the dataset as the config of a Ray run names them where the run
    is started (``zoo``, ``data`` and ``decoded``, as ``zoo_catalog.write_manifest`` and
    ``datasets.store.run_data`` give them): a manifest in ``folder`` naming the checkpoint as
    the zoo registered it (a store's key, fetched nowhere here) and the dataset's key, files
    of no machine. The gpu worker fetches neither (a checkpoint or a dataset can be
    gigabytes, and the driver reads neither); each worker's :func:`place` names its node's
    copies instead."""
    from zoopick.selection.zoo import write_zoo

    manifest = write_zoo([zoo_catalog.registered_entry(row)], folder / "zoo.json")
    return {"zoo": str(manifest), "data": storage_path, "decoded": None}


def node_settings(storage_url: str, limits: dict[str, Any] | None) -> Settings:
    """This node's settings for the fetches: its own ``ZOOPICK_DATA_DIR`` (scratch, object
    cache) and cache bound from its environment, the deployment's store, and the dataset
    limits the run was validated under (a copy over them is not read, as on the gpu worker)."""
    fields: dict[str, Any] = {"storage_url": storage_url}
    if not os.environ.get("ZOOPICK_DATA_DIR"):
        fields["data_dir"] = Path(tempfile.gettempdir()) / "zoopick"
    fields.update({f"dataset_{name}": value for name, value in (limits or {}).items()})
    return Settings(**fields)


def place(cfg: FinetuneConfig, spec: dict[str, Any], folder: Path) -> FinetuneConfig:
    """``cfg`` with its zoo manifest, dataset file and decoded copy as files of this node
    (the manifest written in the worker's private ``folder``), and the checkpoint it starts
    from (``spec["init_from"]``, a key of the store) unpacked there too. A checkpoint already
    in ``folder`` (a restarted worker's, or the last rung's of a race candidate, from Ray's
    storage) is rebased onto these paths, so the trainer's same-run check compares the run,
    not the machines; such a run resumes, so it fetches no ``init_from``. The store's errors
    pass (``StoreUnavailable`` after its retries), failing this worker, naming the store."""
    settings = node_settings(spec["storage_url"], cfg.dataset_limits)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    manifest = zoo_catalog.write_manifest([ZooModel(**spec["zoo"])], folder / "zoo.json", settings)
    data = store.run_data(spec["dataset"], settings)
    update: dict[str, Any] = {"zoo": str(manifest), **data}
    resumes = (folder / CHECKPOINT).is_file()
    if spec.get("init_from"):
        seed = folder / INIT_FROM
        update["init_from"] = str(seed / CHECKPOINT)
        if not resumes and not run_checkpoints.fetch(
            storage.open_store(settings.storage_url), spec["init_from"], seed
        ):  # the gpu worker saw it there: gone since (the job deleted), not to be dropped
            raise FileNotFoundError(f"no checkpoint to start from at {spec['init_from']}")
    placed = cfg.model_copy(update=update)
    if resumes:
        run_checkpoints.rebase(folder, placed.model_dump(mode="json"))
    return placed


__all__ = ["HOOK", "INIT_FROM", "document", "node_settings", "place", "unplaced"]
