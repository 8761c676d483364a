"""Issue 43: SIGTERM drains the API within ``ZOOPICK_SHUTDOWN_GRACE_SECONDS``. A client that
trickles an upload and never finishes it does not keep ``zoopick serve`` alive: at the
deadline its request is cancelled, the partial object in the store (the local store's
``.partial/`` file) is removed, and serve exits."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time

from tests.service.procs import Proc, free_port, poll, wait_http

SERVE = "from zoopick.service_cli import service_app; service_app()"
GRACE = 3.0


def partial_files(data):
    """The objects being written into the (local) store of the data folder."""
    return list((data / "storage" / ".partial").glob("*"))


def test_sigterm_cuts_a_trickling_upload_at_the_grace_deadline(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZOOPICK_")}
    data = tmp_path / "data"
    env.update(ZOOPICK_DATA_DIR=str(data), ZOOPICK_SHUTDOWN_GRACE_SECONDS=str(GRACE))
    port = free_port()
    cmd = [sys.executable, "-c", SERVE, "serve", "--port", str(port), "--no-demo", "--no-worker"]
    serve = Proc("serve", cmd, env, tmp_path)
    try:
        wait_http(serve, f"http://127.0.0.1:{port}/healthz", timeout=90)
        key = (data / "api-key").read_text().strip()
        head = (
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="d.npz"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n"
        )
        request = (
            f"POST /api/v1/datasets HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\n"
            f"Content-Length: {len(head) + 1_000_000}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(request + head + b"x" * 1000)
            parts = poll(
                lambda: partial_files(data),
                bool,
                timeout=30,
                what="the upload's partial file",
            )
            os.kill(serve.proc.pid, signal.SIGTERM)
            sent = time.monotonic()
            # the client keeps trickling: only the deadline ends its request
            while serve.proc.poll() is None and time.monotonic() - sent < GRACE + 20:
                with contextlib.suppress(OSError):  # cut off: keep waiting for the exit
                    sock.sendall(b"x")
                time.sleep(0.2)
            took = time.monotonic() - sent
        assert serve.proc.poll() is not None, f"serve still running {took:.1f} s after SIGTERM"
        assert took < GRACE + 8, f"serve took {took:.1f} s to exit (grace {GRACE} s)"
        assert parts and not any(p.exists() for p in parts)
        assert partial_files(data) == []
        assert "timeout graceful shutdown exceeded" in serve.tail(200)
    finally:
        serve.stop()
