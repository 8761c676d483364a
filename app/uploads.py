"""Streaming multipart upload: the file part goes to the store chunk by chunk as it arrives.

Starlette's form parser would spool the whole file to a temporary file before the handler
sees it (and only then could the size limit be checked). Here the request body is fed to
python-multipart's push parser; file bytes are written (in a worker thread) through a
``storage.Writer`` of the object the file becomes (a local folder or S3), which counts them,
hashes them and refuses them past the limit as they come: an oversized upload is cut off with
413 at the limit, memory stays at one chunk (one S3 part) whatever the file size, and the
object becomes visible only once the whole body has arrived and been checked. A request that
fails or is cancelled part-way leaves nothing in the store.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header

from zoopick.app.problems import Problem
from zoopick.service.storage import Store, TooLarge, Writer

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
    key: str
    size: int
    sha256: str
    fields: dict[str, str] = field(default_factory=dict)


@dataclass
class _Part:
    name: str | None = None
    filename: str | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)
    value: bytearray = field(default_factory=bytearray)

    @property
    def is_file(self) -> bool:
        return self.name == FILE_FIELD and self.filename is not None


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


class _Form:
    """python-multipart's push parser and what its callbacks collect: the text fields, the
    file part's name, the file bytes not yet written (:meth:`take`), the first problem met."""

    def __init__(self, boundary: bytes) -> None:
        self.current = _Part()
        self.header_field = bytearray()
        self.header_value = bytearray()
        self.pending: list[bytes] = []
        self.fields: dict[str, str] = {}
        self.filenames: list[str] = []
        self.errors: list[Problem] = []
        self.ended = False
        self.parser = MultipartParser(
            boundary,
            {
                "on_end": self._on_end,
                "on_part_begin": self._on_part_begin,
                "on_part_data": self._on_part_data,
                "on_part_end": self._on_part_end,
                "on_header_field": self._on_header_field,
                "on_header_value": self._on_header_value,
                "on_header_end": self._on_header_end,
                "on_headers_finished": self._on_headers_finished,
            },
        )

    def feed(self, chunk: bytes) -> None:
        """Parse the next piece of the body; :class:`Problem` on a malformed one."""
        try:
            self.parser.write(chunk)
        except Exception as exc:  # noqa: BLE001 - python-multipart's parse errors
            raise Problem(400, f"malformed multipart body: {exc}") from None
        if self.errors:
            raise self.errors[0]

    def take(self) -> bytes:
        """The file's bytes parsed since the last call."""
        data = b"".join(self.pending)
        self.pending.clear()
        return data

    def finish(self) -> str:
        """Check the whole body once it has arrived; the file part's name."""
        self.parser.finalize()
        if self.errors:
            raise self.errors[0]
        if not self.ended:
            # a body cut short (client gone, proxy timeout) must not be stored as a complete
            # dataset of whatever bytes arrived
            raise Problem(
                400,
                "malformed multipart body: it ends before its closing boundary (truncated upload)",
                kind="truncated-upload",
            )
        if not self.filenames:
            raise Problem(400, "no file part: send the dataset as form field 'file'")
        if len(self.filenames) > 1:
            raise Problem(400, "send exactly one file per upload")
        check_text(self.filenames[0], "the file name")
        for key, value in self.fields.items():
            check_text(key, "a form field name")
            check_text(value, f"form field {key!r}")
        return self.filenames[0]

    def _on_part_begin(self) -> None:
        self.current = _Part()

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_field.extend(data[start:end])

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value.extend(data[start:end])

    def _on_header_end(self) -> None:
        self.current.headers[bytes(self.header_field).lower()] = bytes(self.header_value)
        self.header_field.clear()
        self.header_value.clear()

    def _on_headers_finished(self) -> None:
        part = self.current
        _, disp = parse_options_header(part.headers.get(b"content-disposition", b""))
        part.name = disp.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in disp:
            part.filename = disp[b"filename"].decode("utf-8", "replace")
        if part.is_file:
            self.filenames.append(part.filename or "")

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self.current
        if part.is_file:
            if len(self.filenames) == 1:  # a second file part is refused at the end
                self.pending.append(bytes(data[start:end]))
            return
        part.value.extend(data[start:end])
        if len(part.value) > MAX_FIELD_BYTES and not self.errors:
            self.errors.append(Problem(400, f"form field {part.name!r} too long"))

    def _on_part_end(self) -> None:
        part = self.current
        if part.name and part.name != FILE_FIELD:
            if len(self.fields) >= MAX_FIELDS:
                self.errors.append(Problem(400, "too many form fields"))
            self.fields[part.name] = part.value.decode("utf-8", "replace")

    def _on_end(self) -> None:
        self.ended = True


def _boundary(request: Request, max_bytes: int, over: Problem) -> bytes:
    """The body's multipart boundary (415 for another kind of body); a body declared larger
    than the limit allows is refused before a byte of it is read."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not params.get(b"boundary"):
        raise Problem(
            415,
            "expected a multipart/form-data body with the dataset in a part named 'file'",
            kind="unsupported-media-type",
        )
    length = request.headers.get("content-length")
    declared = int(length[:19]) if length and length.isascii() and length.isdigit() else 0
    if declared > max_bytes + BODY_SLACK:  # 19 digits are enough to refuse, not to overflow
        raise over
    return params[b"boundary"]


async def receive_file(
    request: Request,
    store: Store,
    key_of: Callable[[str], str],
    *,
    max_bytes: int,
    too_large: Problem | None = None,
) -> Upload:
    """Parse a ``multipart/form-data`` request, streaming part ``file`` into ``store`` under
    ``key_of(its file name)``.

    Small text fields are returned in ``Upload.fields``. Raises :class:`Problem` (415 wrong
    content type, 413 too large, 400 malformed or no file part) or ``StoreUnavailable``;
    nothing is stored then.
    """
    over = too_large or too_large_problem(max_bytes)
    form = _Form(_boundary(request, max_bytes, over))
    received = 0
    out: Writer | None = None

    async def write(data: bytes) -> None:
        nonlocal out
        if out is None:
            key = key_of(form.filenames[0])
            out = await anyio.to_thread.run_sync(lambda: store.writer(key, max_bytes=max_bytes))
        try:
            await anyio.to_thread.run_sync(out.write, data)
        except TooLarge:
            raise over from None

    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > max_bytes + BODY_SLACK:  # a second file part, or chunked
                raise over
            form.feed(chunk)
            if form.pending:
                await write(form.take())
        form.finish()
        if out is None:  # an empty file: refused by admission, named
            await write(b"")
        assert out is not None
        stored = await anyio.to_thread.run_sync(out.commit)
    except BaseException:
        if out is not None:  # even when the request is cancelled: nothing is left
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(out.abort)
        raise
    return Upload(form.filenames[0], stored.key, stored.size, stored.sha256, form.fields)
