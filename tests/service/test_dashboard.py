"""The dashboard's pages over HTTP (the API app, PostgreSQL, Redis as broker; no worker, so
submitted jobs stay queued): sign-in cookie and CSRF, tenant isolation, the upload form and
its thumbnails, the submit form's errors beside their fields, the jobs list's filter and
pages, a job page's ranking with ties, charts and training curve, cancel, sign out."""

from __future__ import annotations

import re
import socket
import uuid

import pytest
from fastapi.testclient import TestClient

from tests.service.datafiles import imagefolder_zip_bytes, not_a_dataset_zip_bytes, npz_bytes

API = "/api/v1"
ZOO = ["dash-resnet", "dash-vit"]


@pytest.fixture(scope="module")
def zoo(client, admin):
    for mid, arch in zip(ZOO, ("test_resnet", "test_vit"), strict=True):
        body = {"id": mid, "arch": arch, "weights": "none", "num_classes": 7}
        body.update(input_size=[3, 32, 32], source="unit test", tags=["dash"])
        resp = client.post(f"{API}/zoo", json=body, headers=admin.headers)
        assert resp.status_code in (201, 409), resp.text
    return ZOO


def browser(app, base_url: str = "http://testserver") -> TestClient:
    return TestClient(app, base_url=base_url, follow_redirects=False)


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def sign_in(app, token: str) -> TestClient:
    b = browser(app)
    page = b.get("/login")
    resp = b.post("/login", data={"api_key": token, "csrf": csrf_of(page.text), "next": "/jobs"})
    assert resp.status_code == 303 and resp.headers["location"] == "/jobs", resp.text
    return b


def test_sign_in_sets_a_safe_session_cookie(service_app, alice):
    b = browser(service_app)
    assert b.get("/jobs").headers["location"] == "/login?next=/jobs"
    assert b.get("/").headers["location"] == "/login"
    page = b.get("/login")
    assert page.status_code == 200 and 'for="api_key"' in page.text
    token = csrf_of(page.text)
    # no CSRF token: refused; a wrong key: 401 with the reason on the page
    assert b.post("/login", data={"api_key": alice.token}).status_code == 403
    wrong = b.post("/login", data={"api_key": "zp_nope", "csrf": token})
    assert wrong.status_code == 401 and "not valid" in wrong.text
    ok = b.post("/login", data={"api_key": alice.token, "csrf": token, "next": "//evil.test"})
    assert ok.status_code == 303 and ok.headers["location"] == "/jobs"  # no off-site redirect
    cookie = ok.headers["set-cookie"]
    assert "zoopick_session=" in cookie and "HttpOnly" in cookie and "SameSite=lax" in cookie
    assert "Secure" not in cookie  # plain http (a test server)
    assert b.get("/jobs").status_code == 200

    https = browser(service_app, "https://testserver")
    page = https.get("/login")
    ok = https.post("/login", data={"api_key": alice.token, "csrf": csrf_of(page.text)})
    assert "Secure" in ok.headers["set-cookie"]

    # sign out needs the form's token, then the cookie is gone
    jobs = b.get("/jobs")
    assert b.post("/logout", data={}).status_code == 403
    out = b.post("/logout", data={"csrf": csrf_of(jobs.text)})
    assert out.status_code == 303 and 'zoopick_session=""' in out.headers["set-cookie"]
    assert b.get("/jobs").status_code == 303


def test_upload_form_validates_and_shows_classes_and_thumbnails(service_app, bob):
    b = sign_in(service_app, bob.token)
    page = b.get("/datasets")
    assert 'for="file"' in page.text
    token = csrf_of(page.text)
    files = {"file": ("pets.zip", imagefolder_zip_bytes(n_per_class=5), "application/zip")}
    assert b.post("/datasets/upload", files=files).status_code == 403  # no token
    resp = b.post(f"/datasets/upload?csrf={token}", files=files, data={"name": "pets"})
    assert resp.status_code == 303, resp.text
    ds_page = b.get(resp.headers["location"])
    assert ds_page.status_code == 200 and "pets" in ds_page.text
    assert re.search(r"<th scope=\"row\">cat</th><td>5</td>", ds_page.text)
    assert re.search(r"<th scope=\"row\">dog</th><td>5</td>", ds_page.text)
    thumbs = re.findall(
        r'<img src="(/datasets/[^"]+/thumbs/[^"]+)" alt="example of class (\w+)"', ds_page.text
    )
    assert sorted({c for _, c in thumbs}) == ["cat", "dog"] and len(thumbs) == 8  # 4 per class
    img = b.get(thumbs[0][0])
    assert img.status_code == 200 and img.content[:8] == b"\x89PNG\r\n\x1a\n"
    ds_id = resp.headers["location"].rsplit("/", 1)[1]
    assert b.get(f"/datasets/{ds_id}/thumbs/..%2F..%2Fupload.part").status_code == 404

    # an unusable archive: the API's reason, listed on the datasets page
    bad = {"file": ("notes.zip", not_a_dataset_zip_bytes(), "application/zip")}
    resp = b.post(f"/datasets/upload?csrf={token}", files=bad)
    assert resp.status_code == 303
    listing = b.get(resp.headers["location"])
    assert "not a usable dataset" in listing.text and 'id="upload-error"' in listing.text
    # the script's path: JSON in, JSON out
    resp = b.post(
        f"/datasets/upload?csrf={token}",
        files={"file": ("x.txt", b"hello", "text/plain")},
        headers={"Accept": "application/json"},
    )
    assert resp.status_code == 415 and "unsupported file" in resp.json()["detail"]


def _ready_dataset(b: TestClient) -> str:
    token = csrf_of(b.get("/datasets").text)
    files = {"file": ("shapes.npz", npz_bytes(seed=9), "application/octet-stream")}
    resp = b.post(f"/datasets/upload?csrf={token}", files=files)
    assert resp.status_code == 303
    return resp.headers["location"].rsplit("/", 1)[1]


def _submit(b: TestClient, **fields) -> tuple[int, str, str]:
    page = b.get("/submit")
    idem = re.search(r'name="idempotency_key" value="([^"]+)"', page.text).group(1)
    data = {"csrf": csrf_of(page.text), "idempotency_key": idem, **fields}
    resp = b.post("/submit", data=data)
    return resp.status_code, resp.headers.get("location", ""), resp.text


def field_error(html: str, name: str) -> str | None:
    m = re.search(rf'<p class="field-error" id="{name}-error">([^<]*)</p>', html)
    return m.group(1) if m else None


def test_submit_form_shows_the_apis_errors_beside_the_fields(service_app, make_key, zoo):
    b = sign_in(service_app, make_key(f"sub-{uuid.uuid4().hex[:6]}").token)
    ds = _ready_dataset(b)
    form = b.get("/submit").text
    assert all(f'value="{m}"' in form for m in zoo) and f'value="{ds}"' in form

    status, _, html = _submit(b, dataset_id=ds, metrics="sms, nope", select_by="sms")
    assert status == 422 and "unknown metric(s) &#39;nope&#39;" in field_error(html, "metrics")
    assert 'aria-invalid="true" aria-describedby="metrics-error"' in html
    _, _, html = _submit(b, dataset_id=ds, metrics="sms", select_by="logme")
    assert "must be one of the requested metrics" in field_error(html, "select_by")
    _, _, html = _submit(b, metrics="sms", select_by="sms")
    assert field_error(html, "dataset_id")
    _, _, html = _submit(
        b, dataset_id=ds, metrics="sms", select_by="sms", models=zoo[0],
        finetune="on", epochs="1", compressor="dense", density="5", workers="1",
    )  # fmt: skip
    assert "less than or equal to 1" in field_error(html, "density")
    _, _, html = _submit(
        b, dataset_id=ds, metrics="sms", select_by="sms", models=zoo[0],
        finetune="on", epochs="1", compressor="nosuchhook", density="0.1", workers="1",
    )  # fmt: skip
    assert "nosuchhook" in field_error(html, "compressor")
    # numbers in plain notation only, as the API takes them ("１" and "1_0" passed int())
    for odd in ("１", "1_0", "nan"):
        _, _, html = _submit(
            b, dataset_id=ds, metrics="sms", select_by="sms", models=zoo[0],
            finetune="on", epochs=odd, compressor="dense", density="0.1", workers="1",
        )  # fmt: skip
        assert field_error(html, "epochs"), odd
    # a limit's error beside the field it names (budget_epochs showed under epochs)
    _, _, html = _submit(
        b, dataset_id=ds, metrics="sms", select_by="sms", models=zoo,
        race="on", shortlist="2", budget_epochs="5000",
    )  # fmt: skip
    assert "budget_epochs above the limit" in field_error(html, "budget_epochs")
    # blank fine-tune fields take the trainer's defaults (they were refused as not numbers)
    status, loc, _ = _submit(
        b, dataset_id=ds, metrics="sms", select_by="sms", models=zoo[0],
        finetune="on", epochs="", compressor="", density="", workers="",
    )  # fmt: skip
    assert status == 303 and "/jobs/" in loc, status

    # a good one: to the job page; the same form sent twice makes one job
    page = b.get("/submit")
    idem = re.search(r'name="idempotency_key" value="([^"]+)"', page.text).group(1)
    data = {"csrf": csrf_of(page.text), "idempotency_key": idem, "dataset_id": ds}
    data.update(models=zoo, metrics="sms, logme", select_by="logme")
    first = b.post("/submit", data=data)
    again = b.post("/submit", data=data)
    assert first.status_code == 303 and first.headers["location"] == again.headers["location"]
    job_page = b.get(first.headers["location"])
    assert "queued" in job_page.text and "Cancel job" in job_page.text
    # the form offers the API's default; left blank, the API picks (here the first metric)
    assert 'id="select_by" name="select_by" type="text" value="fsms"' in page.text
    _, loc, _ = _submit(b, dataset_id=ds, models=zoo[0], metrics="knn, logme", select_by="")
    assert "<dt>Chosen by</dt><dd>knn</dd>" in b.get(loc).text


def test_jobs_list_filters_pages_and_hides_other_tenants(service_app, make_key, alice, zoo):
    from zoopick.service.db.session import session_scope

    name = f"list-{uuid.uuid4().hex[:6]}"
    b = sign_in(service_app, make_key(name).token)
    ds = _ready_dataset(b)
    ids = []
    for _ in range(3):
        _, loc, _ = _submit(b, dataset_id=ds, models=zoo[0], metrics="sms", select_by="sms")
        ids.append(loc.rsplit("/", 1)[1])
    # cancel one through its page's button (a queued job is cancelled at once): the button
    # asks first, on a page of its own (no script), and only its "yes" cancels
    page = b.get(f"/jobs/{ids[0]}")
    assert f'<form method="get" action="/jobs/{ids[0]}/cancel">' in page.text
    ask = b.get(f"/jobs/{ids[0]}/cancel")
    assert ask.status_code == 200 and "Yes, cancel this job" in ask.text, ask.text
    assert f'<form method="post" action="/jobs/{ids[0]}/cancel"' in ask.text
    assert f'<a class="button" href="/jobs/{ids[0]}">No, keep it</a>' in ask.text
    assert "It is queued." in ask.text
    with session_scope(service_app.state.sessionmaker) as session:
        from zoopick.service.db.models import Job

        assert session.get(Job, uuid.UUID(ids[0])).status == "queued"  # asking cancels nothing
    assert b.post(f"/jobs/{ids[0]}/cancel", data={}).status_code == 403  # CSRF
    resp = b.post(f"/jobs/{ids[0]}/cancel", data={"csrf": csrf_of(ask.text)})
    assert resp.status_code == 303
    assert "cancelled" in b.get(resp.headers["location"]).text
    # once finished, the question is moot: back to the job's page, saying so
    again = b.get(f"/jobs/{ids[0]}/cancel")
    assert again.status_code == 303 and again.headers["location"].startswith(f"/jobs/{ids[0]}?")
    assert "This job is already cancelled." in b.get(again.headers["location"]).text

    rows = lambda html: re.findall(r'<tr data-job="([^"]+)" data-status="(\w+)">', html)  # noqa: E731
    listed = rows(b.get("/jobs").text)
    assert [j for j, _ in listed] == ids[::-1]  # newest first, only this tenant's
    assert dict(listed)[ids[0]] == "cancelled"
    assert [j for j, _ in rows(b.get("/jobs?status=cancelled").text)] == [ids[0]]
    assert [j for j, _ in rows(b.get("/jobs?status=queued").text)] == ids[:0:-1]
    first = b.get("/jobs?page_size=2").text
    assert [j for j, _ in rows(first)] == ids[:0:-1]
    next_url = re.search(r'<a href="([^"]+)" rel="next">', first).group(1).replace("&amp;", "&")
    assert [j for j, _ in rows(b.get(next_url).text)] == [ids[0]]
    assert rows(b.get("/jobs/rows").text) == listed  # the live fragment: the same rows
    assert b.get("/jobs?status=bogus").status_code == 400
    garbled = b.get("/jobs?page_token=garbage")
    assert garbled.status_code == 400 and "invalid page_token" in garbled.text
    assert b.get("/jobs/not-a-job").status_code == 404

    # another tenant sees none of it
    a = sign_in(service_app, alice.token)
    assert not set(ids) & {j for j, _ in rows(a.get("/jobs").text)}
    other = a.get(f"/jobs/{ids[1]}")
    assert other.status_code == 404 and "no job" in other.text
    assert a.get(f"/datasets/{ds}").status_code == 404
    assert a.post(f"/jobs/{ids[1]}/cancel", data={"csrf": csrf_of(other.text)}).status_code == 404
    assert a.get(f"/jobs/{ids[1]}/cancel").status_code == 404
    with session_scope(service_app.state.sessionmaker) as session:
        from zoopick.service.db.models import Job

        assert session.get(Job, uuid.UUID(ids[1])).status == "queued"


def test_job_page_shows_ties_charts_and_the_training_curve(service_app, make_key, zoo, tmp_path):
    from zoopick.service import pipeline
    from zoopick.service.db.models import Job, JobStatus
    from zoopick.service.db.session import session_scope
    from zoopick.service.run_log import LogWriter
    from zoopick.training.config import EpochRecord, RunEvent

    token = make_key(f"page-{uuid.uuid4().hex[:6]}").token
    b = sign_in(service_app, token)
    ds = _ready_dataset(b)
    _, loc, _ = _submit(
        b, dataset_id=ds, models=zoo, metrics="sms, logme", select_by="logme", finetune="on",
        epochs="2", compressor="dense", density="1", workers="1",
    )  # fmt: skip
    jid = uuid.UUID(loc.rsplit("/", 1)[1])
    # what the workers would write, through the service core's own functions
    with session_scope(service_app.state.sessionmaker) as session:
        pipeline.transition(session, jid, JobStatus.scoring)
        pipeline.upsert_scores(
            session,
            jid,
            zoo[0],
            {"sms": 0.5, "logme": 1.25},
            {"forward": 0.4, "sms": 0.1, "logme": 0.2},
        )
        pipeline.upsert_scores(
            session,
            jid,
            zoo[1],
            {"sms": -0.75, "logme": 1.25},
            {"forward": 0.3, "sms": 0.1, "logme": 0.1},
            cached=True,
        )
        pipeline.transition(session, jid, JobStatus.training, chosen_model=zoo[0])
        job = session.get(Job, jid)
        config = {"lr": 0.0125, "epochs": 3, "out": "/srv/secret/path"}
        run = pipeline.open_run(session, job, zoo[0], config, 1, str(tmp_path))
        for e, loss, acc, sent in ((1, 2.0, 0.25, 1000), (2, 1.5, 0.5, 1200)):
            record = EpochRecord(e, loss, 0.3, acc, sent, iterations=10, dense_bytes=10_000.0)
            pipeline.record_epoch(session, run.id, record)
        # the trainer's live progress: a step of the third epoch, with its running means
        event = RunEvent(
            "progress", phase="training", epoch=3, epochs=3, step=4, steps=10, loss=1.25,
            train_acc=0.625, host="gpu-node-7",
        )  # fmt: skip
        pipeline.record_run_event(session, run.id, event)
    log = LogWriter(tmp_path)
    for i in range(60):
        log.write("stderr", f"log line {i} <b>")
    log.close()
    html = b.get(f"/jobs/{jid}").text
    # equal logme scores: both models share rank 1, shown as a tie
    assert html.count("(tie)") == 2
    assert re.search(rf'data-model="{zoo[0]}" class="chosen"', html)
    # one bar chart per metric, one bar per model, the values as scored
    for metric, values in (("sms", (0.5, -0.75)), ("logme", (1.25, 1.25))):
        chart = re.search(rf'aria-label="{metric} score per model".*?</svg>', html, re.S).group(0)
        bars = dict(re.findall(r'data-model="([^"]+)" data-value="([^"]+)"', chart))
        assert {m: float(v) for m, v in bars.items()} == dict(zip(zoo, values, strict=True))
    # loss and accuracy on their own axes, each point's value on hover, the sub-epoch point
    loss = re.search(r'aria-label="training loss".*?</svg>', html, re.S).group(0)
    assert (
        "loss (epoch) at epoch 2: 1.5<" in loss and "loss within epoch at epoch 2.4: 1.25<" in loss
    )
    acc = re.search(r'aria-label="train and test accuracy".*?</svg>', html, re.S).group(0)
    assert "test at epoch 1: 0.25<" in acc and "train (epoch) at epoch 2: 0.3<" in acc
    assert "train within epoch at epoch 2.4: 0.625<" in acc
    assert 'class="grid"' in acc and ">0.4</text>" in acc  # gridlines, ticks on 0..1
    sent = re.search(r'aria-label="bytes sent per iteration[^"]*".*?</svg>', html, re.S).group(0)
    assert "sent at epoch 2: 120<" in sent and "dense all-reduce at epoch 2: 1000<" in sent
    assert re.findall(r'<td class="share num">([^<]*)</td>', html) == ["10.0%", "12.0%"]
    assert "0.40" in html  # forward seconds of the first model
    # the same significant digits everywhere; the cached forward pass is said
    row0 = re.search(rf'<tr data-model="{zoo[0]}".*?</tr>', html, re.S).group(0)
    row1 = re.search(rf'<tr data-model="{zoo[1]}".*?</tr>', html, re.S).group(0)
    assert ">0.5000<" in row0 and ">1.250<" in row0 and ">-0.7500<" in row1
    assert "cached" in row1 and "cached" not in row0
    # live progress: phase, epoch and step, elapsed time; hosts, options, why, the log's tail
    phase = re.search(r'<span id="training-phase">([^<]*)</span>', html).group(1)
    assert phase == "epoch 3 of 3, step 4 of 10"
    assert re.search(r'<span id="training-time">[\d.]+ s elapsed', html)
    assert "gpu-node-7" in re.search(r'<td id="run-hosts">([^<]*)', html).group(1)
    assert re.search(r'<tr data-option="lr"><th scope="row">lr</th><td>0.0125</td>', html)
    assert "/srv/secret" not in html  # where the run's files are stays the server's business
    assert f"{zoo[0]} has the highest logme (1.250)" in html and "listed first" in html
    tail = re.search(r'<pre class="log" id="log-tail"[^>]*>(.*?)</pre>', html, re.S).group(1)
    assert (
        tail.splitlines()[-1] == "[stderr] log line 59 &lt;b&gt;" and len(tail.splitlines()) == 40
    )
    full = b.get(f"/jobs/{jid}/log")
    assert full.status_code == 200 and full.text.count("log line") == 60
    other = sign_in(service_app, make_key(f"other-{uuid.uuid4().hex[:6]}").token)
    assert other.get(f"/jobs/{jid}/log").status_code == 404  # tenant-scoped
    # the same from the REST API, which the page renders
    api = TestClient(service_app, headers={"Authorization": f"Bearer {token}"})
    body = api.get(f"/api/v1/jobs/{jid}").json()
    assert body["links"]["log"] == f"/api/v1/jobs/{jid}/log"
    assert body["scoring"] == {"done": 2, "total": 2, "fraction": 1.0, "never_scored": []}
    live = body["training"]["progress"]
    assert (live["phase"], live["epoch"], live["step"], live["hosts"]) == (
        "training",
        3,
        4,
        [socket.gethostname(), "gpu-node-7"],
    )
    assert body["training"]["options"] == {"lr": 0.0125, "epochs": 3}  # no "out"
    assert [r["cached"] for r in body["ranking"]] == [False, True]
    assert api.get(f"/api/v1/jobs/{jid}/log").text.count("log line") == 60

    # a second job, cancelled before a model was scored, says which never were; the two
    # side by side on the compare page (two or more, the caller's own)
    _, loc2, _ = _submit(b, dataset_id=ds, models=zoo, metrics="sms", select_by="sms")
    jid2 = loc2.rsplit("/", 1)[1]
    with session_scope(service_app.state.sessionmaker) as session:
        pipeline.transition(session, uuid.UUID(jid2), JobStatus.cancelled)
    assert re.findall(r'<li data-model="([^"]+)">', b.get(f"/jobs/{jid2}").text) == zoo
    both = b.get(f"/compare?jobs={jid}&jobs={jid2}").text
    assert f'href="/jobs/{jid}"' in both and f'href="/jobs/{jid2}"' in both
    assert len(re.findall(r'<table class="ranking sortable"', both)) == 1  # jid2 has none
    curve = re.search(r'aria-label="training loss by job".*?</svg>', both, re.S).group(0)
    assert f"{str(jid)[:8]} {zoo[0]} at epoch 2: 1.5<" in curve
    one = b.get(f"/compare?jobs={jid}")
    assert one.status_code == 400 and "pick 2 to 6 jobs" in one.text
    # not a bare "Bad Request": the jobs list again, the one tick kept, saying what to do
    assert "Bad Request" not in one.text and "<h1>Jobs</h1>" in one.text
    alert = re.search(r'<p class="error" role="alert" id="compare-error">([^<]+)</p>', one.text)
    assert alert and "tick them in the list below" in alert.group(1) and "(1 ticked)" in alert[1]
    ticks = re.findall(r'<input type="checkbox" name="jobs" value="([^"]+)"[^>]*>', one.text)
    assert set(ticks) == {str(jid), jid2}
    checked = re.findall(r'value="([^"]+)" form="compare-form" checked', one.text)
    assert checked == [str(jid)]
    none = b.get("/compare")
    assert none.status_code == 400 and "(none ticked)" in none.text
    assert 'form="compare-form" checked' not in none.text
    assert 'data-live-url="/jobs/rows"' in none.text
    assert other.get(f"/compare?jobs={jid}&jobs={jid2}").status_code == 404
    live = b.get(f"/jobs/{jid}/live").text
    assert 'data-done="false"' in live and "Download" not in live

    with session_scope(service_app.state.sessionmaker) as session:
        pipeline.transition(
            session, jid, JobStatus.failed, error="training failed: rank 0: out of memory"
        )
    live = b.get(f"/jobs/{jid}/live").text
    assert (
        'data-done="true"' in live
        and "This job failed:</strong> training failed: rank 0: out of memory" in live
    )
    assert "Cancel job" not in live
    model = b.get(f"/jobs/{jid}/model")
    assert model.status_code == 409 and "once it succeeded" in model.text


def test_zoo_page_lists_the_candidates(service_app, alice, zoo):
    html = sign_in(service_app, alice.token).get("/zoo").text
    for mid, arch in zip(zoo, ("test_resnet", "test_vit"), strict=True):
        row = re.search(rf'<tr data-model="{mid}">(.*?)</tr>', html, re.S).group(1)
        assert arch in row and "<td>7</td>" in row and "unit test" in row


def test_the_session_cookie_is_signed_and_never_holds_the_api_key(service_app, make_key):
    """The cookie names the key (id, expiry, MAC under the server's secret), never carries it;
    a tampered, expired or old-style (raw key) cookie signs nobody in; revoking the key signs
    the browser out; a second app on the same data folder accepts the first one's cookies
    (processes share the secret file, made once with mode 0600)."""
    import time

    from sqlalchemy import update

    from zoopick.app.dashboard import auth
    from zoopick.app.main import create_app
    from zoopick.service.db.models import ApiKey
    from zoopick.service.db.session import session_scope
    from zoopick.service.db.types import utcnow

    tenant = make_key(f"cookie-{uuid.uuid4().hex[:6]}")
    b = sign_in(service_app, tenant.token)
    value = b.cookies.get(auth.SESSION_COOKIE)
    assert value and tenant.token not in value and value.startswith("v1.")
    _, key_id, expires, mac = value.split(".")
    assert int(expires) - time.time() > auth.MAX_AGE - 60

    def pages_with(cookie: str) -> int:
        c = browser(service_app)
        c.cookies.set(auth.SESSION_COOKIE, cookie)
        return c.get("/jobs").status_code

    assert pages_with(value) == 200
    forged_mac = ("A" if mac[0] != "A" else "B") + mac[1:]
    assert pages_with(f"v1.{key_id}.{expires}.{forged_mac}") == 303
    assert pages_with(f"v1.{key_id}.{int(expires) + 3600}.{mac}") == 303  # longer life: no
    assert pages_with(tenant.token) == 303  # the old cookie (the raw key): not a session
    secret = service_app.state.session_secret
    with service_app.state.sessionmaker() as s:
        key = s.get(ApiKey, uuid.UUID(key_id))
        stale = auth.session_value(secret, key, int(time.time()) - 1)
        assert auth.session_key(s, secret, value) is not None
    assert pages_with(stale) == 303  # expired on the server, whatever the browser keeps

    settings = service_app.state.settings
    if settings.session_secret is None:
        path = settings.data_dir / "session.key"
        assert path.stat().st_mode & 0o777 == 0o600
        twin = create_app(settings)
        assert twin.state.session_secret == secret
        c = browser(twin)
        c.cookies.set(auth.SESSION_COOKIE, value)
        assert c.get("/jobs").status_code == 200

    with session_scope(service_app.state.sessionmaker) as s:
        s.execute(update(ApiKey).where(ApiKey.id == uuid.UUID(key_id)).values(revoked_at=utcnow()))
    assert b.get("/jobs").status_code == 303  # revoked: signed out at once


def test_jobs_page_shows_the_workers_heartbeat_status(service_app, alice):
    """The dashboard reads the workers' heartbeats as /readyz does: a stalled worker shows."""
    from datetime import timedelta

    from sqlalchemy import delete

    from zoopick.service.db.models import WorkerHeartbeat
    from zoopick.service.db.session import session_scope
    from zoopick.service.db.types import utcnow
    from zoopick.service.liveness import worker_status

    factory = service_app.state.sessionmaker
    with session_scope(factory) as s:
        s.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.name.like("dash-test/%")))
        old = utcnow() - timedelta(minutes=10)
        s.add(
            WorkerHeartbeat(
                name="dash-test/1", hostname="dash-test", pid=1, queues="cpu", seen_at=old
            )
        )
    try:
        with factory() as s:
            status = worker_status(s, service_app.state.settings)
        assert "dash-test/1" in status.stale
        page = sign_in(service_app, alice.token).get("/jobs")
        assert page.status_code == 200
        shown = re.search(r'<p class="workers[^"]*" role="status">Workers: ([^<]+)</p>', page.text)
        head = shown.group(1).split(":")[0].split(" (")[0] if shown else None
        assert head is not None and status.summary().startswith(head)
        assert ("warn" in shown.group(0)) == (not status.live)
    finally:  # the shared test database must not keep a stalled worker for /readyz to see
        with session_scope(factory) as s:
            s.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.name.like("dash-test/%")))


# -- found by an outside-style probe (session 19) ---------------------------------------------


def test_a_live_fragments_error_is_text_not_html(service_app, alice):
    """``/jobs/rows`` and ``/jobs/{id}/live`` answered their error as text/html quoting the
    request (``no job '<img src=x onerror=...>'``): a link ran script on the dashboard."""
    b = sign_in(service_app, alice.token)
    payload = "<img src=x onerror=alert(1)>"
    for url in (f"/jobs/rows?status={payload}", f"/jobs/{payload}/live"):
        resp = b.get(url)
        assert 400 <= resp.status_code < 500, resp.text
        assert resp.headers["content-type"].startswith("text/plain"), url
    page = b.get(f"/jobs?status={payload}")  # the full page escapes the same text
    assert payload not in page.text and "&lt;img" in page.text


def test_a_non_ascii_csrf_token_is_403_not_500(service_app, alice):
    b = browser(service_app)
    token = csrf_of(b.get("/login").text)
    assert b.post("/login", data={"api_key": "x", "csrf": "é"}).status_code == 403
    assert b.post("/login", data={"api_key": "x", "csrf": token}).status_code == 401
    fresh = browser(service_app)  # a cookie with a non-ASCII value, sent as raw bytes
    cookie = {"cookie": "zoopick_csrf=é".encode()}
    assert (
        fresh.post("/login", data={"api_key": "x", "csrf": "abc"}, headers=cookie).status_code
        == 403
    )


def test_pages_carry_a_content_security_policy_and_no_response_is_framed(service_app, alice):
    b = sign_in(service_app, alice.token)
    page = b.get("/jobs")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-frame-options"] == "DENY"
    api = b.get(f"{API}/jobs", headers=alice.headers)
    assert api.headers["x-content-type-options"] == "nosniff"
    assert "content-security-policy" not in api.headers  # JSON: nothing to run
    docs = b.get("/docs")  # Swagger UI's page starts it with an inline script: no policy there
    assert docs.status_code == 200 and "content-security-policy" not in docs.headers


def test_a_pages_notes_are_only_those_this_server_wrote(service_app, bob):
    """``/datasets?error=...`` and ``/jobs/{id}?message=...`` showed any text a link chose in
    the page's own alert box (phishing text); a note now comes signed by the form's redirect
    (the upload error case of the upload test shows the signed one)."""
    b = sign_in(service_app, bob.token)
    bait = "Upload rejected: e-mail your API key to help@evil.test"
    page = b.get("/datasets", params={"error": bait, "error_sig": "forged"})
    assert page.status_code == 200 and "evil.test" not in page.text
    bad = {"file": ("notes.zip", not_a_dataset_zip_bytes(), "application/zip")}
    resp = b.post(f"/datasets/upload?csrf={csrf_of(page.text)}", files=bad)
    assert "error_sig=" in resp.headers["location"]
    assert "not a usable dataset" in b.get(resp.headers["location"]).text


def test_signing_out_ends_the_keys_sessions_on_the_server(service_app, make_key):
    """The cookie was stateless: a copy taken before sign-out kept working for its 12 hours.
    Signing out now ends every dashboard session of that key; signing in again works."""
    key = make_key(f"out-{uuid.uuid4().hex[:6]}")
    b = sign_in(service_app, key.token)
    other = sign_in(service_app, key.token)  # the same key in a second browser
    copied = b.cookies.get("zoopick_session")
    jobs = b.get("/jobs")
    assert b.post("/logout", data={"csrf": csrf_of(jobs.text)}).status_code == 303
    thief = browser(service_app)
    thief.cookies.set("zoopick_session", copied)
    assert thief.get("/jobs").headers["location"] == "/login?next=/jobs"
    assert other.get("/jobs").status_code == 303  # every session of the key ended
    again = sign_in(service_app, key.token)
    assert again.get("/jobs").status_code == 200
