"""The CLI against servers that are not well-behaved zoopick servers, and against odd uses of
its own output: a server that accepts and never answers, one that answers HTML or hands out
one page forever, ids that are not ids, a stdout closed early, a download onto a link.

The servers are small threads on 127.0.0.1 (http.server) that do just the odd thing; the CLI
runs as users run it (``python -m zoopick.cli``), so its entry point's handling is tested."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.local_http import reply, server

JOB = str(uuid.UUID(int=7))


def _job(status: str = "running") -> dict:
    return {"id": JOB, "status": status, "progress": 0.5, "created_at": "2026-01-01T00:00:00Z"}


def cli(*args: str, url: str, stdout: int = subprocess.PIPE, **env: str):
    run_env = {**os.environ, "ZOOPICK_API_KEY": "k", "ZOOPICK_RETRIES": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "zoopick.cli", *args, "--url", url],
        stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120, env=run_env,
    )  # fmt: skip


def test_a_wait_timeout_holds_against_a_server_that_never_answers():
    """It had waited out the 60 s request timeout, then retried: exit 4 after a minute or
    more, where --timeout 2 asked for exit 3 within seconds."""
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog), never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        start = time.monotonic()
        done = cli("jobs", "wait", JOB, "--timeout", "2", url=url, ZOOPICK_RETRIES="5")
        took = time.monotonic() - start
    finally:
        listener.close()
    assert done.returncode == 3, done.stderr
    assert "no answer within 2s" in done.stderr and took < 30, (took, done.stderr)


def test_answers_that_are_not_a_zoopick_servers_are_exit_4_not_a_crash():
    def html(h):
        reply(h, b"<html>a proxy's login page</html>", kind="text/html")

    def wrong_shape(h):
        reply(h, {"items": [{"name": "no id"}]})

    def same_page(h):
        reply(h, {"items": [], "next_page_token": "again"})

    for answer, said in ((html, "did not answer as a zoopick server"),
                         (wrong_shape, "not what a zoopick server sends"),
                         (same_page, "repeated a page token")):  # fmt: skip
        with server(answer) as (url, _):
            done = cli("zoo", "list", url=url)
        assert done.returncode == 4 and said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_a_plain_web_server_is_exit_4_as_readme_says(tmp_path):
    """A plain ``python -m http.server`` answers the API's paths 404 with a page (its GETs
    had exited 2, "bad input"; its POSTs 4): README's exit 4, "an answer that is not a
    zoopick server's", for every command. Another service's JSON 404 is one too; a zoopick
    server's own 404 (a problem document) stays 2 (``test_client_inputs``)."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        for args in (("jobs", "list"), ("zoo", "list"), ("jobs", "status", JOB),
                     ("jobs", "wait", JOB), ("jobs", "cancel", JOB)):  # fmt: skip
            done = cli(*args, url=url)
            assert done.returncode == 4, (args, done.stderr)
            assert "Traceback" not in done.stderr
        assert f"is {url} a zoopick server?" in cli("jobs", "list", url=url).stderr
    finally:
        httpd.shutdown()
        httpd.server_close()
    with server(lambda h: reply(h, {"detail": "Not Found"}, 404)) as (url, _):
        done = cli("datasets", "list", url=url)
    assert done.returncode == 4 and "a zoopick server?" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "bad", ["../datasets", ".", f"{JOB}/cancel", "x?page_size=1", "x\x1b[31m", ""]
)
def test_an_id_that_is_not_one_is_refused_before_any_request(bad):
    with server(lambda h: reply(h, {})) as (url, seen):
        done = cli("jobs", "status", bad, url=url)
    assert done.returncode == 2 and "is not a job id" in done.stderr, done.stderr
    assert seen.requests == [] and "Traceback" not in done.stderr


def test_a_closed_stdout_is_exit_141_not_a_failed_job():
    items = [{"id": f"model-{i}", "arch": "resnet18", "num_classes": 10} for i in range(4000)]

    def many(h):
        reply(h, {"items": items})

    with server(many) as (url, _):
        reader, writer = os.pipe()
        os.close(reader)  # the reader is gone, as `| head -1` is once it has its line
        try:
            done = cli("zoo", "list", "--json", url=url, stdout=writer)
        finally:
            os.close(writer)
    assert done.returncode == 141, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr


def test_a_download_onto_a_link_or_special_file_is_refused_and_the_link_kept(tmp_path):
    def model(h):
        reply(h, b"weights", kind="application/octet-stream", Digest="sha-256=" + "0" * 64)

    target = tmp_path / "target.bin"
    target.write_bytes(b"mine")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    fifo = tmp_path / "pipe.bin"
    os.mkfifo(fifo)
    with server(model) as (url, _):
        for dest in (link, fifo):
            done = cli("model", "download", JOB, "-o", str(dest), url=url)
            assert done.returncode == 2 and "not a regular file" in done.stderr, done.stderr
        done = cli("model", "download", JOB, "-o", str(tmp_path / "no" / "such" / "m.bin"), url=url)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert link.is_symlink() and target.read_bytes() == b"mine" and fifo.is_fifo()


def test_an_empty_idempotency_key_and_a_bad_retry_count_are_refused():
    with server(lambda h: reply(h, {})) as (url, _):
        done = cli("jobs", "submit", "--dataset", JOB, "--idempotency-key", "", url=url)
        assert done.returncode == 2 and "idempotency key is empty" in done.stderr, done.stderr
        done = cli("zoo", "list", url=url, ZOOPICK_RETRIES="abc")
        assert done.returncode == 2 and "ZOOPICK_RETRIES" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("program", "entry"),
    [("zoopick-client", "zoopick.client.main"), ("zoopick", "zoopick.cli")],
)
def test_an_interrupted_wait_names_the_command_that_was_run(program, entry):
    """Ctrl-C during a wait said "zoopick jobs wait ...", a command the light client's
    machines do not have: the hint names the command run (as its console script runs it)."""
    running = {**_job("running"), "select_by": "logme"}
    with server(lambda h: reply(h, running)) as (url, seen):
        code = (
            "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"sys.argv[0] = '/venv/bin/{program}'; from {entry} import main; main()"
        )
        env = {**os.environ, "ZOOPICK_API_KEY": "k", "ZOOPICK_RETRIES": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "jobs", "wait", JOB, "--url", url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not seen.requests and time.monotonic() < deadline:
                time.sleep(0.1)
            assert seen.requests, "the CLI never polled"
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert f"interrupted: job {JOB} keeps running ({program} jobs wait {JOB})" in stderr, stderr
