"""Streaming multipart upload: the file part goes to disk chunk by chunk as it arrives.

Starlette's form parser would spool the whole file to a temporary file before the handler
sees it (and only then could the size limit be checked). Here the request body is fed to
python-multipart's push parser; file bytes are written (in a worker thread) and counted as
they come, so an oversized upload is cut off with 413 at the limit and memory stays at one
chunk whatever the file size.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header

from zoopick.app.problems import Problem

MAX_FIELD_BYTES = 4096
UNCAPPED_BODY = 2**62
"""The upload routes' own ``max_body_size``: they lift the app's cap on bodies
(``ZOOPICK_BODY_MAX_BYTES``, for JSON and forms) because :func:`receive_file` streams the body
and stops it at ``ZOOPICK_UPLOAD_MAX_BYTES`` itself."""
MAX_FIELDS = 16
FILE_FIELD = "file"
BODY_SLACK = 64 * 1024 + MAX_FIELDS * MAX_FIELD_BYTES
"""What a body may carry besides the file's bytes (boundaries, part headers, text fields):
every byte of the body counts against ``max_bytes + BODY_SLACK``, whatever part it is in."""


@dataclass
class Upload:
    filename: str
    path: Path
    size: int
    sha256: str
    fields: dict[str, str] = field(default_factory=dict)


@dataclass
class _Part:
    name: str | None = None
    filename: str | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)
    value: bytearray = field(default_factory=bytearray)


def check_text(value: str, what: str) -> None:
    """Refuse a NUL character (PostgreSQL text cannot hold one: it would be a 500 at insert)
    and any other control character (a name is shown in tables and terminals, where an
    escape sequence would be obeyed), as class names are refused."""
    if "\x00" in value:
        raise Problem(422, f"{what} contains a NUL character", kind="invalid-text")
    bad = next((ch for ch in value if unicodedata.category(ch) == "Cc"), None)
    if bad is not None:
        raise Problem(422, f"{what} contains a control character ({bad!r})", kind="invalid-text")


def too_large_problem(limit: int) -> Problem:
    return Problem(413, f"upload larger than the limit of {limit} bytes", kind="upload-too-large")


async def receive_file(
    request: Request, dest: Path, *, max_bytes: int, too_large: Problem | None = None
) -> Upload:
    """Parse a ``multipart/form-data`` request, streaming part ``file`` into ``dest``.

    Small text fields are returned in ``Upload.fields``. Raises :class:`Problem` (415 wrong
    content type, 413 too large, 400 malformed or no file part); ``dest`` is removed then.
    """
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not params.get(b"boundary"):
        raise Problem(
            415,
            "expected a multipart/form-data body with the dataset in a part named 'file'",
            kind="unsupported-media-type",
        )
    over = too_large or too_large_problem(max_bytes)
    length = request.headers.get("content-length")
    declared = int(length[:19]) if length and length.isascii() and length.isdigit() else 0
    if declared > max_bytes + BODY_SLACK:  # 19 digits are enough to refuse, not to overflow
        raise over
    received = 0

    state = {"size": 0, "file_parts": 0, "ended": 0}
    current = _Part()
    header_field = bytearray()
    header_value = bytearray()
    pending: list[bytes] = []
    fields: dict[str, str] = {}
    filename: list[str] = []
    digest = hashlib.sha256()
    errors: list[Problem] = []

    def on_part_begin() -> None:
        nonlocal current
        current = _Part()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_field.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.extend(data[start:end])

    def on_header_end() -> None:
        current.headers[bytes(header_field).lower()] = bytes(header_value)
        header_field.clear()
        header_value.clear()

    def on_headers_finished() -> None:
        _, disp = parse_options_header(current.headers.get(b"content-disposition", b""))
        current.name = disp.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in disp:
            current.filename = disp[b"filename"].decode("utf-8", "replace")
        if current.name == FILE_FIELD and current.filename is not None:
            state["file_parts"] += 1
            filename.append(current.filename)

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if current.name == FILE_FIELD and current.filename is not None:
            if state["file_parts"] > 1:
                return
            chunk = data[start:end]
            state["size"] += len(chunk)
            if state["size"] > max_bytes:
                if not errors:
                    errors.append(over)
                return
            pending.append(bytes(chunk))
        else:
            current.value.extend(data[start:end])
            if len(current.value) > MAX_FIELD_BYTES and not errors:
                errors.append(Problem(400, f"form field {current.name!r} too long"))

    def on_part_end() -> None:
        if current.name and current.name != FILE_FIELD:
            if len(fields) >= MAX_FIELDS:
                errors.append(Problem(400, "too many form fields"))
            fields[current.name] = current.value.decode("utf-8", "replace")

    def on_end() -> None:
        state["ended"] = 1

    parser = MultipartParser(
        params[b"boundary"],
        {
            "on_end": on_end,
            "on_part_begin": on_part_begin,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
        },
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with dest.open("wb") as out:
            async for chunk in request.stream():
                received += len(chunk)
                if received > max_bytes + BODY_SLACK:  # a second file part, or chunked
                    raise over
                try:
                    parser.write(chunk)
                except Exception as exc:  # noqa: BLE001 - python-multipart's parse errors
                    raise Problem(400, f"malformed multipart body: {exc}") from None
                if errors:
                    raise errors[0]
                if pending:
                    data = b"".join(pending)
                    pending.clear()
                    digest.update(data)
                    await anyio.to_thread.run_sync(out.write, data)
            parser.finalize()
            if errors:
                raise errors[0]
        if not state["ended"]:
            # a body cut short (client gone, proxy timeout) must not be stored as a complete
            # dataset of whatever bytes arrived
            raise Problem(
                400,
                "malformed multipart body: it ends before its closing boundary (truncated upload)",
                kind="truncated-upload",
            )
        if not filename:
            raise Problem(400, "no file part: send the dataset as form field 'file'")
        if state["file_parts"] > 1:
            raise Problem(400, "send exactly one file per upload")
        check_text(filename[0], "the file name")
        for key, value in fields.items():
            check_text(key, "a form field name")
            check_text(value, f"form field {key!r}")
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return Upload(filename[0], dest, state["size"], digest.hexdigest(), fields)
