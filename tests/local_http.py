"""Small HTTP servers on 127.0.0.1 for the CLI's tests against odd or scripted servers
(``test_client_inputs.py``, ``test_client_odd_servers.py``): every request is handed to one
``answer(handler)``, and what was asked is recorded."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Seen:
    """The requests a server got: (method, path, Authorization header)."""

    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    """Each request's body, in the order of ``requests``."""

    def paths(self, method: str | None = None) -> list[str]:
        return [p for m, p, _ in self.requests if method is None or m == method]


Answer = Callable[[BaseHTTPRequestHandler], None]


@contextmanager
def server(answer: Answer) -> Iterator[tuple[str, Seen]]:
    """A server on 127.0.0.1 whose every request (its body read) is ``answer(handler)``;
    yields its URL and what it was asked."""
    seen = Seen()

    class Handler(BaseHTTPRequestHandler):
        def _handle(self) -> None:
            seen.bodies.append(self.rfile.read(int(self.headers.get("content-length") or 0)))
            seen.requests.append((self.command, self.path, self.headers.get("authorization")))
            answer(self)

        do_GET = do_POST = do_DELETE = _handle  # noqa: N815 - http.server's names

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def reply(
    h: BaseHTTPRequestHandler, body: object, status: int = 200, kind: str = "", **headers: str
) -> None:
    """Answer ``body`` (JSON unless bytes) with ``status``, content type ``kind`` (JSON by
    default) and any further ``headers``."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h.send_response(status)
    h.send_header("Content-Type", kind or "application/json")
    h.send_header("Content-Length", str(len(data)))
    for name, value in headers.items():
        h.send_header(name, value)
    h.end_headers()
    h.wfile.write(data)
