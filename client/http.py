"""``Client``: every call of the REST API a pipeline needs, with retries and typed results.

Configuration comes from the arguments, else ``ZOOPICK_URL`` and ``ZOOPICK_API_KEY`` (an
empty variable counts as unset; an empty argument is refused), else the local server. Errors
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
    NotFound,
    ServerError,
    Unreachable,
    WaitTimeout,
    ZoopickError,
    from_response,
)
from .models import Dataset, Job, ZooModel
from .retry import MAYBE_SENT, NOT_SENT, RETRY_STATUSES, RetryPolicy

DEFAULT_URL = "http://127.0.0.1:8000"
API = "/api/v1"
PROBLEM_TYPE = "urn:zoopick:problem:"
"""How every problem document of a zoopick server's ``type`` begins (RFC 9457)."""

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


def _redacted(url: str) -> str:
    """``url`` with any ``user:password@`` written as ``***@``: an error message is printed,
    often into a CI log, and must not carry a password."""
    return re.sub(r"^([^/?#]*://)?[^?#]*@", r"\1***@", url, count=1)


def _checked_url(url: str) -> str:
    """``url`` if it can address a zoopick server, else a :class:`ZoopickError` naming what
    is wrong (a usage error, exit 2) before any request. The API's path is appended to the
    URL, so a query or fragment would swallow it (``http://h?x=1`` sent every request to
    ``/?x=1/api/v1/...``); ``user:password@`` would go as Basic auth in place of the API
    key's Bearer header; port 99999 failed only when connecting, as "unreachable" (exit 4).
    A path prefix (``http://host/zoopick``, behind a proxy) is kept: the API is under it."""
    shown = f"the server URL {_redacted(url)!r}"
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise ZoopickError(f"{shown} contains a space or a control character")
    if "?" in url or "#" in url:
        raise ZoopickError(f"{shown} has a query or fragment (? or #): give the server's URL only")
    if "@" in url:  # refused before parsing: a parser's error could quote the password
        raise ZoopickError(
            f"{shown} carries a user name or password (user:password@): give the API key "
            "with --api-key or ZOOPICK_API_KEY instead"
        )
    if "://" not in url:
        raise ZoopickError(f"{shown} must start with http:// or https://")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise ZoopickError(f"{shown} is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise ZoopickError(f"{shown} has scheme {parsed.scheme!r}: use http:// or https://")
    if not parsed.host:
        raise ZoopickError(f"{shown} names no host")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ZoopickError(f"{shown} has port {parsed.port}: a port is 1 to 65535")
    return url


def _given(what: str, value: str | None, env: str) -> str | None:
    """An argument as given, else the environment variable ``env``; ``None`` when neither is.
    An explicit empty argument is a :class:`ZoopickError` (``api_key=""`` had meant
    "ZOOPICK_API_KEY's key" without a word); an empty environment variable is unset, as a
    shell reads it (CI templates often set variables empty)."""
    if value is not None:
        if not value.strip():
            raise ZoopickError(f"{what} is empty: give one, or leave it out")
        return value
    return os.environ.get(env) or None


def _header_value(what: str, value: str) -> str:
    """``value`` if an HTTP header can carry it (printable ASCII), else a :class:`ZoopickError`
    naming ``what`` (a key copied with a stray character, a non-ASCII idempotency key)."""
    if not (value.isascii() and value.isprintable()):
        raise ZoopickError(
            f"{what} contains characters an HTTP header cannot carry (printable ASCII only)"
        )
    return value


def _resource_id(kind: str, value: str) -> str:
    """A job or dataset id as it goes into a URL path: a UUID, else a :class:`ZoopickError`
    (exit 2). Put into the path as typed, ``../datasets`` had fetched the dataset list as if
    it were a job, and ``<id>/cancel`` reached another endpoint."""
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise ZoopickError(f"{value!r} is not a {kind} id (a UUID)") from None


LOG_OVERLAP = 4096
"""Characters of the log already shown that a later fetch is matched on, to find where the
new part starts once the server dropped the oldest lines."""
DROPPED = "[... older lines of the log were dropped by the server ...]\n"


def unseen_part(shown: str, text: str) -> str:
    """What of the log ``text`` follows the part already ``shown``: its continuation, or,
    when the server has dropped the oldest lines meanwhile, what comes after the last lines
    shown; when even those are gone, a line saying so and the whole of ``text``."""
    if text.startswith(shown):
        return text[len(shown) :]
    tail = shown[-LOG_OVERLAP:]
    at = text.rfind(tail)
    if tail and at >= 0:
        return text[at + len(tail) :]
    return DROPPED + text


ZOO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")


def _zoo_id(value: str) -> str:
    """A zoo model id as it goes into a URL path (the server's id pattern), else a
    :class:`ZoopickError` (exit 2): ``../jobs`` must not reach another endpoint."""
    if not ZOO_ID.fullmatch(value):
        raise ZoopickError(
            f"{value!r} is not a zoo model id (letters, digits and . _ + -, from a letter or digit)"
        )
    return value


def regular_file(dest: Path, what: str) -> Path:
    """``dest`` unless it is a link or a special file (:class:`ZoopickError`): a download is
    written beside it and renamed over it, so a link, a FIFO or a device (``/dev/full`` as
    root) would be replaced, not written through."""
    if dest.is_symlink() or (dest.exists() and not dest.is_file()):
        raise ZoopickError(
            f"{dest} is a link or a special file, not a regular file: give a file or a folder "
            f"to write {what} to"
        )
    return dest


def _parsed_items(items: Iterator[dict], parse: Callable[[dict], Any]) -> list[Any]:
    """Each listed item through ``parse``; an item of another shape is a :class:`ServerError`."""
    try:
        return [parse(item) for item in items]
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ServerError(
            f"a listed item is not what a zoopick server sends ({exc!r:.80})"
        ) from None


def _is_problem(body: Any) -> bool:
    """Whether ``body`` is a zoopick server's problem document (``urn:zoopick:problem:...``)."""
    kind = body.get("type") if isinstance(body, dict) else None
    return isinstance(kind, str) and kind.startswith(PROBLEM_TYPE)


def _parsed(response: httpx.Response, parse: Callable[[Any], Any]) -> Any:
    """``parse`` of a response's JSON; anything that is not the zoopick API's JSON (a proxy's
    HTML page, another service) is a :class:`ServerError` saying so (exit 4), not a crash."""
    try:
        return parse(response.json())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ServerError(
            f"{response.request.url} did not answer as a zoopick server does "
            f"({type(exc).__name__}: {str(exc)[:80]})"
        ) from None


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
        given = _given("the server URL", url, "ZOOPICK_URL") or DEFAULT_URL
        self.url = _checked_url(given).rstrip("/")
        key = _given("the API key", api_key, "ZOOPICK_API_KEY")
        headers = {"Authorization": f"Bearer {_header_value('the API key', key)}"} if key else {}
        self.retry = retry or RetryPolicy()
        self._timeout = timeout
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
        self,
        method: str,
        path: str,
        *,
        idempotent: bool = True,
        stream: bool = False,
        deadline: float | None = None,
        **kw: Any,
    ) -> httpx.Response:
        """Send with retries; returns a 2xx response or raises the matching error. With a
        ``deadline`` (``time.monotonic()``), no try waits past it: each try's timeout is cut
        to the time left and no retry starts after it (a wait's ``--timeout`` holds even
        against a server that accepts and never answers)."""
        attempt = 0
        while True:
            attempt += 1
            last = attempt >= self.retry.attempts
            if deadline is not None:
                left = deadline - time.monotonic()
                last = last or left <= self.retry.delay(attempt)
                kw["timeout"] = max(0.5, min(self._timeout, left))
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
        if response.status_code == 404 and not _is_problem(body):
            # a zoopick server answers every 404 with its problem document: a page or
            # another JSON (a plain web server, another service, a proxy's path) is an answer
            # that is not a zoopick server's, exit 4 as docs/guide/cli.md says, not "bad input" (2)
            return ServerError(
                f"{response.request.url} not found: is {self.url} a zoopick server? (HTTP 404)",
                status=404,
            )
        return from_response(response.status_code, body, fallback)

    def _pages(self, path: str, params: dict[str, Any], limit: int | None) -> Iterator[dict]:
        params = {k: v for k, v in params.items() if v is not None}
        seen = 0
        tokens: set[str] = set()
        while True:
            response = self._send("GET", path, params=params)
            items, token = _parsed(response, lambda b: (list(b["items"]), b.get("next_page_token")))
            for item in items:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield item
            if not token:
                return
            if token in tokens:  # a server that hands out one page forever
                raise ServerError(f"{response.request.url} repeated a page token: stopped")
            tokens.add(token)
            params["page_token"] = token

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
        return _parsed(response, Dataset.from_json)

    def get_dataset(self, dataset_id: str, *, deadline: float | None = None) -> Dataset:
        path = f"/datasets/{_resource_id('dataset', dataset_id)}"
        return _parsed(self._send("GET", path, deadline=deadline), Dataset.from_json)

    def list_datasets(
        self, *, status: str | None = None, limit: int | None = None
    ) -> list[Dataset]:
        items = self._pages("/datasets", {"status": status}, limit)
        return _parsed_items(items, Dataset.from_json)

    def delete_dataset(self, dataset_id: str) -> None:
        self._send("DELETE", f"/datasets/{_resource_id('dataset', dataset_id)}")

    def wait_dataset(
        self,
        dataset_id: str,
        *,
        timeout: float = 600,
        interval: float = 1.0,
        on_update: Callable[[Dataset], None] | None = None,
    ) -> Dataset:
        """Poll until the dataset is ``ready`` (returned) or ``invalid`` (:class:`BadRequest`
        naming why); :class:`WaitTimeout` after ``timeout`` seconds, which bound every request
        of the wait (as :meth:`wait_job`'s). ``on_update`` sees each state polled: what a
        caller still knows of the dataset when the wait ends in an error."""
        from .errors import BadRequest

        deadline = time.monotonic() + timeout
        seen: Dataset | None = None
        while True:
            try:
                ds = self.get_dataset(dataset_id, deadline=deadline)
            except Unreachable as exc:
                if time.monotonic() < deadline:
                    raise
                last = f"; last seen {seen.status}" if seen is not None else ""
                raise WaitTimeout(
                    f"dataset {dataset_id}: no answer within {timeout:g}s ({exc}){last}"
                ) from None
            seen = ds
            if on_update is not None:
                on_update(ds)
            if ds.status == "ready":
                return ds
            if ds.status == "invalid":
                raise BadRequest(f"dataset {ds.id} is invalid: {ds.error}")
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"dataset {ds.id} still {ds.status} after {timeout:g}s")
            time.sleep(max(0.05, min(interval, deadline - time.monotonic())))

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
        webhook: dict[str, Any] | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
        notes: str | None = None,
    ) -> Job:
        """Submit a job (``models=None``: the whole zoo). ``selection`` (e.g.
        ``{"shortlist": 3, "budget_epochs": 3}``) races the metric's shortlist with short
        fine-tunes before choosing. ``webhook`` (``{"url": ..., "phases": False}``) is called
        when the job ends (and at each phase with ``phases``), in place of the tenant's. The
        ``Idempotency-Key`` (a fresh one unless given) makes retries of this call return the
        same job. ``name``, ``tags`` and ``notes`` label the job (the job list searches the
        name and the tags)."""
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
        if webhook is not None:
            body["webhook"] = webhook
        labels = {"name": name, "tags": tags, "notes": notes}
        body.update({k: v for k, v in labels.items() if v is not None})
        if idempotency_key is not None and not idempotency_key.strip():
            # an unset CI variable: a fresh key would make a new job on every re-run
            raise ZoopickError("the idempotency key is empty; give one, or leave it out")
        key = _header_value("the idempotency key", idempotency_key or str(uuid.uuid4()))
        response = self._send("POST", "/jobs", json=body, headers={"Idempotency-Key": key})
        return _parsed(response, Job.from_json)

    def get_job(self, job_id: str, *, deadline: float | None = None) -> Job:
        path = f"/jobs/{_resource_id('job', job_id)}"
        return _parsed(self._send("GET", path, deadline=deadline), Job.from_json)

    results = get_job
    """A job's results: its ranking, chosen model and training curve are part of it."""

    def list_jobs(self, *, status: str | None = None, limit: int | None = None) -> list[Job]:
        """Jobs newest first, as summaries: their ``ranking`` is empty and ``training`` None
        (:meth:`get_job` for one job's results)."""
        items = self._pages("/jobs", {"status": status}, limit)
        return _parsed_items(items, Job.from_json)

    def get_job_log(self, job_id: str) -> str:
        """The log of a fine-tune job's training run: what the trainer printed, oldest first
        (bounded by the server). :class:`NotFound` when the job fine-tunes nothing or its run
        has written no log yet."""
        response = self._send("GET", f"/jobs/{_resource_id('job', job_id)}/log")
        return response.text

    def follow_job_log(
        self,
        job_id: str,
        on_text: Callable[[str], None],
        *,
        interval: float = 2.0,
        timeout: float | None = None,
        on_update: Callable[[Job], None] | None = None,
    ) -> Job:
        """Follow a job's training log as it grows, as ``tail -f`` does: ``on_text`` gets each
        new piece, in order, until the job is finished (its last lines included); returns the
        job as it ended. Before its run has written anything (queued, scoring, racing) it
        waits. :class:`NotFound` when the job ended without a log (it fine-tuned nothing, or
        failed before training); :class:`WaitTimeout` after ``timeout`` seconds (it keeps
        running). The server keeps the newest part of a long log: when the part already shown
        has been dropped, ``on_text`` gets a line saying so, then the log as it is now."""
        deadline = None if timeout is None else time.monotonic() + timeout
        shown = ""
        while True:
            job = self.get_job(job_id, deadline=deadline)
            if on_update is not None:
                on_update(job)
            if "finetune" in job.raw and job.raw["finetune"] is None:
                raise ZoopickError(f"job {job.id} fine-tunes nothing: it has no training log")
            try:
                text = self.get_job_log(job_id)
            except NotFound:
                if job.done:
                    raise
                text = None
            if text is not None:
                new = unseen_part(shown, text)
                if new:
                    on_text(new)
                shown = text
            if job.done:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"job {job.id} still {job.status} after {timeout:g}s (it keeps running)", job
                )
            wait = interval if deadline is None else min(interval, deadline - time.monotonic())
            time.sleep(max(0.05, wait))

    def cancel_job(self, job_id: str) -> Job:
        path = f"/jobs/{_resource_id('job', job_id)}/cancel"
        return _parsed(self._send("POST", path), Job.from_json)

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
        job: Job | None = None
        while True:
            try:
                job = self.get_job(job_id, deadline=deadline)
            except Unreachable as exc:
                if deadline is None or time.monotonic() < deadline:
                    raise
                seen = f"; last seen {job.status}" if job is not None else ""
                raise WaitTimeout(
                    f"job {job_id}: no answer within {timeout:g}s ({exc}){seen}", job
                ) from None
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
            path = f"/jobs/{_resource_id('job', job_id)}/model"
            response = self._send("GET", path, params=params, stream=True)
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
            regular_file(dest, "the model")
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
        except OSError as exc:
            raise ZoopickError(f"cannot write the model to {dest}: {exc.strerror or exc}") from None
        finally:
            response.close()
        expected = response.headers.get("digest", "").removeprefix("sha-256=")
        if expected and expected != digest.hexdigest():
            part.unlink(missing_ok=True)
            raise ZoopickError(f"downloaded model's SHA-256 does not match the server's {expected}")
        try:
            part.replace(dest)
        except OSError as exc:
            raise ZoopickError(f"cannot write the model to {dest}: {exc.strerror or exc}") from None
        return dest

    # -- zoo -------------------------------------------------------------------------------

    def list_zoo(self) -> list[ZooModel]:
        return _parsed_items(self._pages("/zoo", {}, None), ZooModel.from_json)

    def get_model(self, model_id: str) -> ZooModel:
        """One zoo model, with the data config timm resolves for it (``raw["data_config"]``)."""
        return _parsed(self._send("GET", f"/zoo/{_zoo_id(model_id)}"), ZooModel.from_json)

    def add_model(self, arch: str, *, weights: str = "hub", **fields: Any) -> ZooModel:
        """Register a model (an admin key): ``arch`` a timm name, with a pretrained tag if
        wanted (``resnet50.a1_in1k``) or a hub name timm knows (``hf-hub:timm/...``);
        ``weights`` "hub", "none", a checkpoint path on the workers' file system or an
        ``s3://bucket/key`` the server's S3 credentials reach; other
        fields (``id``, ``num_classes``, ``input_size``, ``mean``, ``std``, ``interpolation``,
        ``crop_pct``, ``crop_mode``, ``source``, ``tags``) as ``POST /zoo`` takes them, None
        left out. Not retried once it may have reached the server (a retry would be a 409)."""
        body = {"arch": arch, "weights": weights}
        body.update({k: v for k, v in fields.items() if v is not None})
        response = self._send("POST", "/zoo", json=body, idempotent=False)
        return _parsed(response, ZooModel.from_json)

    def remove_model(self, model_id: str) -> None:
        """Take a model out of the zoo (an admin key); jobs that used it keep their results."""
        self._send("DELETE", f"/zoo/{_zoo_id(model_id)}")


__all__ = ["Client", "JobFailed"]
