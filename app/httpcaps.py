"""Caps on a request's head (request line, each header line, the whole header block), held in
the HTTP server's protocol, before its parser sees the bytes.

uvicorn's parsers put no bound on a request head: httptools grows the URL and each header
value by concatenation (an unauthenticated 96 MiB ``Authorization`` header kept ``/healthz``
waiting 20 s), and h11 only caps the whole head (16 KiB by default) and answers it with a
plain 400. So each of uvicorn's HTTP/1.1 protocols is wrapped here: while a request's head
arrives, its bytes are counted line by line, linearly, and a head over a cap is answered
with a problem document, ``414`` for the request line and ``431`` for header fields, and the
connection closed, without feeding the parser another byte. ``zoopick serve`` runs
:data:`PROTOCOL` (``--http zoopick.app.httpcaps:AutoProtocol`` for a plain ``uvicorn``).

Why not an ASGI middleware: the app sees a request only after the server parsed its whole
head, which is where the time and memory went.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_LINE_MAX = 8 * 1024
"""Bytes of the request line (method, target, version), as nginx's default buffer."""
FIELD_MAX = 8 * 1024
"""Bytes of one header line (name, colon and value)."""
HEAD_MAX = 64 * 1024
"""Bytes of the whole head: request line and every header line."""
HEAD_SECONDS = 30.0
"""Seconds a connection may take to send a whole request head, from when one is awaited (the
connection opened, or the last response went out): the caps above bound a head's bytes, this
its time, so a client trickling a head (or sending none) cannot hold a connection and its
file descriptor forever. A head begun and unfinished gets a ``408``; a silent connection is
closed. Bodies are not timed here: uploads stream as slowly as a client likes, by design."""
PROTOCOL = "zoopick.app.httpcaps:AutoProtocol"
"""What ``uvicorn --http`` (or ``uvicorn.run(http=...)``) takes to serve with these caps."""


def refusal(status: int, detail: str) -> bytes:
    """A complete HTTP/1.1 response: the problem document, closing the connection."""
    phrase = {
        408: "Request Timeout",
        414: "URI Too Long",
        431: "Request Header Fields Too Large",
    }[status]
    body = json.dumps(
        {
            "type": "urn:zoopick:problem:" + phrase.lower().replace(" ", "-"),
            "title": phrase,
            "status": status,
            "detail": detail,
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/problem+json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


SLICE = 8 * 1024
"""Bytes fed to the parser at a time while a head arrives: the parser's own state (a new
message begun, its headers complete) is looked at between slices."""


class HeadGuard(asyncio.Protocol):
    """Counts a request head as it arrives and refuses it over a cap (mixed in before one of
    uvicorn's protocols). Where a head begins and ends is the parser's business: subclasses
    call :meth:`_head_begins` when their parser starts a message and :meth:`_head_ends` when
    its headers are complete. While a head arrives, bytes go to the parser in slices of
    :data:`SLICE`, each counted line by line first (linear); after it, whole chunks go."""

    transport: asyncio.Transport

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused = False
        self._deadline: asyncio.TimerHandle | None = None
        self._head_begins()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[safe-super]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[safe-super]

    def _head_begins(self) -> None:
        self._in_head = True
        self._counting = True  # until the empty line that ends the head
        self._head = 0  # bytes of this head so far
        self._lines = 0  # complete lines so far (0: still on the request line)
        self._line = 0  # bytes of the current line so far
        self._blank = True  # the current line holds nothing but CR so far
        self._arm()

    def _head_ends(self) -> None:
        self._in_head = False
        self._disarm()

    def _arm(self) -> None:
        """Start :data:`HEAD_SECONDS` for the head now awaited (once the connection is up)."""
        if getattr(self, "transport", None) is None or self._deadline is not None:
            return
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(HEAD_SECONDS, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self._in_head or self._refused or self.transport.is_closing():
            return
        if self._head == 0:  # nothing of a request: close quietly
            self.transport.close()
            return
        self._refuse(408, f"the request head did not arrive within {HEAD_SECONDS:g} s")

    def _refuse(self, status: int, detail: str) -> None:
        self._refused = True
        self.transport.write(refusal(status, detail))
        self.transport.close()

    def _scan(self, data: bytes) -> bool:
        """Count ``data`` against the caps; False when it was refused. Linear in ``data``."""
        pos, size = 0, len(data)
        while pos < size and self._counting:
            nl = data.find(b"\n", pos)
            end = size if nl < 0 else nl
            self._line += end - pos
            self._head += end - pos + (nl >= 0)
            if self._blank and data[pos:end].strip(b"\r"):
                self._blank = False
            if self._lines == 0 and self._line > REQUEST_LINE_MAX:
                self._refuse(414, f"the request line is over {REQUEST_LINE_MAX} bytes")
                return False
            if self._lines > 0 and self._line > FIELD_MAX:
                self._refuse(431, f"a header line is over {FIELD_MAX} bytes")
                return False
            if self._head > HEAD_MAX:
                self._refuse(431, f"the request's header block is over {HEAD_MAX} bytes")
                return False
            if nl < 0:
                break
            pos = nl + 1
            if self._blank and self._lines > 0:  # the empty line that ends the head
                self._counting = False
            elif not self._blank:  # blank lines before the request line are ignored
                self._lines += 1
            self._line, self._blank = 0, True
        return True

    def _feed(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]

    def _sync(self) -> None:
        """Look at the parser's state before the next bytes (a subclass' hook)."""

    def data_received(self, data: bytes) -> None:
        pos = 0
        while pos < len(data) and not self._refused and not self.transport.is_closing():
            self._sync()
            if not self._in_head:
                self._feed(data[pos:] if pos else data)
                return
            piece = data[pos : pos + SLICE]
            if not self._scan(piece):
                return
            self._feed(piece)
            pos += len(piece)


class H11CappedProtocol(HeadGuard, H11Protocol):
    """uvicorn's h11 protocol with the caps (h11's own, on the whole head, stays behind them):
    a head arrives while the client's side of the connection is idle."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # h11's own cap (16 KiB unless configured) would answer a plain 400 first
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_MAX + SLICE)

    def _feed(self, data: bytes) -> None:
        super()._feed(data)
        self._sync()

    def _sync(self) -> None:
        idle = self.conn.their_state is h11.IDLE
        if idle and not self._in_head:
            self._head_begins()
        elif not idle and self._in_head:
            self._head_ends()


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - uvicorn without httptools (not [standard])
    AutoProtocol: type[asyncio.Protocol] = H11CappedProtocol
else:

    class HttpToolsCappedProtocol(HeadGuard, HttpToolsProtocol):
        """uvicorn's httptools protocol with the caps: the parser says where heads are."""

        def on_message_begin(self) -> None:
            if not self._in_head:  # else its first bytes were counted already
                self._head_begins()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._head_ends()
            super().on_headers_complete()

    AutoProtocol = HttpToolsCappedProtocol
