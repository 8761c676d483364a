"""The feature cache in the store (issue 40, step 2): a model's forward pass on a dataset
happens once per deployment, not once per machine.

Each worker keeps its local feature cache (``ZOOPICK_CACHE_DIR``, as before); behind it,
:class:`StoreFeatures` is the ``SharedCache`` of ``selection.extract``: on a local miss the
worker fetches ``<key>.npz`` from the store, and a result it computes is put there, under the
same key as today (weights, dataset digest, transform, precision). The objects are kept under
the dataset's own prefix (``tenants/<tenant>/datasets/<dataset>/features/``): a model's outputs
on a dataset are that dataset's data, so tenants never share them, and deleting the dataset
(which deletes its prefix) deletes them too. Two uploads of the same images are two datasets
here (each its own forward pass per deployment); a worker's local cache, keyed by content
alone, still serves both.

Only a remote store gets one: with a local store every worker is on one machine (or shares its
folders), where the local cache is already all of it. The store's trouble never fails
scoring: a lookup that cannot reach it is a miss, a result it cannot take stays local; both
logged, naming the store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from zoopick.service.storage import ObjectMissing, Store, StoreError

log = logging.getLogger(__name__)

FOLDER = "features"


@dataclass(frozen=True)
class StoreFeatures:
    store: Store
    prefix: str
    """``tenants/<tenant>/datasets/<dataset>/features``."""

    def fetch(self, name: str, dest: Path) -> bool:
        try:
            self.store.get_to_file(f"{self.prefix}/{name}", dest)
        except ObjectMissing:
            return False
        except StoreError as exc:
            log.warning("the shared feature cache was not read: %s", exc)
            return False
        return True

    def keep(self, name: str, path: Path) -> None:
        try:
            self.store.put_file(f"{self.prefix}/{name}", path)
        except StoreError as exc:
            log.warning("a result was not kept in the shared feature cache: %s", exc)


def for_dataset(store: Store, dataset_prefix: str) -> StoreFeatures | None:
    """The shared feature cache of the dataset whose objects are under ``dataset_prefix``
    (``tenants/<tenant>/datasets/<dataset>``); None for a local store (see the module's
    docstring)."""
    if store.local_path(f"{dataset_prefix}/{FOLDER}") is not None:
        return None
    return StoreFeatures(store, f"{dataset_prefix}/{FOLDER}")


__all__ = ["StoreFeatures", "for_dataset"]
