"""A job fine-tuned on a GPU pool: the ``ray`` training backend behind the real service
(uvicorn, a Celery worker on Redis, PostgreSQL) and a real local Ray cluster
(``ray.cluster_utils.Cluster``: a head with no CPUs and two 1-CPU nodes, so the two training
workers sit on different nodes), CPU workers with gloo."""

from __future__ import annotations

import json
import os
import uuid
from unittest import mock

import pytest

from tests.service.checkpoints import write_checkpoint
from tests.service.datafiles import npz_bytes
from tests.service.procs import api_and_worker, create_token, poll
from tests.service.ray.conftest import add_node, tenant_id
from zoopick.service.storage import S3Store, open_store

pytest.importorskip("ray", reason="the ray extra is not installed")

API = "/api/v1"
FINETUNE = {
    "epochs": 2, "workers": 2, "compressor": "spardl", "density": 0.1, "batch_size": 4,
    "lr": 0.05,
}  # fmt: skip


def _prepare(http, admin: str, weights: str = "none", per_class: int = 4) -> str:
    """One zoo model (its checkpoint ``weights``) and a ready dataset of ``per_class`` images
    a class (3 classes); returns the dataset id."""
    zoo = {"id": "tiny", "arch": "test_resnet", "weights": weights, "num_classes": 10,
           "input_size": [3, 32, 32]}  # fmt: skip
    resp = http.post("/zoo", json=zoo, headers={"Authorization": f"Bearer {admin}"})
    assert resp.status_code == 201, resp.text
    data = npz_bytes(per_class)
    resp = http.post("/datasets", files={"file": ("shapes.npz", data, "x")})
    assert resp.status_code in (201, 202), resp.text  # 201: validated inline
    ds = poll(
        lambda: http.get(f"/datasets/{resp.json()['id']}").json(),
        lambda d: d["status"] in ("ready", "invalid"),
        timeout=60,
        what="the dataset's validation",
    )
    assert ds["status"] == "ready", ds
    return ds["id"]


def _readyz(http) -> str:
    return str(http.base_url.copy_with(path="/readyz"))


def _finished(http, jid: str, timeout: float) -> dict:
    return poll(
        lambda: http.get(f"/jobs/{jid}").json(),
        lambda j: j["status"] in ("succeeded", "failed", "cancelled"),
        timeout=timeout,
        what=f"job {jid}",
    )


def test_a_job_fine_tunes_across_two_nodes_of_the_pool(
    cluster, s3_server, isolated_settings, tmp_path
):
    """The deployment's store is S3 (SeaweedFS) and the pool's nodes share no folder with the
    gpu worker nor with each other (each its own ``ZOOPICK_DATA_DIR``, conftest.add_node):
    each Ray worker fetches the dataset and the zoo model's checkpoint from the store into its
    node's object cache, and Ray keeps the run's checkpoints under the job's prefix there,
    not in the gpu worker's folder. A node lost after the first epoch's checkpoint is
    replaced by a node with another folder, and the run resumes from the store's checkpoint
    there (its paths rebased onto that node's: ``ray_inputs.place``). 600 images (an epoch
    of seconds), so the loss lands mid-run; it costs the test about 40 s, and is the issue's
    test of a lost node whose replacement shares no folder (test_backend's lost-node test
    runs the command line, whose nodes read the paths it is given)."""
    prefix = f"raypool-{uuid.uuid4().hex[:8]}"
    cfg = isolated_settings(
        "raypool",
        validate_inline=True,
        train_backend="ray",
        ray_address=cluster.address,
        ray_placement="STRICT_SPREAD",
        storage_url=s3_server.url(prefix),
    )
    token, admin = create_token(cfg, "pool"), create_token(cfg, "ops", admin=True)
    env = s3_server.env
    key = f"{prefix}-zoo/tiny.safetensors"  # the zoo's checkpoint, in the store only
    with mock.patch.dict(os.environ, env):
        open_store(f"s3://{s3_server.bucket}").put_file(
            key, write_checkpoint(tmp_path / "tiny.safetensors", 10)
        )
    nodes = {folder: _files(folder) for folder in cluster.data_dirs}
    with api_and_worker(cfg, "cpu,gpu", token, env, prefix=API) as (http, worker):
        ds = _prepare(http, admin, weights=f"s3://{s3_server.bucket}/{key}", per_class=200)
        finetune = {**FINETUNE, "epochs": 3}
        body = {"dataset_id": ds, "metrics": ["logme"], "finetune": finetune}
        resp = http.post("/jobs", json=body)
        assert resp.status_code == 202, resp.text
        jid = resp.json()["id"]
        with mock.patch.dict(os.environ, env):
            store = S3Store(cfg.storage_url)
        ray_run = f"tenants/{tenant_id(cfg, 'pool')}/jobs/{jid}/train/ray/"
        poll(  # the first epoch's checkpoint is in the store, and Ray recorded it
            lambda: store.list(ray_run),
            lambda keys: (
                any(k.endswith("/checkpoint.pt") for k in keys)
                and any(k.endswith("/checkpoint_manager_snapshot.json") for k in keys)
            ),
            timeout=240,
            what="the first checkpoint in the store",
        )
        cluster.remove_node(cluster.list_all_nodes()[-1], allow_graceful=False)
        add_node(cluster)  # the replacement, with a folder of its own
        job = _finished(http, jid, timeout=300)
        assert job["status"] == "succeeded", (job, worker.tail())

        run = job["training"]
        assert (run["backend"], run["world_size"], run["status"]) == ("ray", 2, "succeeded")
        assert run["backend_ref"]  # the Ray job id, kept in PostgreSQL
        assert run["resumes"] >= 1, run
        assert sorted({e["epoch"] for e in run["epochs"]}) == [1, 2, 3]
        assert all(e["bytes_sent"] and e["iterations"] for e in run["epochs"])

        model = http.get(f"/jobs/{job['id']}/model")
        assert model.status_code == 200
        from safetensors.torch import load

        assert load(model.content)  # a real safetensors file
        meta = cfg.storage_dir / "jobs" / job["id"] / "train" / "model.json"
        digests = json.loads(meta.read_text())["rank_digests"]
        assert len(digests) == 2 and digests[0] == digests[1]  # both replicas, same weights

        ready = http.get(_readyz(http)).json()
        assert ready["checks"]["ray"].startswith("ok"), ready
        assert not (cfg.storage_dir / "jobs" / job["id"] / "train" / "ray").exists()
        with mock.patch.dict(os.environ, env):
            keys = S3Store(cfg.storage_url).list(
                f"tenants/{tenant_id(cfg, 'pool')}/jobs/{job['id']}/train"
            )
        assert any(k.endswith("/checkpoint.pt") and "/ray/" in k for k in keys), keys
        assert any(k.endswith("/comm-state-rank1.pt") for k in keys), keys

    # each training node (STRICT_SPREAD: two, then the survivor and the replacement) fetched
    # the dataset and the checkpoint into its own folder: the run's paths there were its own
    fetched = [
        new for folder in cluster.data_dirs if (new := _files(folder) - nodes.get(folder, set()))
    ]
    assert len(fetched) == 3, fetched
    for new in fetched:
        assert any(f"/datasets/{ds}/" in p for p in new), new
        assert any(p.endswith(key) for p in new), new


def _files(folder) -> set[str]:
    """The files under a node's ``objects/`` (its cache of store objects)."""
    return {str(p) for p in (folder / "objects").rglob("*") if p.is_file()}


def test_an_unreachable_cluster_fails_the_job_and_nothing_else(isolated_settings):
    cfg = isolated_settings(
        "raygone", validate_inline=True, train_backend="ray", ray_address="127.0.0.1:9"
    )
    token, admin = create_token(cfg, "pool"), create_token(cfg, "ops", admin=True)
    with api_and_worker(cfg, "cpu,gpu", token, prefix=API) as (http, _):
        ds = _prepare(http, admin)
        train = http.post("/jobs", json={"dataset_id": ds, "metrics": ["logme"],
                                         "finetune": FINETUNE})  # fmt: skip
        rank_only = http.post("/jobs", json={"dataset_id": ds, "metrics": ["logme"]})
        failed = _finished(http, train.json()["id"], timeout=120)
        assert failed["status"] == "failed"
        assert "ZOOPICK_RAY_ADDRESS" in failed["error"] and "127.0.0.1:9" in failed["error"]
        assert _finished(http, rank_only.json()["id"], timeout=120)["status"] == "succeeded"

        ready = http.get(_readyz(http))
        assert ready.status_code == 200  # the API serves on; the check names the pool
        assert "127.0.0.1:9" in ready.json()["checks"]["ray"]
        assert http.get("/jobs").status_code == 200


def test_settings_refuse_the_ray_backend_without_an_address():
    from pydantic import ValidationError

    from zoopick.service.settings import Settings

    with pytest.raises(ValidationError, match="ZOOPICK_RAY_ADDRESS"):
        Settings(train_backend="ray")
