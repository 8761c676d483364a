"""Zoo checkpoints in an S3 store (issue 40), against a real S3 server (SeaweedFS): an admin
registers ``"weights": "s3://bucket/key"`` (checked as a local checkpoint is, its size and
SHA-256 kept), a worker of another machine fetches it through its object cache and refuses
an object replaced since; malformed URLs, missing objects and non-admins get a 4xx; a
manifest's checkpoints (the demo zoo's) go to the deployment's store when it is S3."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest

from tests.service.checkpoints import write_checkpoint
from tests.service.test_api import API, assert_problem
from zoopick.service import zoo_catalog
from zoopick.service.db.models import ZooModel
from zoopick.service.db.session import session_scope
from zoopick.service.object_cache import DamagedObject
from zoopick.service.settings import Settings
from zoopick.service.storage import open_store


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def put_checkpoint(s3_env, tmp_path):
    """put(num_classes, arch=...) -> the s3:// URL of a fresh checkpoint in the test bucket."""
    bucket = open_store(f"s3://{s3_env.bucket}")

    def put(num_classes: int, arch: str = "test_resnet", name: str = "ck.safetensors") -> str:
        key = f"zoo-admin/{uuid.uuid4().hex[:10]}/{name}"
        bucket.put_file(
            key, write_checkpoint(tmp_path / uuid.uuid4().hex / name, num_classes, arch)
        )
        return f"s3://{s3_env.bucket}/{key}"

    return put


def register(client, who, **body):
    return client.post(f"{API}/zoo", json={"arch": "test_resnet", **body}, headers=who.headers)


def machine(tmp_path, name: str) -> Settings:
    """Another machine's settings: its own private data folder (nothing shared)."""
    return Settings(data_dir=tmp_path / name)


def test_an_admin_registers_a_stored_checkpoint_and_a_worker_fetches_it(
    client, service_app, admin, alice, put_checkpoint, s3_env, tmp_path
):
    url = put_checkpoint(10)
    resp = register(client, admin, id=f"s3-{uuid.uuid4().hex[:8]}", weights=url, num_classes=10)
    assert resp.status_code == 201, resp.text
    model = resp.json()
    assert model["weights"] == url and model["data_config"]["input_size"][0] == 3
    shown = client.get(f"{API}/zoo/{model['id']}", headers=alice.headers).json()
    assert shown["weights"] == "checkpoint"  # a tenant is not told where the weights live

    with session_scope(service_app.state.sessionmaker) as session:
        row = session.get(ZooModel, model["id"])
        session.expunge(row)
    key = url.removeprefix(f"s3://{s3_env.bucket}/")
    data = b"".join(open_store(f"s3://{s3_env.bucket}").get(key))
    assert (row.weights_size, row.weights_sha256) == (len(data), hashlib.sha256(data).hexdigest())

    entry = zoo_catalog.to_entry(row, machine(tmp_path, "worker-a"))
    local = tmp_path / "worker-a" / "objects" / "s3" / s3_env.bucket / key
    assert entry.weights == str(local) and local.read_bytes() == data
    assert entry.create_model().num_classes == 10  # the library loads the fetched file

    # the object replaced after registration (another head): no worker loads it
    open_store(f"s3://{s3_env.bucket}").put_file(
        key, write_checkpoint(tmp_path / "other.safetensors", 7)
    )
    with pytest.raises(DamagedObject, match=key):
        zoo_catalog.to_entry(row, machine(tmp_path, "worker-b"))
    # the copy worker-a already checked stays its own
    assert zoo_catalog.to_entry(row, machine(tmp_path, "worker-a")).weights == str(local)


@pytest.mark.parametrize(
    ("weights", "needle"),
    [
        ("s3://", "not an S3 bucket name"),
        ("s3://Not_A_Bucket/m.safetensors", "not an S3 bucket name"),
        ("s3://zoopick", "give s3://bucket/key"),
        ("s3://zoopick/a/../m.safetensors", "give s3://bucket/key"),
        ("s3://zoopick/a//m.safetensors", "give s3://bucket/key"),
        ("s3://zoopick/m.txt", "a checkpoint must be"),
    ],
)
def test_a_malformed_store_url_is_422(client, admin, weights, needle):
    assert_problem(register(client, admin, weights=weights, num_classes=10), 422, needle)


def test_a_missing_object_a_wrong_head_and_a_tenant_are_refused(
    client, admin, alice, put_checkpoint, s3_env
):
    missing = f"s3://{s3_env.bucket}/zoo-admin/none/{uuid.uuid4().hex}.safetensors"
    assert_problem(register(client, admin, weights=missing, num_classes=10), 422, "no such object")
    url = put_checkpoint(10)
    body = assert_problem(register(client, admin, weights=url, num_classes=5), 422, "head", url)
    assert "zoo-register" not in body["detail"]  # not the path of the API's scratch copy
    assert register(client, alice, weights=url, num_classes=10).status_code == 403
    nobucket = f"s3://no-such-{uuid.uuid4().hex[:8]}/m.safetensors"
    resp = register(client, admin, weights=nobucket, num_classes=10)
    assert_problem(resp, 503, "no-such-")
    assert resp.headers["retry-after"]


def test_a_manifests_checkpoints_go_to_an_s3_store_once(service_app, s3_env, tmp_path):
    """The demo zoo's way in (``serve`` syncs its manifest): each local checkpoint is put in
    the deployment's store, content-addressed, and the row names the object; a restart's sync
    uploads nothing again; a worker with its own folder loads it."""
    prefix = f"deploy-{uuid.uuid4().hex[:8]}"
    api = Settings(data_dir=tmp_path / "api", storage_url=s3_env.url(prefix))
    model_id = f"manifest-{uuid.uuid4().hex[:8]}"
    ck = write_checkpoint(tmp_path / "api" / "demo" / "tiny.safetensors", 4)
    manifest = tmp_path / "api" / "demo" / "zoo.json"
    entry = {"id": model_id, "arch": "test_resnet", "weights": ck.name, "num_classes": 4}
    manifest.write_text(json.dumps({"models": [entry]}))
    digest = hashlib.sha256(ck.read_bytes()).hexdigest()
    key = f"zoo/{digest}/tiny.safetensors"
    store = open_store(api.storage_url)
    with session_scope(service_app.state.sessionmaker) as session:
        assert model_id in zoo_catalog.sync_manifest(session, manifest, api)
        row = session.get(ZooModel, model_id)
        assert row.weights == f"s3://{s3_env.bucket}/{prefix}/{key}"
        assert (row.weights_sha256, row.weights_size) == (digest, ck.stat().st_size)
        first = store.modified(key)
        zoo_catalog.sync_manifest(session, manifest, api)  # a restart
        assert store.modified(key) == first and store.list("zoo") == [key]
        entry = zoo_catalog.to_entry(row, machine(tmp_path, "worker"))
        session.delete(row)
    assert entry.weights.startswith(str(tmp_path / "worker" / "objects"))
    assert entry.create_model().num_classes == 4
