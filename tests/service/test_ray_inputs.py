"""The Ray backend's inputs hook (``service.ray_inputs``) without a cluster: what travels to
the nodes (no path of the gpu worker's, the store's variables only with a hook), and what a
node does with it (its own paths; a restarted worker's checkpoint rebased onto them). The
real pool run, nodes with folders of their own, is tests/service/ray/test_pool.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zoopick.service import ray_inputs
from zoopick.service.db.models import ZooModel
from zoopick.service.settings import Settings
from zoopick.training.backends import Backend, hook_of
from zoopick.training.config import CHECKPOINT, FinetuneConfig, FinetuneOptions


def _row() -> ZooModel:
    columns = {"weights_sha256": None, "weights_size": None, "source": None}
    return ZooModel(id="tiny", arch="test_resnet", weights="none", num_classes=10, overrides={},
                    tags=[], **columns)  # fmt: skip


def test_the_document_names_keys_and_the_hook_and_backend_checks_it(tmp_path):
    cfg = Settings(data_dir=tmp_path / "gpu")
    doc = ray_inputs.document(cfg, _row(), "tenants/t/datasets/d/x.npz")
    module, function, spec = hook_of(doc)
    assert f"{module}:{function}" == ray_inputs.HOOK and function == "place"
    assert spec["dataset"] == "tenants/t/datasets/d/x.npz" and spec["zoo"]["id"] == "tiny"
    assert str(tmp_path / "gpu" / "objects") not in doc  # no cache path of the gpu worker's
    assert Backend(kind="ray", ray_address="h:1", inputs=doc).inputs == doc
    for bad in ("{", json.dumps({"hook": "nomodule"}), json.dumps({"spec": {}})):
        with pytest.raises(ValueError, match="inputs"):
            Backend(kind="ray", ray_address="h:1", inputs=bad)


def test_the_store_variables_go_to_the_pool_only_with_a_hook(monkeypatch):
    from zoopick.training.ray_driver import _worker_env

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    assert "AWS_ACCESS_KEY_ID" not in _worker_env(45)
    env = _worker_env(45, ray_inputs.HOOK)
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == ("k", "s")


def test_a_node_places_the_run_on_its_own_paths_and_rebases_a_restored_checkpoint(
    tmp_path, monkeypatch
):
    import torch

    store, node = tmp_path / "store", tmp_path / "node"
    data = store / "old" / "shapes.npz"  # a dataset from before the store: read where it is
    data.parent.mkdir(parents=True)
    data.write_bytes(b"x")
    monkeypatch.setenv("ZOOPICK_DATA_DIR", str(node))
    spec = json.loads(ray_inputs.document(Settings(data_dir=store), _row(), str(data)))["spec"]
    folder = tmp_path / "private"
    folder.mkdir()
    elsewhere = {"zoo": "/gpu/zoo.json", "data": "/gpu/objects/x.npz", "out": "/gpu/run"}
    torch.save({"config": {**elsewhere, "epochs": 3}}, folder / CHECKPOINT)
    cfg = FinetuneConfig.for_run(
        FinetuneOptions(), zoo="/gpu/zoo.json", model="tiny", data="/gpu/x.npz", out=str(folder)
    )

    placed = ray_inputs.place(cfg, spec, folder)
    assert placed.zoo == str(folder / "zoo.json") and Path(placed.zoo).is_file()
    assert placed.data == str(data)
    saved = torch.load(folder / CHECKPOINT, weights_only=False)["config"]
    assert (saved["zoo"], saved["data"], saved["out"], saved["epochs"]) == (
        placed.zoo, placed.data, str(folder), 3
    )  # fmt: skip
    assert node.is_dir()  # the node's own folder, from its environment


def test_a_node_fetches_the_checkpoint_its_run_starts_from(tmp_path, monkeypatch):
    """A race winner's fine-tune: the document names the store's packed checkpoint
    (``run_checkpoints.race_key``), each worker unpacks it into its private folder and starts
    from there; a worker that resumes its own run fetches none; one that finds it gone fails
    rather than start from the zoo's weights."""
    import torch

    from zoopick.service import run_checkpoints
    from zoopick.service.storage import open_store

    settings = Settings(data_dir=tmp_path / "gpu")
    monkeypatch.setenv("ZOOPICK_DATA_DIR", str(tmp_path / "node"))
    race = tmp_path / "race"
    race.mkdir()
    torch.save({"config": {"model": "tiny"}, "epoch": 2}, race / CHECKPOINT)
    run_checkpoints.pack(race, tmp_path / "winner.tar")
    key = "tenants/t/jobs/j/race/c/checkpoint.tar"
    open_store(settings.storage_url).put_file(key, tmp_path / "winner.tar")
    data = tmp_path / "shapes.npz"  # a dataset from before the store: read where it is
    data.write_bytes(b"x")
    spec = hook_of(ray_inputs.document(settings, _row(), str(data), init_from=key))[2]
    assert spec["init_from"] == key  # the store's key: no path of the gpu worker's
    cfg = FinetuneConfig.for_run(
        FinetuneOptions(), zoo="/gpu/zoo.json", model="tiny", data="/gpu/x.npz", out="/o"
    )

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    placed = ray_inputs.place(cfg, spec, fresh)
    assert placed.init_from == str(fresh / ray_inputs.INIT_FROM / CHECKPOINT)
    assert torch.load(placed.init_from, weights_only=False)["epoch"] == 2

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    torch.save({"config": {"init_from": "/elsewhere/checkpoint.pt"}}, resumed / CHECKPOINT)
    placed = ray_inputs.place(cfg, spec, resumed)
    assert not (resumed / ray_inputs.INIT_FROM).exists()  # its own run: nothing fetched
    saved = torch.load(resumed / CHECKPOINT, weights_only=False)["config"]
    assert saved["init_from"] == placed.init_from  # the same run, wherever it restarts

    gone = {**spec, "init_from": "tenants/t/jobs/j/race/other/checkpoint.tar"}
    (tmp_path / "late").mkdir()
    with pytest.raises(FileNotFoundError, match="other/checkpoint.tar"):
        ray_inputs.place(cfg, gone, tmp_path / "late")


def test_a_ray_runs_config_names_the_store_keys_until_its_node_places_them(tmp_path, monkeypatch):
    """A Ray run's gpu worker fetches nothing of the dataset or the zoo checkpoint
    (``unplaced``: the store's keys, a config the driver reads as it is); each node names its
    own copies in place of them."""
    store, node, gpu = tmp_path / "store", tmp_path / "node", tmp_path / "gpu"
    data = store / "old" / "shapes.npz"  # a dataset from before the store: read where it is
    data.parent.mkdir(parents=True)
    data.write_bytes(b"x")
    monkeypatch.setenv("ZOOPICK_DATA_DIR", str(node))
    key = "tenants/t/datasets/d/shapes.npz"
    stored = _row()
    stored.weights = "s3://zoo-bucket/checkpoints/tiny.safetensors"
    inputs = ray_inputs.unplaced(stored, key, gpu)
    cfg = FinetuneConfig.for_run(FinetuneOptions(), model="tiny", out="/o", **inputs)
    assert (cfg.data, cfg.decoded) == (key, None)
    (entry,) = json.loads(Path(cfg.zoo).read_text())["models"]
    assert entry["weights"] == stored.weights  # the registered key: fetched nowhere here
    assert [p.name for p in gpu.iterdir()] == ["zoo.json"]  # no object cache, no dataset
    assert FinetuneConfig.from_json(cfg.to_json()) == cfg  # the driver's one validation
    spec = json.loads(ray_inputs.document(Settings(data_dir=store), _row(), str(data)))["spec"]
    (tmp_path / "private").mkdir()
    placed = ray_inputs.place(cfg, spec, tmp_path / "private")
    assert placed.data == str(data) and placed.data != key
