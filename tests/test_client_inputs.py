"""The CLI's inputs and outputs at their edges: what ``--json`` still prints when a wait ends
short (invalid, timed out, the server gone), server URLs that cannot be a zoopick server's,
options given empty, a stdout that cannot encode every character, a job's training log, and its
results as people read them.

As in ``test_client_odd_servers.py``, the servers are small threads on 127.0.0.1 that answer
as the API does (or oddly, on purpose), and the CLI runs as users run it
(``python -m zoopick.cli``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from tests.local_http import Answer, reply, server
from zoopick.client import Client, ZoopickError

JOB = str(uuid.UUID(int=7))
DATASET = str(uuid.UUID(int=9))
API = "/api/v1"


def problem(h: BaseHTTPRequestHandler, status: int, detail: str) -> None:
    reply(
        h, {"type": "urn:zoopick:problem:x", "detail": detail}, status, "application/problem+json"
    )


def cli(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m zoopick.cli ARGS`` with only the ZOOPICK_ variables given here."""
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("ZOOPICK_")}
    run_env.update({"ZOOPICK_RETRIES": "1", **env})
    return subprocess.run(
        [sys.executable, "-m", "zoopick.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=run_env,
    )  # fmt: skip


def dataset(status: str, error: str | None = None, name: str = "d.npz") -> dict:
    return {
        "id": DATASET, "name": name, "status": status, "format": "npz", "size_bytes": 10,
        "error": error, "created_at": "2026-01-01T00:00:00Z",
    }  # fmt: skip


def job(status: str, **more: object) -> dict:
    return {
        "id": JOB, "status": status, "progress": 0.5, "select_by": "logme",
        "created_at": "2026-01-01T00:00:00Z", **more,
    }  # fmt: skip


def uploads_then(get: Answer) -> Answer:
    """A server that takes an upload (202, ``uploaded``) and answers its GETs with ``get``."""

    def answer(h: BaseHTTPRequestHandler) -> None:
        if h.command == "POST":
            reply(h, dataset("uploaded"), 202)
        else:
            get(h)

    return answer


@pytest.fixture
def npz(tmp_path: Path) -> Path:
    path = tmp_path / "d.npz"
    path.write_bytes(b"not checked by these servers")
    return path


# -- 1. --json prints the last state known, whatever ends the wait ---------------------------


def test_upload_wait_json_prints_the_dataset_when_it_turns_out_invalid(npz):
    """An invalid dataset was exit 2 with its id on stderr only: stdout was empty."""
    answer = uploads_then(lambda h: reply(h, dataset("invalid", "no images in it")))
    with server(answer) as (url, _):
        done = cli("datasets", "upload", str(npz), "--wait", "--json", "--url", url)
        plain = cli("datasets", "upload", str(npz), "--wait", "--url", url)
    assert done.returncode == 2 and "is invalid: no images in it" in done.stderr, done.stderr
    shown = json.loads(done.stdout)
    assert (shown["id"], shown["status"], shown["error"]) == (DATASET, "invalid", "no images in it")
    assert plain.returncode == 2 and plain.stdout == f"{DATASET}\n", plain.stdout


def test_upload_wait_json_prints_the_dataset_on_a_timeout(npz):
    answer = uploads_then(lambda h: reply(h, dataset("validating")))
    with server(answer) as (url, _):
        done = cli(
            "datasets", "upload", str(npz), "--wait", "--timeout", "1", "--json", "--url", url
        )
    assert done.returncode == 3 and "still validating after 1s" in done.stderr, done.stderr
    assert json.loads(done.stdout)["status"] == "validating"


def test_upload_wait_timeout_holds_against_a_server_that_stops_answering(npz):
    """The dataset's wait had no deadline on its requests (the job's had): the 60 s request
    timeout, then retries, where --timeout 2 asked for exit 3 within seconds."""
    release = threading.Event()
    answer = uploads_then(lambda h: release.wait(120))
    with server(answer) as (url, _):
        start = time.monotonic()
        try:
            done = cli(
                "datasets", "upload", str(npz), "--wait", "--timeout", "2", "--json",
                "--url", url, ZOOPICK_RETRIES="5", timeout=90,
            )  # fmt: skip
        finally:
            release.set()
    took = time.monotonic() - start
    assert done.returncode == 3 and "no answer within 2s" in done.stderr, done.stderr
    assert took < 30, took
    assert json.loads(done.stdout)["status"] == "uploaded"  # as the upload answered


def test_submit_wait_json_prints_the_job_when_the_server_goes_away():
    """The job was made, but a wait that ended in exit 4 left stdout empty."""

    def answer(h: BaseHTTPRequestHandler) -> None:
        if h.command == "POST":
            reply(h, job("queued"), 202)
        else:
            problem(h, 503, "down for maintenance")

    with server(answer) as (url, _):
        done = cli("jobs", "submit", "--dataset", DATASET, "--wait", "--json", "--url", url)
    assert done.returncode == 4 and "down for maintenance" in done.stderr, done.stderr
    assert json.loads(done.stdout)["id"] == JOB


def test_wait_json_prints_the_job_as_last_seen_when_the_server_goes_away():
    polls: list[int] = []

    def answer(h: BaseHTTPRequestHandler) -> None:
        polls.append(1)
        if len(polls) == 1:
            reply(h, job("running"))
        else:
            problem(h, 503, "down for maintenance")

    with server(answer) as (url, _):
        done = cli("jobs", "wait", JOB, "--json", "--url", url)
    assert done.returncode == 4, done.stderr
    shown = json.loads(done.stdout)
    assert (shown["id"], shown["status"]) == (JOB, "running")


# -- 2. server URLs that cannot be a zoopick server's -----------------------------------------


@pytest.mark.parametrize(
    ("odd", "said"),
    [
        ("{url}?page_size=1", "has a query or fragment"),
        ("{url}/#top", "has a query or fragment"),
        ("{url}?", "has a query or fragment"),
        ("http://user:secret@{host}", "carries a user name or password"),
        ("http://user:se/cret@{host}", "carries a user name or password"),
        ("http://127.0.0.1:99999", "has port 99999: a port is 1 to 65535"),
        ("http://127.0.0.1:0", "has port 0"),
        ("ftp://{host}", "has scheme 'ftp': use http:// or https://"),
        ("127.0.0.1:8000", "must start with http:// or https://"),
        ("http://", "names no host"),
        ("http:///api", "names no host"),
        ("http://{host} /", "contains a space"),
    ],
)
def test_an_odd_server_url_is_refused_naming_the_problem(odd, said):
    """A query swallowed the API's path (every request went to ``/?...``), userinfo went as
    Basic auth in place of the API key, port 99999 was "unreachable" (exit 4)."""
    odd = odd.format(url="http://127.0.0.1:8000", host="127.0.0.1:8000")
    with pytest.raises(ZoopickError) as refused:
        Client(odd, "k")
    message = str(refused.value)
    assert message.startswith("the server URL ") and said in message, message
    assert refused.value.exit_code == 2 and "secret" not in message and "cret" not in message


def test_the_cli_refuses_an_odd_server_url_in_one_line_before_any_request():
    with server(lambda h: reply(h, {"items": []})) as (url, seen):
        host = url.removeprefix("http://")
        for done, said in (
            (cli("zoo", "list", "--url", f"http://user:secret@{host}"), "user name or password"),
            (cli("zoo", "list", ZOOPICK_URL=f"{url}?page_size=1"), "query or fragment"),
            (cli("zoo", "list", "--url", "http://127.0.0.1:99999"), "port 99999"),
        ):
            assert done.returncode == 2, (done.returncode, done.stderr)
            assert done.stderr.startswith("error: the server URL ") and said in done.stderr
            assert done.stderr.count("\n") == 1 and "secret" not in done.stderr, done.stderr
    assert seen.requests == []


def test_a_server_url_with_a_path_prefix_still_works():
    """A server behind a proxy at ``/zoopick``: the API is under the prefix."""

    def answer(h: BaseHTTPRequestHandler) -> None:
        if h.path.startswith(f"/zoopick{API}/zoo"):
            reply(h, {"items": [{"id": "m", "arch": "resnet18", "num_classes": 3}]})
        else:
            problem(h, 404, "no such path")

    with server(answer) as (url, seen):
        done = cli("zoo", "list", "--json", "--url", f"{url}/zoopick/")
    assert done.returncode == 0, done.stderr
    assert [m["id"] for m in json.loads(done.stdout)] == ["m"]
    assert seen.paths() == [f"/zoopick{API}/zoo"]


# -- 3. options given empty ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("jobs", "submit", "--dataset", DATASET, "--select-by", ""), "--select-by"),
        (("jobs", "submit", "--dataset", DATASET, "--select-by", " "), "--select-by"),
        (("jobs", "submit", "--dataset", DATASET, "--compressor", ""), "--compressor"),
        (("jobs", "submit", "--dataset", ""), "--dataset"),
        (("zoo", "list", "--api-key", ""), "--api-key"),
        (("jobs", "list", "--status", ""), "--status"),
        (("datasets", "upload", "NPZ", "--name", ""), "--name"),
        (("model", "download", JOB, "-o", ""), "--output"),  # had written into "."
        (("jobs", "log", JOB, "-o", ""), "--output"),
    ],
)
def test_an_option_given_empty_is_refused_naming_it(args, option, npz):
    """``--select-by ""`` had meant the server's default metric and ``--api-key ""`` the key
    of ZOOPICK_API_KEY, without a word."""
    args = tuple(str(npz) if a == "NPZ" else a for a in args)
    with server(lambda h: reply(h, job("queued"), 202)) as (url, seen):
        done = cli(*args, "--url", url, ZOOPICK_API_KEY="k")
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr == f"error: {option} is empty: give a value, or leave the option out\n"
    assert seen.requests == []


def test_an_empty_url_option_is_refused_and_not_replaced_by_the_variable():
    with server(lambda h: reply(h, {"items": []})) as (url, seen):
        done = cli("zoo", "list", "--url", "", ZOOPICK_URL=url, ZOOPICK_API_KEY="k")
    assert done.returncode == 2 and "--url is empty" in done.stderr, done.stderr
    assert seen.requests == []


def test_empty_variables_count_as_unset_with_a_note():
    """ZOOPICK_API_KEY="" (a CI template's unset variable) sends no key, and says so;
    ZOOPICK_URL="" is the default server and ZOOPICK_RETRIES="" the default tries, and
    each says so."""
    with server(lambda h: problem(h, 401, "missing API key")) as (url, seen):
        done = cli("zoo", "list", "--url", url, ZOOPICK_API_KEY="")
    assert done.returncode == 4, done.stderr
    assert "note: ZOOPICK_API_KEY is empty: sending no API key" in done.stderr
    assert seen.requests == [("GET", f"{API}/zoo", None)]
    # an id that is not one is refused before any request: no server needed
    done = cli(
        "jobs", "status", "not-an-id", ZOOPICK_URL="", ZOOPICK_API_KEY="k", ZOOPICK_RETRIES=""
    )
    assert done.returncode == 2 and "is not a job id" in done.stderr, done.stderr
    assert "note: ZOOPICK_URL is empty: using http://127.0.0.1:8000" in done.stderr
    assert "note: ZOOPICK_RETRIES is empty: using the default tries" in done.stderr


def test_the_python_client_refuses_empty_arguments_and_reads_empty_variables_as_unset(
    monkeypatch,
):
    for kwargs, what in (({"url": ""}, "server URL"), ({"api_key": " "}, "API key")):
        with pytest.raises(ZoopickError, match=f"the {what} is empty"):
            Client(**kwargs)
    monkeypatch.setenv("ZOOPICK_API_KEY", "")
    with server(lambda h: reply(h, {"items": []})) as (url, seen):
        monkeypatch.setenv("ZOOPICK_URL", url)
        with Client(api_key=None) as client:
            assert client.list_zoo() == []
    assert seen.requests == [("GET", f"{API}/zoo", None)]


# -- 4. a stdout that cannot encode every character --------------------------------------------


def test_tables_on_an_ascii_stdout_escape_what_it_cannot_carry():
    """A model or dataset name with an accent ended ``zoo list`` in a traceback on an ASCII
    stdout (``PYTHONIOENCODING=ascii``, a CI log)."""
    zoo = [{"id": "résnet-ü", "arch": "resnet18", "num_classes": 3, "tags": ["naïve"]}]
    ds = dataset("invalid", "image 3: «bad»", name="données")

    def answer(h: BaseHTTPRequestHandler) -> None:
        reply(h, {"items": zoo} if h.path.startswith(f"{API}/zoo") else ds)

    with server(answer) as (url, _):
        listed = cli("zoo", "list", "--url", url, PYTHONIOENCODING="ascii")
        shown = cli("datasets", "get", DATASET, "--url", url, PYTHONIOENCODING="ascii")
        # a lone surrogate (valid JSON: "\ud800") cannot be written in UTF-8 either
        zoo[0]["id"] = "half\ud800"
        odd = cli("zoo", "list", "--url", url, PYTHONIOENCODING="utf-8")
    for done in (listed, shown, odd):
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert listed.stdout.isascii() and "+----" in listed.stdout  # ASCII box
    assert "r\\xe9snet-\\xfc" in listed.stdout and "na\\xefve" in listed.stdout
    assert "donn\\xe9es" in shown.stdout and "\\xabbad\\xbb" in shown.stdout
    assert "half\\ud800" in odd.stdout


# -- 5. a job's training log -------------------------------------------------------------------

LOG = "[stdout] epoch 1: loss 0.5\n[stderr] caf\u00e9 \x1b[31mred\x1b[0m\n"


def log_server(h: BaseHTTPRequestHandler) -> None:
    if h.path == f"{API}/jobs/{JOB}/log":
        reply(h, LOG.encode(), kind="text/plain; charset=utf-8")
    else:
        problem(h, 404, "this job has no training run (yet)")


def test_jobs_log_writes_the_log_to_stdout_or_a_file(tmp_path):
    with server(log_server) as (url, seen):
        piped = cli("jobs", "log", JOB, "--url", url)
        to_file = cli("jobs", "log", JOB, "-o", str(tmp_path / "train.log"), "--url", url)
        to_dir = cli("jobs", "log", JOB, "-o", str(tmp_path), "--url", url)
        with Client(url, "k") as client:
            assert client.get_job_log(JOB) == LOG
    assert piped.returncode == 0 and piped.stdout == LOG, piped.stderr  # a pipe: as written
    assert to_file.returncode == 0 and to_file.stdout == "", to_file.stderr
    assert (tmp_path / "train.log").read_text(encoding="utf-8") == LOG
    assert to_dir.returncode == 0, to_dir.stderr
    assert (tmp_path / f"train-{JOB}.log").read_text(encoding="utf-8") == LOG
    assert not list(tmp_path.glob("*.part"))
    assert seen.paths() == [f"{API}/jobs/{JOB}/log"] * 4


def test_jobs_log_refuses_bad_ids_and_reports_a_missing_log_as_exit_2(tmp_path):
    other = str(uuid.UUID(int=8))
    target = tmp_path / "mine.txt"
    target.write_text("mine")
    link = tmp_path / "link.log"
    link.symlink_to(target)
    with server(log_server) as (url, seen):
        bad = cli("jobs", "log", "../datasets", "--url", url)
        missing = cli("jobs", "log", other, "--url", url)
        onto_link = cli("jobs", "log", JOB, "-o", str(link), "--url", url)
        no_folder = cli("jobs", "log", JOB, "-o", str(tmp_path / "no" / "x.log"), "--url", url)
    assert bad.returncode == 2 and "is not a job id" in bad.stderr, bad.stderr
    assert missing.returncode == 2 and missing.stdout == "", missing.stderr
    assert missing.stderr == "error: this job has no training run (yet) (HTTP 404)\n"
    assert onto_link.returncode == 2 and "not a regular file" in onto_link.stderr
    assert link.is_symlink() and target.read_text() == "mine"
    assert no_folder.returncode == 2 and "does not exist" in no_folder.stderr
    assert seen.paths() == [f"{API}/jobs/{other}/log", f"{API}/jobs/{JOB}/log"]


# -- 6. a job's results, for people ------------------------------------------------------------


def test_results_print_floats_to_4_significant_digits_and_json_as_sent():
    """The results line read ``loss 1.638114869594574``; the JSON keeps every digit."""
    done_job = job(
        "succeeded", metrics=["logme"], chosen_model="m1",
        ranking=[{"rank": 1, "model": "m1", "scores": {"logme": 0.123456789},
                  "seconds": {"forward": 1.0}}],
        training={"model": "m1", "status": "succeeded", "world_size": 1,
                  "epochs": [{"epoch": 1, "loss": 1.638114869594574,
                              "test_accuracy": 0.8166666666666667}],
                  "recipe": {"plan": {"recipe": "auto", "optimizer": "adamw", "steps": 400,
                                      "lr_source": "search"},
                             "lr": 0.0031622776601683794, "best_step": 360}},
    )  # fmt: skip
    with server(lambda h: reply(h, done_job)) as (url, _):
        text = cli("jobs", "results", JOB, "--url", url)
        as_json = cli("jobs", "results", JOB, "--json", "--url", url)
    assert text.returncode == 0, text.stderr
    assert "fine-tuned m1: 1 epoch(s), loss 1.638, test accuracy 0.8167\n" in text.stdout
    assert "recipe auto: adamw at lr 0.003162 (search), 400 steps" in text.stdout
    assert "1.638114869594574" not in text.stdout and "0.1235" in text.stdout
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == done_job


# -- 7. following a job's training log ---------------------------------------------------------


def following_server(final: str, finetune: dict | None = {"epochs": 2}) -> Answer:  # noqa: B006
    """A job that scores (no log yet), trains (its log grows) and ends ``final``: the n-th
    poll of the job decides what the log holds."""
    polls = [0]
    steps = [("scoring", None), ("training", "epoch 1\n"), (final, "epoch 1\nepoch 2\n")]

    def answer(h: BaseHTTPRequestHandler) -> None:
        step = steps[min(polls[0], len(steps)) - 1]
        if h.path == f"{API}/jobs/{JOB}":
            polls[0] += 1
            status = steps[min(polls[0], len(steps)) - 1][0]
            reply(h, job(status, finetune=finetune))
        elif h.path == f"{API}/jobs/{JOB}/log" and step[1] is not None:
            reply(h, step[1].encode(), kind="text/plain; charset=utf-8")
        else:
            problem(h, 404, "this job has no training run (yet)")

    return answer


def test_jobs_log_follow_prints_the_log_as_it_grows_until_the_job_ends():
    with server(following_server("succeeded")) as (url, _):
        done = cli("jobs", "log", JOB, "-f", "--interval", "0.05", "--url", url)
    with server(following_server("failed")) as (url, _):
        failed = cli("jobs", "log", JOB, "--follow", "--interval", "0.05", "--url", url)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "epoch 1\nepoch 2\n"  # each line once, in order
    assert f"job {JOB} succeeded" in done.stderr
    assert failed.returncode == 1 and failed.stdout == "epoch 1\nepoch 2\n", failed.stderr


def test_jobs_log_follow_refuses_what_cannot_be_followed(tmp_path):
    with server(following_server("succeeded", finetune=None)) as (url, seen):
        nothing = cli("jobs", "log", JOB, "-f", "--url", url)
        to_file = cli("jobs", "log", JOB, "-f", "-o", str(tmp_path / "x.log"), "--url", url)
    assert nothing.returncode == 2 and "fine-tunes nothing" in nothing.stderr, nothing.stderr
    assert to_file.returncode == 2 and "--follow prints to stdout" in to_file.stderr
    assert seen.paths() == [f"{API}/jobs/{JOB}"]  # one look at the job, no wait


def test_a_followed_log_the_server_cut_shows_the_new_lines_once():
    from zoopick.client.http import DROPPED, unseen_part

    assert unseen_part("", "a\n") == "a\n"
    assert unseen_part("a\nb\n", "a\nb\nc\n") == "c\n"
    # the server dropped the oldest lines: what follows the last lines shown is new
    long = "".join(f"line {i}\n" for i in range(2000))
    assert unseen_part(long, long[5000:] + "next\n") == "next\n"
    # everything shown is gone: say so, then the log as it is
    assert unseen_part("a\n", "x\ny\n") == DROPPED + "x\ny\n"


# -- 8. every job option the API takes, from the command line ---------------------------------


def test_jobs_submit_sends_batch_size_optimizer_elastic_workers_and_a_webhook():
    def answer(h: BaseHTTPRequestHandler) -> None:
        reply(h, job("queued"), 202)

    with server(answer) as (url, seen):
        done = cli(
            "jobs", "submit", "--dataset", DATASET, "--batch-size", "32", "--optimizer", "sgd",
            "--min-workers", "1", "--max-workers", "4", "--webhook", "https://ci.example/hook",
            "--webhook-phases", "--name", "nightly", "--tag", "ci", "--tag", "resnet",
            "--notes", "from the pipeline", "--url", url,
        )  # fmt: skip
        both = cli("jobs", "submit", "--dataset", DATASET, "--workers", "2", "--max-workers", "4",
                   "--url", url)  # fmt: skip
        half = cli("jobs", "submit", "--dataset", DATASET, "--min-workers", "2", "--url", url)
        phases = cli("jobs", "submit", "--dataset", DATASET, "--webhook-phases", "--url", url)
        odd = cli("jobs", "submit", "--dataset", DATASET, "--optimizer", "lion", "--url", url)
    assert done.returncode == 0 and done.stdout.strip() == JOB, done.stderr
    (body,) = [json.loads(b) for b in seen.bodies]  # only the first reached the server
    assert body["finetune"] == {
        "batch_size": 32, "optimizer": "sgd", "workers": {"min": 1, "max": 4},
    }  # fmt: skip
    assert body["webhook"] == {"url": "https://ci.example/hook", "phases": True}
    assert (body["name"], body["tags"], body["notes"]) == (
        "nightly", ["ci", "resnet"], "from the pipeline",
    )  # fmt: skip
    assert both.returncode == 2 and "not both" in both.stderr
    assert half.returncode == 2 and "both --min-workers and --max-workers" in half.stderr
    assert phases.returncode == 2 and "--webhook-phases needs --webhook" in phases.stderr
    assert odd.returncode == 2 and "lion" in odd.stderr
