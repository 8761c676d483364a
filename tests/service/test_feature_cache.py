"""The feature cache in the store (issue 40, step 2), against a real S3 server (SeaweedFS): a
model's outputs on a dataset computed on one machine are read by another from the store (no
model built, no image decoded), never by another tenant; a store that is down costs a forward
pass, not the scoring."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tests.service.procs import free_port
from zoopick.selection import extract as extract_mod
from zoopick.selection.data import load_dataset
from zoopick.selection.extract import extract
from zoopick.selection.zoo import ZooEntry, load_zoo
from zoopick.service import feature_cache
from zoopick.service.settings import Settings
from zoopick.service.storage import S3Store, open_store


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


def test_a_forward_pass_happens_once_per_deployment(
    s3_env, tiny_zoo, tiny_npz, tmp_path, monkeypatch
):
    store = open_store(s3_env.url(f"fc-{uuid.uuid4().hex[:10]}"))
    shared = feature_cache.for_tenant(store, "tenants/t1")
    entry, ds = load_zoo(tiny_zoo)["tiny-resnet"], load_dataset(tiny_npz)

    first = extract(entry, ds, cache_dir=tmp_path / "a", device="cpu", shared_cache=shared)
    assert not first.cached
    (name,) = [p.name for p in (tmp_path / "a").glob("*.npz")]
    assert store.list("tenants/t1/features") == [f"tenants/t1/features/{name}"]

    with monkeypatch.context() as mp:  # another machine: its own empty cache folder
        mp.setattr(ZooEntry, "create_model", lambda self, **kw: pytest.fail("model built"))
        mp.setattr(extract_mod, "preprocess", lambda *a, **k: pytest.fail("decoded"))
        again = extract(entry, ds, cache_dir=tmp_path / "b", device="cpu", shared_cache=shared)
    assert again.cached and (tmp_path / "b" / name).is_file()
    assert np.array_equal(again.logits, first.logits)
    assert np.array_equal(again.features, first.features)

    # another tenant's cache never holds it: computed again, kept apart
    other = feature_cache.for_tenant(store, "tenants/t2")
    assert not extract(entry, ds, cache_dir=tmp_path / "c", device="cpu", shared_cache=other).cached
    assert store.list("tenants/t2/features") == [f"tenants/t2/features/{name}"]


def test_a_store_that_is_down_costs_a_forward_pass_not_the_scoring(
    s3_env, tiny_zoo, tiny_npz, tmp_path, monkeypatch
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    down = feature_cache.for_tenant(S3Store(s3_env.url("down")), "tenants/t1")
    entry, ds = load_zoo(tiny_zoo)["tiny-resnet"], load_dataset(tiny_npz)
    out = extract(entry, ds, cache_dir=tmp_path / "a", device="cpu", shared_cache=down)
    assert not out.cached and len(list((tmp_path / "a").glob("*.npz"))) == 1


def test_which_datasets_get_the_shared_cache(s3_env, tmp_path) -> None:
    from zoopick.service.datasets import feature_cache as of

    s3 = Settings(data_dir=tmp_path, storage_url=s3_env.url(f"fc-{uuid.uuid4().hex[:10]}"))
    tenant = uuid.uuid4()
    key = f"tenants/{tenant}/datasets/{uuid.uuid4()}/d.npz"
    assert of(key, s3).prefix == f"tenants/{tenant}/features"
    assert of(str(tmp_path / "datasets" / "x" / "d.npz"), s3) is None  # from before the store
    assert of(key, Settings(data_dir=tmp_path)) is None  # a local store: the local cache is all
