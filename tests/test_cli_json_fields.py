"""``--json [FIELDS]`` (gh's field selection): ``--json id,status`` prints only those fields,
in that order; a bare ``--json`` prints everything, as before, wherever it stands (``jobs
wait --json ID`` still waits for ID); an unknown field is exit 2 listing the valid ones,
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
            ("zoo", "get", "resnet", "--json=arch,bogus"),
            ("jobs", "list", "--json", "ranking"),  # a job's, not a list's
        ):
            bad = run(*argv, url=address)
            assert bad.exit_code == 2, (argv, bad.output)
            text = " ".join(bad.output.replace("│", " ").split())
            assert "unknown field(s)" in text and "valid fields: id," in text, text
        assert seen.requests == []


@pytest.mark.parametrize(
    ("args", "takes_arguments", "rewritten"),
    [
        (["--json"], False, ["--json=*"]),
        (["--json", "--limit", "2"], False, ["--json=*", "--limit", "2"]),
        (["--json", "id,x"], False, ["--json=id,x"]),
        (["--json", JOB], True, ["--json=*", JOB]),
        (["--json", "resnet"], True, ["--json=*", "resnet"]),  # a zoo id, not a field
        (["ID", "--json", "status"], True, ["ID", "--json=status"]),
        (["ID", "--json", "id,bogus"], True, ["ID", "--json=id,bogus"]),
        (["--", "--json", "id"], False, ["--", "--json", "id"]),
    ],
)
def test_rewrite_gives_each_json_its_value(args, takes_arguments, rewritten):
    assert fields.rewrite(args, takes_arguments) == rewritten
