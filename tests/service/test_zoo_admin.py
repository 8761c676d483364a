"""The zoo managed by admins (PostgreSQL and Redis, no worker): models added by timm name
with a pretrained tag or a hub name timm knows, their data config resolved by timm without
a download; ``DELETE /zoo/{id}`` takes a model out while the jobs that used it stay readable;
the demo zoo only where the demo is asked for."""

from __future__ import annotations

import uuid

import pytest

from tests.service.test_api import API, assert_problem, ready_dataset, submit
from zoopick.service.db.models import Score
from zoopick.service.db.session import session_scope
from zoopick.service.settings import Settings
from zoopick.service_cli import wants_demo


def add(client, admin, **body):
    return client.post(f"{API}/zoo", json=body, headers=admin.headers)


def test_a_tagged_name_is_added_with_its_tags_data_config_and_head(client, admin, alice):
    """``resnet50.a1_in1k`` with hub weights: the id, the head size and the data config
    (bicubic, crop 0.95: this tag's, not resnet50's default tag's 0.875) all from timm's
    registry; nothing is downloaded (the test runs offline)."""
    resp = add(client, admin, arch="resnet50.a1_in1k", weights="hub")
    assert resp.status_code == 201, resp.text
    model = resp.json()
    assert model["id"] == "resnet50.a1_in1k" and model["num_classes"] == 1000
    assert model["data_config"] == {
        "input_size": [3, 224, 224],
        "interpolation": "bicubic",
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "crop_pct": 0.95,
        "crop_mode": "center",
    }
    assert resp.headers["location"].endswith("/zoo/resnet50.a1_in1k")
    shown = client.get(f"{API}/zoo/resnet50.a1_in1k", headers=alice.headers).json()
    assert shown["data_config"] == model["data_config"]
    listed = client.get(f"{API}/zoo", headers=alice.headers).json()["items"]
    assert [m["data_config"] for m in listed if m["id"] == "resnet50.a1_in1k"] == [None]


def test_a_hub_name_is_stored_as_timms_name_and_overrides_apply(client, admin):
    resp = add(
        client,
        admin,
        id="rn50-from-hub",
        arch="hf-hub:timm/resnet50.a1_in1k",
        weights="hub",
        crop_pct=1.0,
    )
    assert resp.status_code == 201, resp.text
    model = resp.json()
    assert model["arch"] == "resnet50.a1_in1k" and model["num_classes"] == 1000
    assert model["data_config"]["crop_pct"] == 1.0  # the override over the tag's 0.95
    assert model["data_config"]["interpolation"] == "bicubic"


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        ({"arch": "resnet50.no_such_tag"}, ("no pretrained tag 'no_such_tag'", "a1_in1k")),
        ({"arch": "hf-hub:someone/private-net"}, ("hf-hub:someone/private-net", "checkpoint")),
        ({"arch": "test_resnet", "weights": "none"}, ("num_classes", "required")),
        ({"id": "rn50-10", "arch": "resnet50.a1_in1k", "num_classes": 10}, ("1000-class head",)),
    ],
)
def test_a_name_timm_cannot_vouch_for_is_422(client, admin, body, needles):
    resp = add(client, admin, **{"weights": "hub", **body})
    assert_problem(resp, 422, *needles)


def test_removing_a_model_keeps_the_jobs_that_used_it(client, service_app, admin, alice):
    body = {"arch": "test_resnet", "weights": "none", "num_classes": 10}
    for model_id in ("gone-soon", "stays"):
        assert add(client, admin, id=model_id, **body).status_code == 201
    ds = ready_dataset(service_app, "alice")
    job = submit(client, alice, ds, models=["gone-soon", "stays"], metrics=["sms"])
    assert job.status_code == 202, job.text
    jid = job.json()["id"]
    with session_scope(service_app.state.sessionmaker) as session:
        for model_id, value in (("gone-soon", 0.9), ("stays", 0.4)):
            score = Score(model_id=model_id, metric="sms", value=value, seconds=1)
            score.job_id = uuid.UUID(jid)
            session.add(score)

    url = f"{API}/zoo/gone-soon"
    assert_problem(client.delete(url, headers=alice.headers), 403, "admin")
    assert client.delete(url, headers=admin.headers).status_code == 204
    assert_problem(client.get(url, headers=alice.headers), 404, "gone-soon")
    assert_problem(client.delete(url, headers=admin.headers), 404, "gone-soon")
    listed = {m["id"] for m in client.get(f"{API}/zoo", headers=alice.headers).json()["items"]}
    assert "gone-soon" not in listed and "stays" in listed
    # the past job: its models and ranking as they were
    seen = client.get(f"{API}/jobs/{jid}", headers=alice.headers)
    assert seen.status_code == 200, seen.text
    assert seen.json()["models"] == ["gone-soon", "stays"]
    assert [r["model"] for r in seen.json()["ranking"]] == ["gone-soon", "stays"]
    # no new job names it, "all" leaves it out, and its id is not given to another model
    assert_problem(submit(client, alice, ds, models=["gone-soon"]), 422, "gone-soon")
    again = add(client, admin, id="gone-soon", **body)
    assert_problem(again, 409, "was removed", "another id")


def test_the_demo_zoo_only_where_the_demo_is_asked_for(tmp_path):
    embedded = Settings(data_dir=tmp_path)
    production = Settings(
        data_dir=tmp_path,
        database_url="postgresql+psycopg://db/zoopick",
        broker_url="redis://127.0.0.1:6379/0",
    )
    assert wants_demo(embedded, None) and not wants_demo(production, None)
    assert wants_demo(production, True) and not wants_demo(embedded, False)
