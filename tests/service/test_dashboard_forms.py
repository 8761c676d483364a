"""The submit form's metrics and the jobs' own words (the API app, PostgreSQL, Redis as
broker; no worker, so submitted jobs stay queued and scores are written as a worker would):
metrics picked from the registry's list, each with a line on what it computes, and the job
page saying when two requested metrics are the same score."""

from __future__ import annotations

import re
import uuid

from tests.service.test_dashboard import _ready_dataset, _submit, csrf_of, sign_in, zoo  # noqa: F401


def test_metrics_are_picked_from_the_registry_and_coinciding_ones_are_said(
    service_app,
    make_key,
    zoo,  # noqa: F811
):
    from zoopick.selection import metrics
    from zoopick.service import jobs, pipeline
    from zoopick.service.db.models import JobStatus
    from zoopick.service.db.session import session_scope

    b = sign_in(service_app, make_key(f"met-{uuid.uuid4().hex[:6]}").token)
    form = b.get("/submit").text
    boxes = re.findall(r'<input type="checkbox" name="metrics" value="([^"]+)" ?(checked)?', form)
    assert [name for name, _ in boxes] == metrics.available()
    assert [name for name, ticked in boxes if ticked] == sorted(jobs.DEFAULT_METRICS)
    line = re.search(r"<code>isms</code> <small>([^<]+)</small>", form).group(1)
    assert "25 outputs by a fixed random linear layer" in line and "same score as sms" in line
    assert "LogME (You et al. 2021)" in form

    ds = _ready_dataset(b)
    status, loc, _ = _submit(b, dataset_id=ds, models=zoo, metrics=["sms", "isms"])
    assert status == 303, status
    jid = uuid.UUID(loc.rsplit("/", 1)[1])
    with session_scope(service_app.state.sessionmaker) as session:
        pipeline.transition(session, jid, JobStatus.scoring)
        for mid in zoo:  # 7-output heads: isms leaves them as they are
            pipeline.upsert_scores(session, jid, mid, {"sms": 0.5, "isms": 0.5}, {"forward": 1})
    page = b.get(loc).text
    assert "also pays its cold start" in page  # what the Forward s column counts
    note = re.search(r'<p class="note metric-note">([^<]+)</p>', page).group(1)
    assert note.startswith(f"sms and isms are the same score on {', '.join(sorted(zoo))}:")
    _, loc2, _ = _submit(b, dataset_id=ds, models=zoo, metrics=["sms", "logme"])
    assert "metric-note" not in b.get(loc2).text


def test_jobs_carry_a_name_tags_and_notes_are_searched_edited_and_deleted(
    service_app,
    client,
    make_key,
    zoo,  # noqa: F811
    tmp_path,
):
    """Through the form and the API: a name, tags and notes at submission, the list searched
    by them and ordered both ways, a PATCH, and deletes (a running job refused; a finished
    one gone with its files); a dataset deleted from its page, refused while a job runs on
    it."""
    from tests.service.test_downloads import _finished_job
    from zoopick.service import pipeline
    from zoopick.service.db.models import JobStatus
    from zoopick.service.db.session import session_scope

    tenant = make_key(f"lab-{uuid.uuid4().hex[:6]}")
    b = sign_in(service_app, tenant.token)
    ds = _ready_dataset(b)
    status, loc, _ = _submit(
        b, dataset_id=ds, models=zoo[0], metrics="sms", select_by="sms",
        name="Pets baseline", tags="pets, baseline_2", notes="first try",
    )  # fmt: skip
    assert status == 303
    first = loc.rsplit("/", 1)[1]
    page = b.get(loc).text
    assert "Pets baseline <small>" in page and 'href="/jobs?tag=baseline_2"' in page
    assert '<p id="job-notes" class="notes">first try</p>' in page
    _, _, refused = _submit(b, dataset_id=ds, models=zoo[0], metrics="sms", tags='a"b')
    assert "should match pattern" in re.search(r'id="tags-error">([^<]*)<', refused).group(1)
    api = {"headers": tenant.headers}
    second = client.post(
        "/api/v1/jobs",
        json={"dataset_id": ds, "models": [zoo[0]], "metrics": ["sms"], "name": "Owls",
              "tags": ["owls", "pets"]},
        **api,
    ).json()["id"]  # fmt: skip
    assert (client.get(f"/api/v1/jobs/{second}", **api).json()["tags"]) == ["owls", "pets"]

    def listed(**params) -> list[str]:
        resp = client.get("/api/v1/jobs", params=params, **api)
        assert resp.status_code == 200, resp.text
        return [j["id"] for j in resp.json()["items"]]

    assert listed(q="PETS") == [second, first]  # a tag of one, the name of the other
    assert listed(q="baseline") == [first] and listed(tag="owls") == [second]
    assert listed(tag="pet") == [] and listed(q="100%") == []  # exact tag; no wildcard
    assert listed(tag="pets", order="oldest") == [first, second]
    assert client.get("/api/v1/jobs", params={"order": "name"}, **api).status_code == 400
    rows = re.findall(r'<tr data-job="([^"]+)"', b.get("/jobs?q=owl").text)
    assert rows == [second]

    # PATCH: the fields given; null clears; a finished job's kept view changes too
    resp = client.patch(f"/api/v1/jobs/{second}", json={"notes": "big owls", "tags": []}, **api)
    assert resp.status_code == 200 and resp.json()["tags"] == [] and resp.json()["name"] == "Owls"
    assert client.patch(f"/api/v1/jobs/{second}", json={}, **api).status_code == 422
    bad = client.patch(f"/api/v1/jobs/{second}", json={"tags": ["a b"]}, **api)
    assert bad.status_code == 422 and "tags" in bad.text
    page = b.get(f"/jobs/{first}").text
    edited = b.post(
        f"/jobs/{first}/edit",
        data={"csrf": csrf_of(page), "name": "Renamed", "tags": "x y", "notes": ""},
    )
    assert edited.status_code == 303 and "Saved." in b.get(edited.headers["location"]).text
    body = client.get(f"/api/v1/jobs/{first}", **api).json()
    assert (body["name"], body["tags"], body["notes"]) == ("Renamed", ["x", "y"], None)

    # delete: refused while queued, on the API and the page; the dataset is in use too
    assert client.delete(f"/api/v1/jobs/{first}", **api).status_code == 409
    ask = b.get(f"/jobs/{first}/delete")
    assert ask.status_code == 303 and "cancel+it+first" in ask.headers["location"]
    ds_page = b.get(f"/datasets/{ds}/delete")
    assert ds_page.status_code == 200 and "Yes, delete it" in ds_page.text
    kept = b.post(f"/datasets/{ds}/delete", data={"csrf": csrf_of(ds_page.text)})
    said = b.get(kept.headers["location"]).text
    assert "Not deleted: dataset is used by 2 unfinished job" in said
    for jid in (first, second):
        with session_scope(service_app.state.sessionmaker) as session:
            pipeline.transition(session, uuid.UUID(jid), JobStatus.cancelled)
    ask = b.get(f"/jobs/{first}/delete")
    assert ask.status_code == 200 and "Yes, delete it" in ask.text
    gone = b.post(f"/jobs/{first}/delete", data={"csrf": csrf_of(ask.text)})
    assert gone.headers["location"].startswith("/jobs?")
    assert f"Job {first[:8]} deleted." in b.get(gone.headers["location"]).text
    assert client.get(f"/api/v1/jobs/{first}", **api).status_code == 404
    assert client.delete(f"/api/v1/jobs/{second}", **api).status_code == 204
    # a finished fine-tune's files go with it
    folder = tmp_path / "run"
    done = _finished_job(service_app, tenant.token, folder, b"w" * 10)
    assert (folder / "model.safetensors").exists()
    assert client.delete(f"/api/v1/jobs/{done}", **api).status_code == 204
    assert not folder.exists()
    # the dataset now free: deleted from its page
    ds_page = b.get(f"/datasets/{ds}/delete")
    deleted = b.post(f"/datasets/{ds}/delete", data={"csrf": csrf_of(ds_page.text)})
    assert deleted.headers["location"].startswith("/datasets?")
    assert "Dataset deleted." in b.get(deleted.headers["location"]).text
    assert b.get(f"/datasets/{ds}").status_code == 404
    other = make_key(f"lab-{uuid.uuid4().hex[:6]}")
    assert client.delete(f"/api/v1/jobs/{done}", headers=other.headers).status_code == 404
