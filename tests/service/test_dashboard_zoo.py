"""The dashboard's zoo page for admins (the API app, PostgreSQL, Redis; no worker): it lists
the zoo with the tenant's jobs that used each model, adds a model and removes one through the
API's own use cases (``service.zoo_admin``); a tenant's key sees neither form nor link and
gets 403 for both."""

from __future__ import annotations

import re

from tests.service.test_api import API, ready_dataset, submit
from tests.service.test_dashboard import csrf_of, sign_in


def _row(html: str, model_id: str) -> str | None:
    m = re.search(rf'<tr data-model="{re.escape(model_id)}">.*?</tr>', html)
    return m.group(0) if m else None


def test_an_admin_adds_and_removes_models_and_a_tenant_may_not(
    service_app, client, make_key, alice
):
    operator = make_key("zoo-dash-ops", admin=True)
    a = sign_in(service_app, operator.token)
    page = a.get("/zoo")
    assert page.status_code == 200 and 'id="zoo-form"' in page.text
    csrf = csrf_of(page.text)

    # refused: the API's reasons above the form, which keeps what was typed
    bad = {"csrf": csrf, "id": "dash-zoo-m", "arch": "test_resnet", "weights": "rel/w.pt"}
    resp = a.post("/zoo/add", data={**bad, "num_classes": "5"})
    assert resp.status_code == 422 and "absolute checkpoint path" in resp.text
    assert 'value="rel/w.pt"' in resp.text and _row(resp.text, "dash-zoo-m") is None
    resp = a.post("/zoo/add", data={**bad, "weights": "none", "num_classes": "five"})
    assert resp.status_code == 422 and "num_classes" in resp.text
    assert a.post("/zoo/add", data={**bad, "csrf": "x"}).status_code == 403

    # added, with its overrides; listed with none of this tenant's jobs, then one
    good = {**bad, "weights": "none", "num_classes": "5", "input_size": "3, 32 32"}
    resp = a.post("/zoo/add", data={**good, "tags": "dash, tiny", "crop_pct": "0.9"})
    assert resp.status_code == 303, resp.text
    listing = a.get(resp.headers["location"])
    assert "Model dash-zoo-m added." in listing.text
    row = _row(listing.text, "dash-zoo-m")
    assert row and "<td>test_resnet</td>" in row and "<td>api</td>" in row
    assert "<td>dash, tiny</td>" in row and "<td data-jobs>0</td>" in row
    shown = client.get(f"{API}/zoo/dash-zoo-m", headers=operator.headers).json()
    assert shown["overrides"] == {"input_size": [3, 32, 32], "crop_pct": 0.9}
    again = a.post("/zoo/add", data=good)
    assert again.status_code == 422 and "already exists" in again.text
    ds = ready_dataset(service_app, "zoo-dash-ops")
    job = submit(client, operator, ds, models=["dash-zoo-m"], metrics=["sms"])
    assert job.status_code == 202, job.text
    assert "<td data-jobs>1</td>" in _row(a.get("/zoo").text, "dash-zoo-m")

    # a tenant: the list, no form, no Remove link, and 403 for each admin route
    t = sign_in(service_app, alice.token)
    page = t.get("/zoo")
    assert page.status_code == 200 and _row(page.text, "dash-zoo-m")
    assert 'id="zoo-form"' not in page.text and "/remove" not in page.text
    assert "<td data-jobs>0</td>" in _row(page.text, "dash-zoo-m")  # alice's jobs
    token = csrf_of(page.text)
    assert t.post("/zoo/add", data={**good, "csrf": token, "id": "t-m"}).status_code == 403
    assert t.get("/zoo/dash-zoo-m/remove").status_code == 403
    assert t.post("/zoo/dash-zoo-m/remove", data={"csrf": token}).status_code == 403

    # removed after a confirmation; gone from the list, the job that used it still readable
    assert 'href="/zoo/dash-zoo-m/remove"' in a.get("/zoo").text
    confirm = a.get("/zoo/dash-zoo-m/remove")
    assert confirm.status_code == 200 and "Yes, remove it" in confirm.text
    assert a.post("/zoo/dash-zoo-m/remove", data={}).status_code == 403  # no CSRF token
    resp = a.post("/zoo/dash-zoo-m/remove", data={"csrf": csrf_of(confirm.text)})
    assert resp.status_code == 303
    listing = a.get(resp.headers["location"])
    assert "Model dash-zoo-m removed." in listing.text and _row(listing.text, "dash-zoo-m") is None
    assert a.get("/zoo/dash-zoo-m/remove").status_code == 404
    seen = client.get(f"{API}/jobs/{job.json()['id']}", headers=operator.headers)
    assert seen.status_code == 200 and seen.json()["models"] == ["dash-zoo-m"]
