"""The feature cache in the store (issue 40, step 2), against a real S3 server (SeaweedFS): a
model's outputs on a dataset computed on one machine are read by another from the store (no
model built, no image decoded), never by another tenant, and deleted with the dataset; a store
that is down costs a forward pass, not the scoring."""

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
    shared = feature_cache.for_dataset(store, "tenants/t1/datasets/d1")
    entry, ds = load_zoo(tiny_zoo)["tiny-resnet"], load_dataset(tiny_npz)

    first = extract(entry, ds, cache_dir=tmp_path / "a", device="cpu", shared_cache=shared)
    assert not first.cached
    (name,) = [p.name for p in (tmp_path / "a").glob("*.npz")]
    assert store.list("tenants/t1") == [f"tenants/t1/datasets/d1/features/{name}"]

    with monkeypatch.context() as mp:  # another machine: its own empty cache folder
        mp.setattr(ZooEntry, "create_model", lambda self, **kw: pytest.fail("model built"))
        mp.setattr(extract_mod, "preprocess", lambda *a, **k: pytest.fail("decoded"))
        again = extract(entry, ds, cache_dir=tmp_path / "b", device="cpu", shared_cache=shared)
    assert again.cached and (tmp_path / "b" / name).is_file()
    assert np.array_equal(again.logits, first.logits)
    assert np.array_equal(again.features, first.features)

    # another tenant's cache never holds it: computed again, kept apart
    other = feature_cache.for_dataset(store, "tenants/t2/datasets/d2")
    assert not extract(entry, ds, cache_dir=tmp_path / "c", device="cpu", shared_cache=other).cached
    assert store.list("tenants/t2") == [f"tenants/t2/datasets/d2/features/{name}"]


def test_a_store_that_is_down_costs_a_forward_pass_not_the_scoring(
    s3_env, tiny_zoo, tiny_npz, tmp_path, monkeypatch
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    down = feature_cache.for_dataset(S3Store(s3_env.url("down")), "tenants/t1/datasets/d1")
    entry, ds = load_zoo(tiny_zoo)["tiny-resnet"], load_dataset(tiny_npz)
    out = extract(entry, ds, cache_dir=tmp_path / "a", device="cpu", shared_cache=down)
    assert not out.cached and len(list((tmp_path / "a").glob("*.npz"))) == 1


def test_which_datasets_get_the_shared_cache_and_their_delete_removes_it(s3_env, tmp_path):
    from zoopick.service.datasets import feature_cache as of
    from zoopick.service.datasets import remove_files
    from zoopick.service.db.models import Dataset

    s3 = Settings(data_dir=tmp_path, storage_url=s3_env.url(f"fc-{uuid.uuid4().hex[:10]}"))
    tenant, dataset = uuid.uuid4(), uuid.uuid4()
    key = f"tenants/{tenant}/datasets/{dataset}/d.npz"
    shared = of(key, s3)
    assert shared.prefix == f"tenants/{tenant}/datasets/{dataset}/features"
    store = open_store(s3.storage_url)
    store.put(key, iter([b"x"]))
    (tmp_path / "k.npz").write_bytes(b"outputs")
    shared.keep("k.npz", tmp_path / "k.npz")
    store.put(f"tenants/{tenant}/datasets/{uuid.uuid4()}/features/k.npz", iter([b"other"]))
    remove_files(s3, Dataset(id=dataset, tenant_id=tenant, storage_path=key))
    assert not any(str(dataset) in k for k in store.list(f"tenants/{tenant}"))
    assert len(store.list(f"tenants/{tenant}")) == 1  # another dataset's features are kept
    assert of(str(tmp_path / "datasets" / "x" / "d.npz"), s3) is None  # from before the store
    assert of(key, Settings(data_dir=tmp_path)) is None  # a local store: the local cache is all
