"""Hostile HTTP requests, built by hand so they reach a server exactly as sent: oversized
request lines and headers (for a raw socket), multipart bodies with extra or oversized parts
(optionally chunked), deeply nested and oversized JSON. Sizes are parameters: the suite uses
small ones, ``benchmarks/hostile`` full ones.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any


def request_head(
    path: str = "/healthz", headers: dict[str, str] | None = None, method: str = "GET"
) -> bytes:
    """A complete HTTP/1.1 request head (no body)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: hostile.test"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def huge_header_head(size: int, name: str = "Authorization", prefix: str = "Bearer ") -> bytes:
    """A request whose one header value is ``size`` bytes long (the probe's 96 MiB token)."""
    return request_head(headers={name: prefix + "a" * size})


def many_headers_head(count: int, value_size: int = 100) -> bytes:
    """A request with ``count`` small headers: each under any per-line cap, together not."""
    return request_head(headers={f"X-Filler-{i}": "v" * value_size for i in range(count)})


def long_target_head(size: int) -> bytes:
    """A request line with a ``size``-byte target."""
    return request_head(path="/healthz?q=" + "a" * size)


def send_raw(
    host: str, port: int, data: bytes, *, chunk: int = 64 * 1024, timeout: float = 10
) -> tuple[int, bytes]:
    """Send ``data`` over a fresh connection and read the answer until the server closes or
    the response is complete: (status, raw response). A server that closes mid-send (as it
    should, after refusing a head) is not an error."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        try:
            for i in range(0, len(data), chunk):
                sock.sendall(data[i : i + chunk])
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not _complete(answer):
                got = sock.recv(65536)
                if not got:
                    break
                answer += got
        except ConnectionResetError:
            pass
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, answer


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False


# -- multipart --------------------------------------------------------------------------------

BOUNDARY = "hostile-boundary"


def part(name: str, data: bytes, filename: str | None = None) -> bytes:
    """One multipart part (``filename`` makes it a file part)."""
    disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    head = f"--{BOUNDARY}\r\nContent-Disposition: {disp}\r\n"
    if filename:
        head += "Content-Type: application/octet-stream\r\n"
    return head.encode() + b"\r\n" + data + b"\r\n"


def multipart_chunks(
    parts: list[bytes], *, filler_part: tuple[str, str, int] | None = None, chunk: int = 1 << 16
) -> Iterator[bytes]:
    """A multipart body as a stream (sent chunked, no Content-Length): ``parts`` then, with
    ``filler_part=(name, filename, size)``, a part of ``size`` zero bytes made on the fly."""
    yield from parts
    if filler_part is not None:
        name, filename, size = filler_part
        disp = f'form-data; name="{name}"; filename="{filename}"'
        yield f"--{BOUNDARY}\r\nContent-Disposition: {disp}\r\n\r\n".encode()
        block = bytes(chunk)
        for _ in range(size // chunk):
            yield block
        yield bytes(size % chunk) + b"\r\n"
    yield f"--{BOUNDARY}--\r\n".encode()


def multipart_headers() -> dict[str, str]:
    return {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


# -- JSON ---------------------------------------------------------------------------------------


def nested(depth: int, leaf: Any = 1) -> Any:
    """``{"a": {"a": ... leaf}}`` ``depth`` objects deep (built without recursion)."""
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def nested_json_text(depth: int) -> str:
    """``[[[...]]]`` ``depth`` arrays deep, as text (deeper than ``json.dumps`` would go)."""
    return "[" * depth + "]" * depth


def big_json(size: int) -> bytes:
    """A JSON object of about ``size`` bytes (one long string member)."""
    return json.dumps({"pad": "x" * size}).encode()


def open_string_of_escapes(size: int, trailing_backslash: bool = False) -> bytes:
    """About ``size`` bytes of ``"\\"\\"\\"...``: a JSON string never closed, every quote in it
    escaped (the probe that froze the API: a string pattern that fails at the end is tried
    again from every quote, quadratic time)."""
    return b'"' + b'\\"' * (size // 2) + (b"\\" if trailing_backslash else b"")
