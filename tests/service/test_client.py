"""``zoopick.client.Client`` and the ``zoopick datasets|jobs|model|zoo`` commands against a
live server (uvicorn, a Celery worker, PostgreSQL, Redis): typed results, one exception per
problem, the documented exit codes, ``--json`` keeping stdout machine-readable, and retries
(through a real proxy that loses responses) that never make a second job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.service.datafiles import npz_bytes
from tests.service.procs import free_port
from tests.service.stack import ZOO
from zoopick.client import (
    BadRequest,
    Client,
    Conflict,
    NotFound,
    Unauthorized,
    Unreachable,
    WaitTimeout,
)
from zoopick.client.retry import RetryPolicy, retry_after

MODELS = [m for m, _ in ZOO]


@pytest.fixture(scope="module")
def stack(live_server):
    return live_server.tenant("client")


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.url, stack.key, retry=RetryPolicy(attempts=3, base_delay=0.1)) as c:
        yield c


@pytest.fixture(scope="module")
def dataset(client, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ds") / "shapes.npz"
    path.write_bytes(npz_bytes(seed=2))
    seen: list[tuple[int, int]] = []
    ds = client.upload_dataset(path, name="shapes", progress=lambda d, t: seen.append((d, t)))
    assert ds.status == "uploaded" and ds.name == "shapes"
    size = path.stat().st_size
    assert seen and seen[-1] == (size, size)  # the progress reached the whole file
    assert ds.size_bytes == size
    ready = client.wait_dataset(ds.id, timeout=60, interval=0.3)
    assert ready.status == "ready" and ready.counts == {"0": 6, "1": 6, "2": 6}
    return ds.id


def cli(stack, *args: str, key: str | None = None, env: dict | None = None, timeout=120):
    """Run the installed ``zoopick`` command as a pipeline would."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("ZOOPICK_")}
    full.update(ZOOPICK_URL=stack.url, ZOOPICK_API_KEY=key or stack.key, ZOOPICK_RETRIES="2")
    full.update(env or {})
    cmd = [str(Path(sys.executable).parent / "zoopick"), *args]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout)


# -- the Python client -----------------------------------------------------------------------


def test_client_scores_a_dataset_and_ranks_every_model(client, dataset):
    job = client.submit_job(dataset, models=MODELS, metrics=["sms", "logme"], select_by="logme")
    assert job.status == "queued" and job.models == MODELS
    updates = []
    done = client.wait_job(job.id, timeout=90, interval=0.3, on_update=updates.append)
    assert done.status == "succeeded" and updates[-1].status == "succeeded"
    assert {r.model for r in done.ranking} == set(MODELS)
    logme = [r.scores["logme"] for r in done.ranking]
    assert logme == sorted(logme, reverse=True)
    assert done.chosen_model == done.ranking[0].model
    assert done.chosen_score == done.ranking[0].scores["logme"]
    assert client.results(job.id).ranking == done.ranking
    listed = {j.id: j for j in client.list_jobs(status="succeeded")}
    assert listed[job.id].chosen_model == done.chosen_model and listed[job.id].ranking == []
    assert dataset in [d.id for d in client.list_datasets()]
    zoo = {m.id: m for m in client.list_zoo()}
    assert set(zoo) >= set(MODELS) and zoo["tiny-vit"].arch == "test_vit"


def test_client_raises_one_exception_per_problem(stack, client, dataset):
    with pytest.raises(NotFound) as nf:
        client.get_job(str(uuid.uuid4()))
    assert nf.value.status == 404 and nf.value.kind == "job-not-found"
    with pytest.raises(BadRequest, match="unknown metric.*'nope'") as bad:
        client.submit_job(dataset, metrics=["nope"], select_by="nope")
    assert bad.value.exit_code == 2
    with Client(stack.url, "zp_not_a_key") as stranger, pytest.raises(Unauthorized) as no:
        stranger.list_datasets()
    assert no.value.exit_code == 4
    # another tenant does not see this tenant's dataset
    with Client(stack.url, stack.admin) as other, pytest.raises(NotFound):
        other.get_dataset(dataset)
    done = client.list_jobs(status="succeeded", limit=1)[0]
    with pytest.raises(Conflict, match="already succeeded"):
        client.cancel_job(done.id)


def test_connection_refused_is_retried_then_unreachable():
    policy = RetryPolicy(attempts=3, base_delay=0.2)
    start = time.monotonic()
    c = Client(f"http://127.0.0.1:{free_port()}", "k", retry=policy)
    with (
        c,
        pytest.raises(Unreachable, match=r"nothing answered after 3 tries \(connection refused\)"),
    ):
        c.list_zoo()
    assert time.monotonic() - start >= 0.2  # it backed off before giving up (2 waits)


def test_retry_after_reads_seconds_and_dates():
    assert retry_after("3") == 3.0
    assert retry_after(None) is None and retry_after("soon") is None
    from email.utils import formatdate

    assert 8 <= retry_after(formatdate(time.time() + 10, usegmt=True)) <= 10


class FlakyProxy:
    """A real HTTP proxy in front of the API that misbehaves on cue: ``plan`` maps
    ``"METHOD /path-prefix"`` to a list of faults used up one per matching request:
    ``"lose"`` forwards the request, then answers 502 (the response is lost on the way
    back); ``"429"`` / ``"503"`` answer that status with ``Retry-After: 1`` without
    forwarding."""

    def __init__(self, upstream: str, plan: dict[str, list[str]]) -> None:
        self.plan = plan
        self.seen: list[tuple[str, str, str | None]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                proxy.seen.append((self.command, self.path, self.headers.get("idempotency-key")))
                fault = proxy.fault(self.command, self.path)
                if fault in ("429", "503"):
                    self.send_response(int(fault))
                    self.send_header("Retry-After", "1")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                r = httpx.request(
                    self.command, upstream + self.path, content=body, headers=headers, timeout=30
                )
                if fault == "lose":
                    self.send_response(502)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_POST = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fault(self, method: str, path: str) -> str | None:
        for key, faults in self.plan.items():
            m, _, prefix = key.partition(" ")
            if m == method and path.startswith(prefix) and faults:
                return faults.pop(0)
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_retried_submit_never_makes_two_jobs(stack, client, dataset):
    before = len(client.list_jobs())
    proxy = FlakyProxy(stack.url, {"POST /api/v1/jobs": ["lose", "429"]})
    try:
        with Client(proxy.url, stack.key, retry=RetryPolicy(attempts=4, base_delay=0.1)) as c:
            start = time.monotonic()
            job = c.submit_job(dataset, models=MODELS[:1], metrics=["logme"], select_by="logme")
            elapsed = time.monotonic() - start
    finally:
        proxy.close()
    posts = [s for s in proxy.seen if s[0] == "POST"]
    assert len(posts) == 3  # lost, throttled, answered
    assert len({key for _, _, key in posts}) == 1 and posts[0][2]  # one Idempotency-Key
    assert elapsed >= 1.0  # the 429's Retry-After was honoured
    jobs = client.list_jobs()
    assert len(jobs) == before + 1  # the lost first try made the only job
    assert jobs[0].id == job.id
    client.wait_job(job.id, timeout=90, interval=0.3)


def test_a_persisting_503_is_a_server_error_after_the_retries(stack):
    proxy = FlakyProxy(stack.url, {"GET /api/v1/zoo": ["503", "503"]})
    try:
        from zoopick.client import ServerError

        with Client(proxy.url, stack.key, retry=RetryPolicy(attempts=2, max_delay=0.1)) as c:
            with pytest.raises(ServerError) as err:
                c.list_zoo()
            assert err.value.status == 503 and err.value.exit_code == 4
            assert {m.id for m in c.list_zoo()} >= set(MODELS)  # the server is fine again
    finally:
        proxy.close()


# -- the command line ------------------------------------------------------------------------


def test_cli_pipeline_with_exit_codes(stack, tmp_path):
    data = tmp_path / "d.npz"
    data.write_bytes(npz_bytes(seed=6))
    up = cli(stack, "datasets", "upload", str(data), "--wait", "--json")
    assert up.returncode == 0, up.stderr
    ds = json.loads(up.stdout)  # stdout is the JSON alone; messages went to stderr
    assert ds["status"] == "ready" and "uploaded d.npz" in up.stderr

    listed = cli(stack, "datasets", "list", "--json")
    assert ds["id"] in [d["id"] for d in json.loads(listed.stdout)]
    # stdout is a pipe, not a terminal: the table keeps its full width whatever COLUMNS says
    # (ids are copied from it), and a row has the id and the date that tell same names apart
    table = cli(stack, "datasets", "list", env={"COLUMNS": "40"})
    assert table.returncode == 0, table.stderr
    row = next((line for line in table.stdout.splitlines() if ds["id"] in line), None)
    assert row is not None and ds["created_at"] in row and "d.npz" in row, table.stdout

    sub = cli(
        stack, "jobs", "submit", "--dataset", ds["id"], "--models", ",".join(MODELS),
        "--metric", "sms", "--metric", "logme", "--select-by", "sms", "--wait", "--json",
    )  # fmt: skip
    assert sub.returncode == 0, sub.stderr
    job = json.loads(sub.stdout)
    assert job["status"] == "succeeded" and {r["model"] for r in job["ranking"]} == set(MODELS)
    assert f"chosen model {job['chosen_model']}" in sub.stderr

    status = cli(stack, "jobs", "status", job["id"])
    assert status.returncode == 0 and status.stdout.strip() == "succeeded 100%"
    results = cli(stack, "jobs", "results", job["id"])
    assert all(m in results.stdout for m in MODELS) and f"{job['chosen_model']} *" in results.stdout
    jobs = json.loads(cli(stack, "jobs", "list", "--json").stdout)
    assert job["id"] in [j["id"] for j in jobs]
    assert job["id"] in cli(stack, "jobs", "list", env={"COLUMNS": "40"}).stdout
    zoo = json.loads(cli(stack, "zoo", "list", "--json").stdout)
    assert {m["id"] for m in zoo} >= set(MODELS)

    # 2: bad input, in one line naming the problem
    bad = cli(stack, "jobs", "submit", "--dataset", ds["id"], "--metric", "nope", "--json")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: unknown metric(s) 'nope'") and bad.stderr.count("\n") == 1
    assert cli(stack, "datasets", "upload", str(tmp_path / "missing.npz")).returncode == 2
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    unsupported = cli(stack, "datasets", "upload", str(notes))
    assert unsupported.returncode == 2 and "unsupported file" in unsupported.stderr
    nomodel = cli(stack, "model", "download", job["id"], "-o", str(tmp_path / "m.safetensors"))
    assert nomodel.returncode == 2 and "does not fine-tune" in nomodel.stderr
    assert cli(stack, "jobs", "submit").returncode == 2  # usage: --dataset missing

    # 3: timed out waiting (the job goes on); then cancelled: 1
    slow = cli(
        stack, "jobs", "submit", "--dataset", ds["id"], "--models", "tiny-resnet",
        "--metric", "logme", "--select-by", "logme", "--finetune-epochs", "50",
        "--compressor", "dense", "--workers", "1", "--wait", "--timeout", "0.5", "--json",
    )  # fmt: skip
    assert slow.returncode == 3, slow.stderr
    jid = slow.stderr.split("submitted job ")[1].split()[0]
    assert "still" in slow.stderr and "after 0.5s" in slow.stderr
    # --json prints the job on a timeout too (as last seen): a pipeline always gets its id
    assert json.loads(slow.stdout)["id"] == jid
    assert cli(stack, "jobs", "cancel", jid).returncode == 0
    waited = cli(stack, "jobs", "wait", jid, "--json", "--timeout", "90")
    assert waited.returncode == 1, waited.stderr
    assert json.loads(waited.stdout)["status"] == "cancelled"

    # 4: unauthorised, or nobody there
    denied = cli(stack, "zoo", "list", key="zp_wrong")
    assert denied.returncode == 4 and "invalid or revoked API key" in denied.stderr
    gone = cli(stack, "zoo", "list", "--url", f"http://127.0.0.1:{free_port()}")
    assert gone.returncode == 4 and "cannot reach" in gone.stderr
    assert "nothing answered" in gone.stderr and "Error" not in gone.stderr  # no class names


def test_cli_shows_hostile_names_as_text_and_refuses_bad_arguments_in_one_line(
    stack, client, dataset, tmp_path
):
    # a dataset name that is Rich markup: listed as plain text (it made `datasets list` fail
    # with a traceback, exit 1); a control character in a name is refused by the server now
    data = tmp_path / "named.npz"
    data.write_bytes(npz_bytes(seed=8))
    named = client.upload_dataset(data, name="[/bold] x [red]y")
    client.wait_dataset(named.id, timeout=60, interval=0.3)
    for args in (("datasets", "list"), ("datasets", "get", named.id)):
        shown = cli(stack, *args)
        assert shown.returncode == 0, shown.stderr
        assert "[/bold] x [red]y" in shown.stdout
    with pytest.raises(BadRequest, match="control character"):
        client.upload_dataset(data, name="x \x1b[31mred")

    def one_line_usage_error(run, needle):
        assert run.returncode == 2, (run.returncode, run.stderr)
        assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, run.stderr
        assert needle in run.stderr and "Traceback" not in run.stderr

    submit = ("jobs", "submit", "--dataset", dataset)
    jobs_before = {j.id for j in client.list_jobs()}
    one_line_usage_error(cli(stack, *submit, "--density", "nan"), "JSON")
    one_line_usage_error(cli(stack, *submit, "--idempotency-key", "é"), "idempotency key")
    one_line_usage_error(cli(stack, "jobs", "list", env={"ZOOPICK_API_KEY": "é"}), "API key")
    one_line_usage_error(cli(stack, "jobs", "list", "--url", "http://[::1"), "server URL")
    # given but empty: the server refuses the empty list (it was sent as "all")
    empty = cli(stack, *submit, "--models", "")
    assert empty.returncode == 2 and "models" in empty.stderr, empty.stderr
    assert {j.id for j in client.list_jobs()} == jobs_before  # none of them made a job


def test_wait_timeout_from_the_client(client, dataset):
    job = client.submit_job(dataset, models=["tiny-vit"], metrics=["logme"], select_by="logme")
    with pytest.raises(WaitTimeout) as t:
        client.wait_job(job.id, timeout=0)
    assert t.value.exit_code == 3
    client.wait_job(job.id, timeout=90, interval=0.3)


# -- the zoo, managed with an admin key --------------------------------------------------------


def test_zoo_add_get_and_remove_from_the_command_line(stack):
    """``zoopick-client zoo add`` (the same commands ``zoopick zoo`` has), in-process: an admin
    adds a model with overrides and sees timm's data config; a user may read it but neither
    add nor remove (exit 4); removed, it is gone from the list and a second remove is exit 2."""
    from typer.testing import CliRunner

    from zoopick.client.main import app

    def run(*args: str, key: str = stack.admin):
        env = {"ZOOPICK_URL": stack.url, "ZOOPICK_API_KEY": key, "ZOOPICK_RETRIES": "1"}
        return CliRunner().invoke(app, ["zoo", *args], env=env)

    added = run("add", "test_resnet", "--weights", "none", "--num-classes", "3")
    assert added.exit_code == 0, added.output  # the default id: timm's name, shown
    added = run(
        "add", "test_resnet", "--weights", "none", "--num-classes", "3", "--id", "cli-added",
        "--input-size", "3,32,32", "--tag", "cli", "--json",
    )  # fmt: skip
    assert added.exit_code == 0, added.output
    model = json.loads(added.stdout)
    assert model["id"] == "cli-added" and model["tags"] == ["cli"]
    assert model["data_config"]["input_size"] == [3, 32, 32]
    shown = run("get", "cli-added", key=stack.key)
    assert shown.exit_code == 0, shown.output
    assert "data config: input 3x32x32, bilinear" in shown.stdout
    refused = run("add", "test_vit", "--weights", "none", "--num-classes", "3", key=stack.key)
    assert refused.exit_code == 4 and "admin" in refused.output
    bad = run("add", "test_resnet", "--mean", "0.5,0.5", "--num-classes", "3")
    assert bad.exit_code == 2 and "--mean '0.5,0.5'" in bad.output
    assert run("remove", "cli-added", key=stack.key).exit_code == 4
    removed = run("remove", "cli-added")
    assert removed.exit_code == 0 and "removed cli-added" in removed.output
    listed = run("list", "--json", key=stack.key)
    assert "cli-added" not in {m["id"] for m in json.loads(listed.stdout)}
    again = run("remove", "cli-added")
    assert again.exit_code == 2 and "cli-added" in again.output
    assert run("remove", "../jobs").exit_code == 2
    # other tests of this server score the whole zoo: leave it as it was
    assert run("remove", "test_resnet").exit_code == 0
