"""``--json [FIELDS]`` (gh's field selection): ``--json id,status`` prints only those fields,
in that order; a bare ``--json`` prints everything, as before, wherever it stands (``jobs
wait --json ID`` still waits for ID: the word after ``--json`` is the fields unless the
command still needs it as its argument); an unknown field is exit 2 listing the valid ones,
before any request. The field lists are the API's schemas'.

The CLI runs in-process (typer's runner) against a small server thread that answers as the
API does (``tests/local_http``)."""

from __future__ import annotations

import json
import uuid

import pytest
from typer.testing import CliRunner

from tests.local_http import reply, server
from zoopick.cli import app
from zoopick.client import fields

JOB = str(uuid.UUID(int=7))
RANKING = [{"rank": 1, "model": "m1", "scores": {"sms": 0.5}, "seconds": 1.0}]
SUMMARY = {
    "id": JOB, "status": "succeeded", "progress": 1.0, "name": "first", "tags": ["a"],
    "created_at": "2026-01-01T00:00:00Z", "metrics": ["sms"], "select_by": "sms",
}  # fmt: skip


def answer(h) -> None:
    if h.path.startswith(f"/api/v1/jobs/{JOB}"):
        reply(h, {**SUMMARY, "ranking": RANKING, "chosen_model": "m1"})
    elif h.path.startswith("/api/v1/jobs"):
        reply(h, {"items": [SUMMARY], "next_page_token": None})
    else:
        reply(h, {"detail": "no"}, 404)


@pytest.fixture(scope="module")
def url():
    with server(answer) as (address, _):
        yield address


def run(*args: str, url: str):
    result = CliRunner().invoke(app, [*args, "--url", url, "--api-key", "k"])
    return result


def test_the_fields_are_the_apis():
    from zoopick.app.api import schemas

    assert tuple(schemas.JobOut.model_fields) == fields.JOB
    assert tuple(schemas.JobSummary.model_fields) == fields.JOB_SUMMARY
    assert tuple(schemas.DatasetOut.model_fields) == fields.DATASET
    assert tuple(schemas.ZooModelOut.model_fields) == fields.ZOO_MODEL


def test_json_fields_select_and_order_and_a_bare_json_prints_all(url):
    listed = run("jobs", "list", "--json", "name,id,status", url=url)
    assert listed.exit_code == 0, listed.output
    assert listed.stdout == json.dumps([{"name": "first", "id": JOB, "status": "succeeded"}],
                                       indent=2) + "\n"  # fmt: skip
    got = run("jobs", "get", JOB, "--json", "status,ranking", url=url)
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout) == {"status": "succeeded", "ranking": RANKING}
    one = run("jobs", "status", JOB, "--json", "chosen_model", url=url)  # one known field
    assert json.loads(one.stdout) == {"chosen_model": "m1"}
    # bare: the whole job, wherever --json stands (before the ID, before another option)
    for argv in (("jobs", "wait", "--json", JOB), ("jobs", "results", JOB, "--json")):
        whole = run(*argv, url=url)
        assert whole.exit_code == 0, whole.output
        assert json.loads(whole.stdout)["ranking"] == RANKING and "chosen_model" in whole.stdout
    assert json.loads(run("jobs", "list", "--json", "--limit", "1", url=url).stdout)[0] == SUMMARY


def test_an_unknown_field_is_exit_2_listing_the_valid_ones_before_any_request():
    with server(answer) as (address, seen):
        for argv in (
            ("jobs", "list", "--json", "id,bogus"),
            ("jobs", "get", JOB, "--json", "status,ranking,nope"),
            ("jobs", "status", JOB, "--json", "statsu"),
            ("zoo", "get", "resnet", "--json=arch,bogus"),
            ("jobs", "list", "--json", "ranking"),  # a job's, not a list's
        ):
            bad = run(*argv, url=address)
            assert bad.exit_code == 2, (argv, bad.output)
            text = " ".join(bad.output.replace("│", " ").split())
            assert "unknown field(s)" in text and "valid fields: id," in text, text
        assert seen.requests == []


VALUED = frozenset({"--limit", "--name"})


@pytest.mark.parametrize(
    ("args", "arguments", "rewritten"),
    [
        (["--json"], 0, ["--json=*"]),
        (["--json", "--limit", "2"], 0, ["--json=*", "--limit", "2"]),
        (["--json", "id,x"], 0, ["--json=id,x"]),
        (["--json", JOB], 1, ["--json=*", JOB]),  # the ID is still needed: not fields
        (["--json", "resnet"], 1, ["--json=*", "resnet"]),
        (["ID", "--json", "status"], 1, ["ID", "--json=status"]),
        (["ID", "--json", "statsu"], 1, ["ID", "--json=statsu"]),  # refused, fields listed
        (["--json", "id", "ID"], 1, ["--json=id", "ID"]),
        (["--name", "n", "--json", "f.npz"], 1, ["--name", "n", "--json=*", "f.npz"]),
        (["f.npz", "--name", "n", "--json", "id"], 1, ["f.npz", "--name", "n", "--json=id"]),
        (["--", "--json", "id"], 0, ["--", "--json", "id"]),
    ],
)
def test_rewrite_gives_json_the_word_after_it_unless_it_is_the_argument(args, arguments, rewritten):
    assert fields.rewrite(args, arguments, VALUED) == rewritten
