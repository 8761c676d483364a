"""Setting a store up and filling it (issue 40): ``zoopick storage init`` and
``zoopick storage copy``.

- :func:`prepare`: a deployment's first start against an S3-compatible store finds its bucket
  there (compose starts the store beside the service, empty): the bucket is made if missing,
  waiting while the store is still starting. A local folder is just made.
- :func:`copy`: an existing deployment moves its local store folder to S3 by copying its
  objects, key for key (a local store's files are ``<folder>/<key>``), which the rows name
  as they are; objects already in the destination at the same size are left alone, so a copy
  cut off is run again. Only ``tenants/...`` is copied: a folder's other files (datasets
  uploaded before the store, ``datasets/<id>/``) are named by their rows with absolute paths
  and are read where they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from zoopick.service.storage import LocalStore, S3Store, Store, StoreUnavailable

COPIED_PREFIX = "tenants"
"""What :func:`copy` moves: every object a row names by its key is a tenant's."""


def prepare(store: Store, *, wait_seconds: float = 60.0, sleep: Callable = time.sleep) -> str:
    """Make ``store`` ready to be written: an S3 bucket created if missing (what was done is
    returned, for the log), a local folder made. A store that does not answer is tried again
    until ``wait_seconds`` have passed, then ``StoreUnavailable``."""
    if isinstance(store, LocalStore):
        try:
            store.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(store.name, exc) from exc
        return f"folder {store.root} ready"
    assert isinstance(store, S3Store), type(store)
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            return _ensure_bucket(store)
        except StoreUnavailable:
            if time.monotonic() >= deadline:
                raise
            sleep(1.0)


def _ensure_bucket(store: S3Store) -> str:
    from botocore.exceptions import BotoCoreError, ClientError

    client = store.client
    try:
        client.head_bucket(Bucket=store.bucket)
        return f"bucket {store.bucket} exists"
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise StoreUnavailable(store.name, f"{code}: {exc}") from exc
    except BotoCoreError as exc:
        raise StoreUnavailable(store.name, exc) from exc
    region = client.meta.region_name
    where = (
        {"CreateBucketConfiguration": {"LocationConstraint": region}}
        if region and region != "us-east-1"  # AWS refuses the constraint for us-east-1
        else {}
    )
    try:
        client.create_bucket(Bucket=store.bucket, **where)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):  # made meanwhile
            return f"bucket {store.bucket} exists"
        raise StoreUnavailable(store.name, f"{code}: {exc}") from exc
    except BotoCoreError as exc:
        raise StoreUnavailable(store.name, exc) from exc
    return f"bucket {store.bucket} created"


@dataclass
class Copied:
    """What :func:`copy` did: objects copied, left alone (already there), bytes copied."""

    copied: int = 0
    skipped: int = 0
    bytes: int = 0


def copy(source: Store, dest: Store, *, progress: Callable[[str], None] | None = None) -> Copied:
    """Copy ``source``'s ``tenants/...`` objects into ``dest`` under the same keys; one that
    ``dest`` already holds at the same size is left alone. Each object is whole or absent in
    ``dest`` (a store's put), so a copy that fails is run again."""
    done = Copied()
    for key in source.list(COPIED_PREFIX):
        size = source.size(key)
        if size is None:  # removed meanwhile
            continue
        if dest.size(key) == size:
            done.skipped += 1
            continue
        stored = dest.put(key, source.get(key))
        done.copied += 1
        done.bytes += stored.size
        if progress is not None:
            progress(key)
    return done


__all__ = ["COPIED_PREFIX", "Copied", "copy", "prepare"]
