"""Where files that outlive one machine are kept: a :class:`Store` (issue 40).

``ZOOPICK_STORAGE_URL`` picks one (:func:`open_store`): a local folder (the default, today's
``<data_dir>/storage``: ``zoopick serve`` needs nothing new) or ``s3://bucket/prefix`` on any
S3-compatible store, reached through boto3, which reads the credentials, endpoint and region
from the standard ``AWS_*`` variables (no S3 client of our own). Both kinds behave alike, and
the tests run one body against each:

- an object is written, then made visible whole (local: a rename out of ``.partial/``; S3: a
  single PUT or a multipart upload, which the store shows only once completed), so a reader
  never meets a partial object, and a write that fails or goes over its size limit leaves none;
- its SHA-256 and size are counted on the way in (:class:`Stored`), so a stream is read once;
- keys are relative, ``/``-separated, of plain segments; a tenant's objects live under
  :func:`tenant_key`'s prefix, which the caller builds from the tenant it has checked;
- a store that is down or refuses raises :class:`StoreUnavailable` naming the store (never its
  credentials), after bounded timeouts and retries, not a hang.

Only the few operations zoopick needs are here: put (a stream or a file), get (a stream),
stat/exists, delete, list under a prefix.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import stat
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import unquote, urlparse

log = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK = 1024 * 1024
"""Bytes read at a time from a file or a stored object."""
PART = 8 * 1024 * 1024
"""An S3 multipart upload's part size (S3 requires at least 5 MiB but for the last one)."""

_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]*")
"""One segment of a key: no ``..``, no hidden names (``.partial`` is the local store's own),
nothing a shell or URL would read differently."""


class StoreError(Exception):
    """Something went wrong with the store."""


class StoreUnavailable(StoreError):
    """The store cannot be reached, or refuses (down, wrong credentials, no such bucket). Its
    message names the store, for the operator; a request answers 503 on it, a task retries."""

    def __init__(self, store: str, cause: BaseException | str) -> None:
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"the store {store} is unavailable: {reason}")
        self.store = store


class ObjectMissing(StoreError, FileNotFoundError):
    """No (complete) object under this key."""


class TooLarge(StoreError):
    """A put went over its ``max_bytes``: nothing was stored."""

    def __init__(self, key: str, max_bytes: int) -> None:
        super().__init__(f"{key}: more than {max_bytes} bytes")
        self.max_bytes = max_bytes


@dataclass(frozen=True)
class Stored:
    """An object as written: its key, size and SHA-256 (hex), counted on the way in."""

    key: str
    size: int
    sha256: str


def check_key(key: str) -> str:
    """``key`` if it is a valid object key (``a/b/c.ext``), else ``ValueError``: a key built
    from a request can never climb out of its prefix or reach the local store's own files."""
    parts = key.split("/")
    if not key or not all(_SEGMENT.fullmatch(p) for p in parts):
        raise ValueError(f"not a valid object key: {key!r}")
    return key


def tenant_key(tenant_id: object, *parts: str) -> str:
    """The key of a tenant's object: ``tenants/<tenant id>/<parts...>``. Every object that
    belongs to a tenant is under its prefix, so listing or deleting a tenant's files never
    touches another's."""
    return check_key("/".join(("tenants", str(tenant_id), *parts)))


def _chunks(source: IO[bytes] | Iterable[bytes]) -> Iterator[bytes]:
    if hasattr(source, "read"):
        while chunk := source.read(CHUNK):  # type: ignore[union-attr]
            yield chunk
    else:
        for chunk in source:
            if chunk:
                yield bytes(chunk)


class Writer(ABC):
    """One object being written: :meth:`write` its bytes as they come (counted, hashed and
    refused with :class:`TooLarge` past ``max_bytes`` before they are stored), then
    :meth:`commit` (it becomes visible whole) or :meth:`abort` (nothing is left). Until
    committed no reader sees it, whatever happens to the writer."""

    def __init__(self, key: str, max_bytes: int | None) -> None:
        self.key, self.max_bytes = check_key(key), max_bytes
        self.size = 0
        self._hash = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        if not chunk:
            return
        self.size += len(chunk)
        if self.max_bytes is not None and self.size > self.max_bytes:
            raise TooLarge(self.key, self.max_bytes)
        self._hash.update(chunk)
        self._write(chunk)

    def stored(self) -> Stored:
        return Stored(self.key, self.size, self._hash.hexdigest())

    @abstractmethod
    def _write(self, chunk: bytes) -> None: ...

    @abstractmethod
    def commit(self) -> Stored:
        """Make the object visible, whole; what was under its key before is replaced."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what was written (safe to call twice, and after a failed commit)."""


class Store(ABC):
    """The operations zoopick needs of a store (see the module's docstring)."""

    name: str
    """The store as errors name it: its folder or ``s3://bucket/prefix``, no credentials."""

    @abstractmethod
    def writer(self, key: str, *, max_bytes: int | None = None) -> Writer:
        """A :class:`Writer` of a new object under ``key``: what a caller that receives the
        bytes piece by piece (an upload's body, on the event loop) writes through."""

    def put(
        self, key: str, source: IO[bytes] | Iterable[bytes], *, max_bytes: int | None = None
    ) -> Stored:
        """Store ``source`` (a binary file or an iterable of byte chunks) under ``key``,
        replacing what was there once complete. :class:`TooLarge` past ``max_bytes``. The
        source's own errors (a client gone) pass as they are: only the store's are
        :class:`StoreUnavailable`."""
        out = self.writer(key, max_bytes=max_bytes)
        try:
            for chunk in _chunks(source):
                out.write(chunk)
            return out.commit()
        except BaseException:
            out.abort()
            raise

    def put_file(
        self, key: str, path: str | Path, *, max_bytes: int | None = None, move: bool = False
    ) -> Stored:
        """Store the file at ``path`` under ``key``; ``move``: the caller gives the file up,
        and it is removed once stored (a worker's scratch copy: no model kept twice)."""
        with open(path, "rb") as f:
            stored = self.put(key, f, max_bytes=max_bytes)
        if move:
            Path(path).unlink(missing_ok=True)
        return stored

    @abstractmethod
    def get(self, key: str) -> Iterator[bytes]:
        """The object's bytes in chunks. :class:`ObjectMissing` (raised at the call, before the
        first chunk) if there is none."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size, or None where there is none."""

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Store a small object under ``key`` only if there is none: whether this call made
        it (of callers racing, on any machine, one wins). For markers, not for large files."""

    @abstractmethod
    def modified(self, key: str) -> float | None:
        """When the object was last written (POSIX time), or None where there is none."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object if there is one."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """The keys of the complete objects under ``prefix`` (a folder: ``a/b`` lists
        ``a/b/...``, not ``a/bc``), sorted."""

    def local_path(self, key: str) -> Path | None:
        """The object as a file on this machine, where the store is a local folder (the API
        then sends it with ``sendfile`` and ranges); None for a remote store."""
        return None

    def get_to_file(self, key: str, path: Path) -> Path:
        """The object copied to ``path`` (a worker's scratch copy), written then renamed."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        try:
            with open(tmp, "wb") as f:
                for chunk in self.get(key):
                    f.write(chunk)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path


# -- a local folder -----------------------------------------------------------------------------


class LocalStore(Store):
    """A folder: ``<root>/<key>``. Writes go to ``<root>/.partial/`` first and are renamed into
    place (atomic on one file system), so a reader sees the old object or the whole new one."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.name = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _unavailable(self, exc: OSError) -> StoreUnavailable:
        return StoreUnavailable(self.name, f"{type(exc).__name__}: {exc.strerror or exc}")

    def writer(self, key: str, *, max_bytes: int | None = None) -> Writer:
        return _LocalWriter(self, key, max_bytes)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """The folder's ``OSError`` as :class:`StoreUnavailable` naming it."""
        try:
            yield
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def put_file(
        self, key: str, path: str | Path, *, max_bytes: int | None = None, move: bool = False
    ) -> Stored:
        """As :meth:`Store.put_file`; a file given up (``move``) on the store's file system is
        linked into place rather than copied (a model of gigabytes costs no copy), and only
        read for its digest."""
        if not move or max_bytes is not None:
            return super().put_file(key, path, max_bytes=max_bytes, move=move)
        dest = self._path(key)
        partial = self.root / ".partial" / uuid.uuid4().hex
        try:
            partial.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, partial)
        except OSError:  # another file system, or links refused: copied instead
            return super().put_file(key, path, move=True)
        try:
            with open(partial, "rb") as f:
                size, digest = 0, hashlib.sha256()
                while chunk := f.read(CHUNK):
                    size += len(chunk)
                    digest.update(chunk)
            with self._writing():
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(partial, dest)
        finally:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
        Path(path).unlink(missing_ok=True)
        return Stored(key, size, digest.hexdigest())

    def get(self, key: str) -> Iterator[bytes]:
        path = self._path(key)
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed by the generator
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectMissing(key) from None
        except OSError as exc:
            raise self._unavailable(exc) from exc

        def chunks() -> Iterator[bytes]:
            with f:
                while chunk := f.read(CHUNK):
                    yield chunk

        return chunks()

    def size(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._unavailable(exc) from exc
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with self._writing():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return True

    def modified(self, key: str) -> float | None:
        try:
            return self._path(key).stat().st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root)
            keys += [str(rel / f) for f in filenames if _SEGMENT.fullmatch(f)]
        return sorted(k.removeprefix("./") for k in keys)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)


class _LocalWriter(Writer):
    """Into ``<root>/.partial/<random>``, renamed to the key's path once committed."""

    def __init__(self, store: LocalStore, key: str, max_bytes: int | None) -> None:
        super().__init__(key, max_bytes)
        self.store = store
        self.dest = store._path(key)
        self.partial = store.root / ".partial" / uuid.uuid4().hex
        with store._writing():
            self.partial.parent.mkdir(parents=True, exist_ok=True)
            self.file: IO[bytes] | None = open(self.partial, "wb")  # noqa: SIM115

    def _write(self, chunk: bytes) -> None:
        assert self.file is not None, "written after commit or abort"
        with self.store._writing():
            self.file.write(chunk)

    def commit(self) -> Stored:
        assert self.file is not None, "committed twice or after abort"
        try:
            with self.store._writing():
                self.file.flush()
                os.fsync(self.file.fileno())
                self.file.close()
                self.file = None
                self.dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.partial, self.dest)
        except BaseException:
            self.abort()
            raise
        return self.stored()

    def abort(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
        with contextlib.suppress(OSError):
            self.partial.unlink(missing_ok=True)


# -- S3 ----------------------------------------------------------------------------------------


class S3Store(Store):
    """``s3://bucket/prefix`` through boto3: its client reads ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` and ``AWS_REGION`` (or a profile) as every
    AWS tool does. Timeouts and retries are bounded, so a store that is down answers
    :class:`StoreUnavailable` within seconds rather than hanging a request or a task."""

    def __init__(
        self, url: str, *, connect_timeout: float = 5.0, read_timeout: float = 60.0
    ) -> None:
        import boto3
        from botocore.config import Config

        parsed = urlparse(url)
        self.bucket = parsed.netloc
        self.prefix = unquote(parsed.path).strip("/")
        self.name = url.rstrip("/")
        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"mode": "standard"},  # 3 attempts; AWS_MAX_ATTEMPTS may say otherwise
            s3={"addressing_style": "path"},  # MinIO, SeaweedFS and Ceph by default
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client = boto3.session.Session().client("s3", config=config)

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, exc: Exception, key: str | None = None) -> StoreError:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if key is not None and code in ("NoSuchKey", "404", "NotFound"):
                return ObjectMissing(key)
            return StoreUnavailable(self.name, f"{code or 'error'}: {exc}")
        if isinstance(exc, BotoCoreError):
            return StoreUnavailable(self.name, exc)
        raise exc

    def writer(self, key: str, *, max_bytes: int | None = None) -> Writer:
        return _S3Writer(self, key, max_bytes)

    def _part(self, name: str, upload_id: str, number: int, data: bytes) -> dict[str, Any]:
        answer = self.client.upload_part(
            Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=number, Body=data
        )
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def get(self, key: str) -> Iterator[bytes]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc, key) from exc

        def chunks() -> Iterator[bytes]:
            try:
                yield from body.iter_chunks(CHUNK)
            except (ClientError, BotoCoreError) as exc:
                raise self._fail(exc, key) from exc
            finally:
                body.close()

        return chunks()

    def _head(self, key: str) -> dict[str, Any] | None:
        """The object's HEAD answer; None when there is no such object."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as exc:
            error = self._fail(exc, key)
            if isinstance(error, ObjectMissing):
                return None
            raise error from exc

    def size(self, key: str) -> int | None:
        head = self._head(key)
        return None if head is None else int(head["ContentLength"])

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc) from exc

    def create(self, key: str, data: bytes) -> bool:
        """A conditional PUT (``If-None-Match: *``: AWS S3, MinIO, SeaweedFS)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*"
            )
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return False
            raise self._fail(exc) from exc
        except BotoCoreError as exc:
            raise self._fail(exc) from exc
        return True

    def modified(self, key: str) -> float | None:
        head = self._head(key)
        return None if head is None else head["LastModified"].timestamp()

    def list(self, prefix: str) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        folder = prefix.strip("/")
        if folder:
            check_key(folder)
        full = "/".join(p for p in (self.prefix, folder) if p)
        strip = f"{self.prefix}/" if self.prefix else ""
        keys: list[str] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=f"{full}/" if full else ""
            )
            for page in pages:
                keys += [o["Key"].removeprefix(strip) for o in page.get("Contents", [])]
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc) from exc
        return sorted(keys)


class _S3Writer(Writer):
    """A small object in one PUT, a larger one as a multipart upload (:data:`PART` at a time):
    either is visible whole or not at all; an aborted multipart upload's parts are dropped."""

    def __init__(self, store: S3Store, key: str, max_bytes: int | None) -> None:
        super().__init__(key, max_bytes)
        self.store = store
        self.name = store._key(key)
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (ClientError, BotoCoreError) as exc:
            raise self.store._fail(exc) from exc

    def _write(self, chunk: bytes) -> None:
        self.buffer += chunk
        if len(self.buffer) >= PART:
            s3 = self.store
            with self._calling():
                if self.upload_id is None:
                    self.upload_id = s3.client.create_multipart_upload(
                        Bucket=s3.bucket, Key=self.name
                    )["UploadId"]
                number = len(self.parts) + 1
                self.parts.append(s3._part(self.name, self.upload_id, number, bytes(self.buffer)))
            self.buffer.clear()

    def commit(self) -> Stored:
        s3 = self.store
        try:
            with self._calling():
                if self.upload_id is None:  # small: one PUT, visible whole or not at all
                    s3.client.put_object(Bucket=s3.bucket, Key=self.name, Body=bytes(self.buffer))
                else:
                    if self.buffer:
                        number = len(self.parts) + 1
                        self.parts.append(
                            s3._part(self.name, self.upload_id, number, bytes(self.buffer))
                        )
                    s3.client.complete_multipart_upload(
                        Bucket=s3.bucket,
                        Key=self.name,
                        UploadId=self.upload_id,
                        MultipartUpload={"Parts": self.parts},
                    )
                    self.upload_id = None
        except BaseException:
            self.abort()
            raise
        self.buffer.clear()
        return self.stored()

    def abort(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        self.buffer.clear()
        if self.upload_id is not None:  # drop the parts sent; where this fails too, the
            # bucket's lifecycle rule (or an operator) removes them
            s3, upload_id, self.upload_id = self.store, self.upload_id, None
            with contextlib.suppress(ClientError, BotoCoreError):
                s3.client.abort_multipart_upload(
                    Bucket=s3.bucket, Key=self.name, UploadId=upload_id
                )


RETRY_WAITS = (2.0, 5.0, 15.0)
"""Seconds a worker waits before each new try of a store that was unavailable (on top of
the client's own quick retries): a store restarting or failing over is back within them."""


def retrying(
    action: Callable[[], T],
    waits: Iterable[float] = RETRY_WAITS,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``action()``, tried again after each of ``waits`` while it raises
    :class:`StoreUnavailable`; the last one's error is raised (for the caller to fail its work
    naming the store). For a worker's writes: a request answers 503 at once instead."""
    for wait in waits:
        try:
            return action()
        except StoreUnavailable as exc:
            log.warning("%s; trying again in %.0f s", exc, wait)
            sleep(wait)
    return action()


@functools.lru_cache(maxsize=16)
def open_store(url: str) -> Store:
    """The store ``url`` names (``Settings.storage_url``: ``file:///...`` or ``s3://...``),
    made once per process (an S3 client is costly to make, and safe to share between
    threads); the AWS variables are read when it is first made."""
    if url.startswith("s3://"):
        return S3Store(url)
    return LocalStore(unquote(urlparse(url).path) if url.startswith("file://") else url)


__all__ = [
    "LocalStore",
    "ObjectMissing",
    "S3Store",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "Stored",
    "TooLarge",
    "Writer",
    "check_key",
    "open_store",
    "retrying",
    "tenant_key",
]
