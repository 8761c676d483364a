"""``zoopick storage init`` and ``zoopick storage copy`` against a real S3 server (SeaweedFS):
a missing bucket is made (compose's first start), an existing deployment's local store folder
is copied key for key and read back through the S3 store, a second run copies nothing, and a
store that is down fails naming it."""

from __future__ import annotations

import uuid

import pytest
from typer.testing import CliRunner

from tests.service.procs import free_port
from zoopick.service import store_setup
from zoopick.service.settings import get_settings
from zoopick.service.storage import LocalStore, S3Store, StoreUnavailable, open_store
from zoopick.service_cli import service_app


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


def run(monkeypatch, tmp_path, storage_url: str, *args: str):
    """``zoopick storage ARGS`` in this process, with ZOOPICK_STORAGE_URL set."""
    monkeypatch.setenv("ZOOPICK_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("ZOOPICK_STORAGE_URL", storage_url)
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(service_app, ["storage", *args])
    finally:
        get_settings.cache_clear()


def test_init_makes_a_missing_bucket_once(s3_env, monkeypatch, tmp_path):
    bucket = f"init-{uuid.uuid4().hex[:10]}"
    url = f"s3://{bucket}/store"
    first = run(monkeypatch, tmp_path, url, "init", "--wait", "5")
    assert first.exit_code == 0, first.output
    assert f"bucket {bucket} created" in first.output
    open_store(url).put("tenants/t/x.bin", [b"written"])  # the bucket takes writes
    again = run(monkeypatch, tmp_path, url, "init")
    assert again.exit_code == 0 and f"bucket {bucket} exists" in again.output


def test_init_of_a_store_that_is_down_fails_naming_it(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    naps: list[float] = []
    with pytest.raises(StoreUnavailable, match="s3://zoopick/down"):
        store_setup.prepare(S3Store("s3://zoopick/down"), wait_seconds=0.5, sleep=naps.append)
    assert naps  # it waited for the store before giving up


def test_copy_moves_a_local_store_folder_key_for_key(s3_env, monkeypatch, tmp_path):
    old = LocalStore(tmp_path / "storage")
    keys = {
        "tenants/t1/datasets/d1/data.npz": b"n" * 300_000,
        "tenants/t1/datasets/d1/manifest.json": b"{}",
        "tenants/t2/jobs/j1/model.safetensors": b"m" * 1000,
    }
    for key, data in keys.items():
        old.put(key, [data])
    (tmp_path / "storage" / "datasets" / "old").mkdir(parents=True)  # from before the store
    (tmp_path / "storage" / "datasets" / "old" / "legacy.npz").write_bytes(b"legacy")
    (tmp_path / "storage" / ".partial").mkdir(exist_ok=True)
    (tmp_path / "storage" / ".partial" / "half").write_bytes(b"half")
    url = s3_env.url(f"copy-{uuid.uuid4().hex[:10]}")

    done = run(monkeypatch, tmp_path, url, "copy", str(tmp_path / "storage"))
    assert done.exit_code == 0, done.output
    assert "3 objects copied (301002 bytes), 0 already in" in done.output
    s3 = open_store(url)
    assert s3.list("") == sorted(keys)  # no legacy folder, no partial write
    assert {k: b"".join(s3.get(k)) for k in keys} == keys

    old.put("tenants/t1/jobs/j2/model.safetensors", [b"new"])  # written since: the re-run
    again = run(monkeypatch, tmp_path, url, "copy", str(tmp_path / "storage"))
    assert "1 objects copied (3 bytes), 3 already in" in again.output, again.output

    same = run(monkeypatch, tmp_path, str(tmp_path / "storage"), "copy", str(tmp_path / "storage"))
    assert same.exit_code == 2 and "already the store" in same.output
