"""A machine's bounded local copies of store objects (issue 40): what a worker reads as files.

The loader, the decoded copy's memory map and the trainer read files, and a remote store (S3)
is not a file system. :meth:`ObjectCache.fetch` gives an object as a file on this machine:

- from a local store, its own file (nothing copied);
- from a remote one, a copy under ``<data_dir>/objects/<key>`` (``ZOOPICK_DATA_DIR`` is each
  machine's private scratch), fetched once: written aside, its size and SHA-256 checked
  against what the caller recorded when it was stored, then renamed into place, so a copy in
  the cache is always whole and verified. Processes of one machine fetching the same object
  wait for one another (a lock file) instead of fetching it twice.

The cache is bounded (``ZOOPICK_OBJECT_CACHE_MAX_BYTES``): after each fetch the copies used
least recently (a use touches the copy's modification time) are removed until the rest fit.
The copy just fetched stays even where it alone is over the bound. A copy removed while a
process reads it stays readable to that process (POSIX keeps an unlinked file open); a later
reader fetches it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from zoopick.service.settings import Settings
from zoopick.service.storage import ObjectMissing, Store, StoreError, open_store

log = logging.getLogger(__name__)

LOCKS = ".locks"
"""The cache's own folder of lock files (never a key: keys have no hidden segments)."""


class DamagedObject(StoreError):
    """An object whose bytes are not the ones recorded when it was stored (its size or
    SHA-256 differ): nothing is kept, and the caller fails naming it."""


@dataclass
class ObjectCache:
    store: Store
    root: Path
    max_bytes: int

    def fetch(self, key: str, *, sha256: str, size: int) -> Path:
        """The object ``key`` as a file on this machine, whose size and SHA-256 are ``size``
        and ``sha256``. ``ObjectMissing`` where there is none, ``StoreUnavailable`` where the
        store cannot be read, :class:`DamagedObject` where its bytes differ."""
        own = self.store.local_path(key)
        if own is not None:
            found = self.store.size(key)
            if found is None:
                raise ObjectMissing(key)
            if found != size:  # a local file is not read again for its digest: its size
                raise DamagedObject(f"{key}: {found} bytes stored, {size} recorded")
            return own
        path = self.root / key
        with self._locked(key):
            if self._usable(path, size):
                os.utime(path)  # its use, for the eviction's order
                return path
            self._download(key, path, sha256=sha256, size=size)
        self.evict(keep=path)
        return path

    def forget(self, prefix: str) -> None:
        """Remove this machine's copies under ``prefix`` (their objects were deleted)."""
        import shutil

        shutil.rmtree(self.root / prefix, ignore_errors=True)

    def _usable(self, path: Path, size: int) -> bool:
        try:
            return path.stat().st_size == size
        except OSError:
            return False

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        locks = self.root / LOCKS
        locks.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha256(key.encode()).hexdigest()[:32]
        with open(locks / name, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _download(self, key: str, path: Path, *, sha256: str, size: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        digest, got = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as f:
                for chunk in self.store.get(key):
                    got += len(chunk)
                    if got > size:
                        break
                    digest.update(chunk)
                    f.write(chunk)
            if got != size or digest.hexdigest() != sha256:
                raise DamagedObject(
                    f"{key} in {self.store.name}: not the object recorded (size or SHA-256 differ)"
                )
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def evict(self, keep: Path | None = None) -> int:
        """Remove the least recently used copies until the rest fit :attr:`max_bytes`;
        the bytes removed."""
        copies = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith("."):  # a fetch under way
                    continue
                path = Path(dirpath) / name
                with contextlib.suppress(OSError):
                    st = path.stat()
                    copies.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in copies)
        removed = 0
        for _, size, path in sorted(copies, key=lambda c: c[0]):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size
                removed += size
        if removed:
            log.info("object cache %s: %d bytes of least recently used copies removed",
                     self.root, removed)  # fmt: skip
        return removed


def object_cache(settings: Settings) -> ObjectCache:
    """This machine's cache in front of ``settings``' store."""
    return ObjectCache(
        open_store(settings.storage_url),
        settings.data_dir / "objects",
        settings.object_cache_max_bytes,
    )


__all__ = ["DamagedObject", "ObjectCache", "object_cache"]
