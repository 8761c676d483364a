"""Zoo checkpoints kept in an S3 store (issue 40): ``"weights": "s3://bucket/key"``.

A zoo model's checkpoint is either a file every worker can open (a path: the machines share
a folder), or an object of an S3-compatible store, named by its URL. The selection library
only ever opens files: the service turns a row's URL into a file on this machine before it
builds the library's ``ZooEntry`` (``zoo_catalog.to_entry``), and the library stays
storage-agnostic.

- An admin registers ``s3://bucket/key`` (``zoo_admin.register``): the object is read once
  on the API (:func:`download`), its shapes checked against the architecture as a local
  checkpoint's are, and its size and SHA-256 kept in the row. The row thereby names the
  bytes that were checked: an object replaced later is refused by the workers
  (``object_cache.DamagedObject``), as a re-pointed symbolic link is never followed.
- A manifest's local checkpoints (the demo zoo's among them) are put in the deployment's
  store when it is S3 (:func:`put_checkpoint`, content-addressed under ``zoo/<sha256>/``, so
  a restart uploads nothing again), and their rows name the object.
- A worker reads the object through its bounded, digest-checked object cache
  (:func:`local_copy`: ``<data_dir>/objects/s3/<bucket>/<key>``, fetched once per machine).

The bucket is reached with the standard ``AWS_*`` variables (``storage.S3Store``), whether
or not the deployment's own store is S3.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from zoopick.service.object_cache import ObjectCache
from zoopick.service.settings import Settings
from zoopick.service.storage import CHUNK, S3Store, Store, Stored, check_key, open_store

SCHEME = "s3://"
SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
"""A checkpoint's formats (``selection.zoo.CHECKPOINT_SUFFIXES``; not imported: that module's
checks pull in nothing here, but its name reads as the library's)."""

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""S3's bucket naming rule (lower case, digits, dots and hyphens, 3 to 63 characters)."""

KEY_PREFIX = "zoo"
"""Where a manifest's checkpoints go in the deployment's store: ``zoo/<sha256>/<file name>``."""


@dataclass(frozen=True)
class StoredWeights:
    """A checkpoint object: its bucket and its key in that bucket."""

    bucket: str
    key: str

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def is_stored(weights: str) -> bool:
    """Whether ``weights`` names an object (``s3://...``) rather than a file, hub or none."""
    return weights.startswith(SCHEME)


def parse(weights: str) -> StoredWeights:
    """The object ``weights`` (``s3://bucket/key``) names; ``ValueError`` saying what is wrong
    with a malformed one (no key, a bucket name S3 refuses, a key with ``..``, hidden or odd
    segments, a suffix that is not a checkpoint's)."""
    if not is_stored(weights):
        raise ValueError(f"{weights!r} is not an s3:// URL")
    bucket, _, key = weights[len(SCHEME) :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(
            f"{weights!r}: {bucket!r} is not an S3 bucket name (3 to 63 lower-case letters, "
            "digits, dots or hyphens)"
        )
    try:
        check_key(key)
    except ValueError:
        raise ValueError(
            f"{weights!r}: give s3://bucket/key, the key of plain segments (letters, digits, "
            "'.', '_', '-', '=', no '..' or empty segment)"
        ) from None
    if Path(key).suffix.lower() not in SUFFIXES:
        raise ValueError(f"{weights!r}: a checkpoint must be {', '.join(SUFFIXES)}")
    return StoredWeights(bucket, key)


def store_of(weights: StoredWeights) -> Store:
    """The bucket as a store (made once per process, as the deployment's own is)."""
    return open_store(f"{SCHEME}{weights.bucket}")


def download(weights: StoredWeights, folder: Path) -> tuple[Path, Stored]:
    """The object copied into ``folder`` (under its own file name, so its suffix says its
    format), with its size and SHA-256 counted on the way: what registration checks, then
    records. ``storage.ObjectMissing`` where there is no such object, ``StoreUnavailable``
    where the store cannot be read."""
    store = store_of(weights)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / Path(weights.key).name
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as f:
        for chunk in store.get(weights.key):
            size += len(chunk)
            digest.update(chunk)
            f.write(chunk)
    return path, Stored(weights.key, size, digest.hexdigest())


def cache_of(settings: Settings, weights: StoredWeights) -> ObjectCache:
    """This machine's cache of the bucket's checkpoints: beside the store's own copies under
    ``<data_dir>/objects`` (so the store's cache counts them against the same bound), in a
    folder of their own, ``s3/<bucket>`` (the store's keys are all ``tenants/...``)."""
    return ObjectCache(
        store_of(weights),
        settings.data_dir / "objects" / "s3" / weights.bucket,
        settings.object_cache_max_bytes,
    )


def local_copy(settings: Settings, url: str, *, sha256: str | None, size: int | None) -> Path:
    """The checkpoint ``url`` as a file on this machine, fetched once and checked against the
    size and SHA-256 recorded at registration (``object_cache.DamagedObject`` where the
    object changed since, ``ObjectMissing`` where it is gone, ``StoreUnavailable``)."""
    if sha256 is None or size is None:
        raise ValueError(f"zoo checkpoint {url}: no size and SHA-256 recorded: register it again")
    weights = parse(url)
    return cache_of(settings, weights).fetch(weights.key, sha256=sha256, size=size)


def put_checkpoint(store: S3Store, path: Path) -> tuple[str, Stored]:
    """Put a local checkpoint in the deployment's S3 store, at ``zoo/<sha256>/<file name>``
    (left alone when already there whole: same digest, same size), and return its URL and
    what was stored."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            size += len(chunk)
            digest.update(chunk)
    name = re.sub(r"[^A-Za-z0-9._=-]", "_", path.name).lstrip("._-=") or f"{uuid.uuid4().hex}"
    key = check_key(f"{KEY_PREFIX}/{digest.hexdigest()}/{name}")
    if store.size(key) != size:
        stored = store.put_file(key, path)
        if stored.sha256 != digest.hexdigest():  # the file changed while it was read
            store.delete(key)
            raise ValueError(f"{path} changed while it was put in the store")
    object_key = f"{store.prefix}/{key}" if store.prefix else key
    return f"{SCHEME}{store.bucket}/{object_key}", Stored(key, size, digest.hexdigest())


__all__ = [
    "SCHEME",
    "StoredWeights",
    "cache_of",
    "download",
    "is_stored",
    "local_copy",
    "parse",
    "put_checkpoint",
    "store_of",
]
