"""``Client``: every call of the REST API a pipeline needs, with retries and typed results.

Configuration comes from the arguments, else ``ZOOPICK_URL`` and ``ZOOPICK_API_KEY``. Errors
raise the exception of :mod:`zoopick.client.errors` that names the problem; transient
failures are retried (:mod:`zoopick.client.retry`), and a job submission carries an
``Idempotency-Key`` so that a retry never makes a second job.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from .errors import (
    JobFailed,
    Unreachable,
    WaitTimeout,
    ZoopickError,
    from_response,
)
from .models import Dataset, Job, ZooModel
from .retry import MAYBE_SENT, NOT_SENT, RETRY_STATUSES, RetryPolicy

DEFAULT_URL = "http://127.0.0.1:8000"
API = "/api/v1"

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``."""


class _ProgressReader:
    """A binary file that reports how far it has been read (httpx streams multipart file
    parts by reading; it seeks back to 0 on a retry, and so does the count)."""

    def __init__(self, fh: BinaryIO, total: int, progress: Progress | None) -> None:
        self._fh = fh
        self._total = total
        self._progress = progress

    def read(self, size: int = -1) -> bytes:
        data = self._fh.read(size)
        if self._progress is not None:
            self._progress(self._fh.tell(), self._total)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._fh.seek(offset, whence)

    def tell(self) -> int:
        return self._fh.tell()


def _plain_reason(exc: Exception) -> str:
    """What went wrong on the wire, in words: no exception class names, no errno codes."""
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    text = re.sub(r"\[Errno -?\d+\]\s*", "", str(exc)).strip()
    return text[:1].lower() + text[1:] if text else "no answer"


def _checked_url(url: str) -> str:
    """``url`` if it can address a server (an http(s) URL with a host), else a
    :class:`ZoopickError` naming it (a usage error, exit 2)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise ZoopickError(f"the server URL {url!r} is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ZoopickError(f"the server URL {url!r} must be http:// or https:// and name a host")
    return url


def _header_value(what: str, value: str) -> str:
    """``value`` if an HTTP header can carry it (printable ASCII), else a :class:`ZoopickError`
    naming ``what`` (a key copied with a stray character, a non-ASCII idempotency key)."""
    if not (value.isascii() and value.isprintable()):
        raise ZoopickError(
            f"{what} contains characters an HTTP header cannot carry (printable ASCII only)"
        )
    return value


class Client:
    """A zoopick server, as one tenant (its API key) sees it."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = _checked_url((url or os.environ.get("ZOOPICK_URL") or DEFAULT_URL).rstrip("/"))
        key = api_key or os.environ.get("ZOOPICK_API_KEY")
        headers = {"Authorization": f"Bearer {_header_value('the API key', key)}"} if key else {}
        self.retry = retry or RetryPolicy()
        self._http = httpx.Client(
            base_url=self.url + API, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the one place requests are made ---------------------------------------------------

    def _send(
        self, method: str, path: str, *, idempotent: bool = True, stream: bool = False, **kw: Any
    ) -> httpx.Response:
        """Send with retries; returns a 2xx response or raises the matching error."""
        attempt = 0
        while True:
            attempt += 1
            last = attempt >= self.retry.attempts
            try:
                request = self._http.build_request(method, path, **kw)
            except ValueError as exc:  # e.g. NaN in a JSON body: no server would read it
                raise ZoopickError(f"cannot send this request: {exc}") from None
            try:
                response = self._http.send(request, stream=stream)
            except NOT_SENT + MAYBE_SENT as exc:
                retryable = isinstance(exc, NOT_SENT) or idempotent
                if last or not retryable:
                    tries = f"{attempt} tries" if attempt > 1 else "one try"
                    raise Unreachable(
                        f"cannot reach the zoopick server at {self.url}: nothing answered "
                        f"after {tries} ({_plain_reason(exc)})"
                    ) from None
                time.sleep(self.retry.delay(attempt))
                continue
            except httpx.HTTPError as exc:
                raise Unreachable(f"request to {self.url} failed: {_plain_reason(exc)}") from None
            if response.is_success:
                return response
            if response.status_code in RETRY_STATUSES and not last:
                response.close()
                time.sleep(self.retry.delay(attempt, response))
                continue
            if stream:
                response.read()
            raise self._error(response)

    def _error(self, response: httpx.Response) -> ZoopickError:
        try:
            body = response.json()
        except ValueError:
            body = None
        fallback = response.reason_phrase or f"HTTP {response.status_code}"
        if response.status_code == 404 and not isinstance(body, dict):
            fallback = f"{response.request.url} not found: is {self.url} a zoopick server?"
        return from_response(response.status_code, body, fallback)

    def _pages(self, path: str, params: dict[str, Any], limit: int | None) -> Iterator[dict]:
        params = {k: v for k, v in params.items() if v is not None}
        seen = 0
        while True:
            body = self._send("GET", path, params=params).json()
            for item in body["items"]:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield item
            if not body.get("next_page_token"):
                return
            params["page_token"] = body["next_page_token"]

    # -- datasets --------------------------------------------------------------------------

    def upload_dataset(
        self, path: str | Path, *, name: str | None = None, progress: Progress | None = None
    ) -> Dataset:
        """Upload a ``.npz`` or an ImageFolder archive (``.zip``, ``.tar``, ``.tar.gz``);
        ``progress(sent, total)`` is called as the file is read out."""
        path = Path(path)
        if not path.is_file():
            raise ZoopickError(f"no such file: {path}")
        total = path.stat().st_size
        data = {"name": name} if name else None
        with path.open("rb") as fh:
            reader = _ProgressReader(fh, total, progress)
            files = {"file": (path.name, reader, "application/octet-stream")}
            # a retry after the body was sent could store the upload twice: retry only
            # what never reached the server
            response = self._send("POST", "/datasets", files=files, data=data, idempotent=False)
        return Dataset.from_json(response.json())

    def get_dataset(self, dataset_id: str) -> Dataset:
        return Dataset.from_json(self._send("GET", f"/datasets/{dataset_id}").json())

    def list_datasets(
        self, *, status: str | None = None, limit: int | None = None
    ) -> list[Dataset]:
        items = self._pages("/datasets", {"status": status}, limit)
        return [Dataset.from_json(d) for d in items]

    def delete_dataset(self, dataset_id: str) -> None:
        self._send("DELETE", f"/datasets/{dataset_id}")

    def wait_dataset(
        self, dataset_id: str, *, timeout: float = 600, interval: float = 1.0
    ) -> Dataset:
        """Poll until the dataset is ``ready`` (returned) or ``invalid`` (:class:`BadRequest`
        naming why); :class:`WaitTimeout` after ``timeout`` seconds."""
        from .errors import BadRequest

        deadline = time.monotonic() + timeout
        while True:
            ds = self.get_dataset(dataset_id)
            if ds.status == "ready":
                return ds
            if ds.status == "invalid":
                raise BadRequest(f"dataset {ds.id} is invalid: {ds.error}")
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"dataset {ds.id} still {ds.status} after {timeout:g}s")
            time.sleep(interval)

    # -- jobs ------------------------------------------------------------------------------

    def submit_job(
        self,
        dataset_id: str,
        *,
        models: list[str] | None = None,
        metrics: list[str] | None = None,
        select_by: str | None = None,
        finetune: dict[str, Any] | None = None,
        selection: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Submit a job (``models=None``: the whole zoo). ``selection`` (e.g.
        ``{"shortlist": 3, "budget_epochs": 3}``) races the metric's shortlist with short
        fine-tunes before choosing. The ``Idempotency-Key`` (a fresh one unless given) makes
        retries of this call return the same job."""
        # an empty list goes to the server as given (which refuses it), never as "all"
        body: dict[str, Any] = {
            "dataset_id": dataset_id,
            "models": "all" if models is None else models,
        }
        if metrics is not None:
            body["metrics"] = metrics
        if select_by:
            body["select_by"] = select_by
        if finetune is not None:
            body["finetune"] = finetune
        if selection is not None:
            body["selection"] = selection
        key = _header_value("the idempotency key", idempotency_key or str(uuid.uuid4()))
        response = self._send("POST", "/jobs", json=body, headers={"Idempotency-Key": key})
        return Job.from_json(response.json())

    def get_job(self, job_id: str) -> Job:
        return Job.from_json(self._send("GET", f"/jobs/{job_id}").json())

    results = get_job
    """A job's results: its ranking, chosen model and training curve are part of it."""

    def list_jobs(self, *, status: str | None = None, limit: int | None = None) -> list[Job]:
        """Jobs newest first, as summaries: their ``ranking`` is empty and ``training`` None
        (:meth:`get_job` for one job's results)."""
        return [Job.from_json(d) for d in self._pages("/jobs", {"status": status}, limit)]

    def cancel_job(self, job_id: str) -> Job:
        return Job.from_json(self._send("POST", f"/jobs/{job_id}/cancel").json())

    def wait_job(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        interval: float = 1.0,
        on_update: Callable[[Job], None] | None = None,
        check: bool = False,
    ) -> Job:
        """Poll until the job is finished and return it. :class:`WaitTimeout` after
        ``timeout`` seconds; with ``check``, :class:`JobFailed` unless it succeeded."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get_job(job_id)
            if on_update is not None:
                on_update(job)
            if job.done:
                if check and job.status != "succeeded":
                    why = f": {job.error}" if job.error else ""
                    raise JobFailed(f"job {job.id} {job.status}{why}", job)
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"job {job.id} still {job.status} after {timeout:g}s (it keeps running)",
                    job,
                )
            wait = interval if deadline is None else min(interval, deadline - time.monotonic())
            time.sleep(max(0.05, wait))

    def download_model(
        self,
        job_id: str,
        dest: str | Path,
        *,
        format: str = "safetensors",  # noqa: A002 - the server's query parameter
        timeout: float = 600,
        progress: Progress | None = None,
        retry_export: bool = False,
    ) -> Path:
        """Save the fine-tuned model of a succeeded job to ``dest`` (a file, or a folder to
        put it in under the server's file name), checked against the server's SHA-256.
        ``format``: ``safetensors``, ``timm`` (a tar of the folder timm loads) or ``onnx``; the
        server makes the last two on first request, waited for up to ``timeout`` seconds.
        ``retry_export``: make a failed export again (asked once: a second failure raises)."""
        dest = Path(dest)
        deadline = time.monotonic() + timeout
        params: dict[str, str] = {"format": format}
        if retry_export:
            params["retry"] = "true"
        while True:
            response = self._send("GET", f"/jobs/{job_id}/model", params=params, stream=True)
            params.pop("retry", None)  # the polls that follow wait for that export
            if response.status_code != 202:  # 202: the export is being made
                break
            response.close()
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"the {format} export of job {job_id} took over {timeout:g} s")
            time.sleep(float(response.headers.get("retry-after") or 2))
        try:
            if dest.is_dir():
                name = response.headers.get("content-disposition", "")
                name = name.split("filename=")[-1].strip('"') if "filename=" in name else ""
                dest = dest / (Path(name).name or f"{job_id}.safetensors")
            total = int(response.headers.get("content-length") or 0)
            part = dest.with_name(dest.name + ".part")
            digest = hashlib.sha256()
            done = 0
            with part.open("wb") as out:
                for chunk in response.iter_bytes(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
        except httpx.HTTPError as exc:
            raise Unreachable(f"download of job {job_id}'s model broke off: {exc}") from None
        finally:
            response.close()
        expected = response.headers.get("digest", "").removeprefix("sha-256=")
        if expected and expected != digest.hexdigest():
            part.unlink(missing_ok=True)
            raise ZoopickError(f"downloaded model's SHA-256 does not match the server's {expected}")
        part.replace(dest)
        return dest

    # -- zoo -------------------------------------------------------------------------------

    def list_zoo(self) -> list[ZooModel]:
        return [ZooModel.from_json(d) for d in self._pages("/zoo", {}, None)]


__all__ = ["Client", "JobFailed"]
