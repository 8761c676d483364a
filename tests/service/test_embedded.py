"""``zoopick serve`` on embedded defaults: SQLite and a file-system broker in the data folder,
the API plus a local worker process, no external service. A first start migrates and creates
a local admin key; a dataset goes through validation, and a job through scoring and a fine-tune
(2 CPU ranks, spardl) to a model that downloads and loads."""

from __future__ import annotations

import hashlib
import uuid

import httpx
import pytest
from sqlalchemy import func, select

from tests.service.datafiles import npz_bytes
from tests.service.procs import ROOT, poll, start_serve, wait_http
from zoopick.service.db.models import ApiKey, Job, Score
from zoopick.service.db.session import make_engine, make_sessionmaker
from zoopick.service.jobs import DEFAULT_METRICS


def test_serve_runs_a_job_with_no_external_service(tmp_path):
    pytest.importorskip("zoopick.selection.extract", reason="selection engine")
    from zoopick.service.settings import Settings
    from zoopick.service_cli import KEY_FILE, bootstrap

    data = tmp_path / "data"
    serve, port = start_serve(
        tmp_path,
        *("--concurrency", "1"),
        # at the API's CPU priority: in the suite the other xdist worker's tests take the
        # cores from a worker (and its trainers) at the default nice 10, for a minute or more;
        # the nice itself is test_serve_signals'
        *("--worker-nice", "0"),
        ZOOPICK_DATA_DIR=str(data),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT),
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(serve, base + "/readyz", timeout=90)
        key = (data / KEY_FILE).read_text().strip()
        out = serve.log.read_text()
        assert base in out and key in out and "sqlite" in out
        client = httpx.Client(
            base_url=base + "/api/v1", headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        for mid, arch in (("emb-resnet", "test_resnet"), ("emb-vit", "test_vit")):
            body = {"id": mid, "arch": arch, "weights": "none", "num_classes": 10}
            body["input_size"] = [3, 32, 32]
            assert client.post("/zoo", json=body).status_code == 201  # the local key is admin

        up = client.post("/datasets", files={"file": ("d.npz", npz_bytes(seed=3), "x")})
        assert up.status_code == 202, up.text
        ds = poll(
            lambda: client.get(f"/datasets/{up.json()['id']}").json(),
            lambda d: d["status"] in ("ready", "invalid"),
            timeout=90,
            what="validation by the embedded worker",
        )
        assert ds["status"] == "ready", ds
        ft = {"epochs": 1, "workers": 2, "compressor": "spardl", "density": 0.1, "lr": 0.01}
        jid = client.post(
            "/jobs",
            json={"dataset_id": ds["id"], "models": ["emb-resnet", "emb-vit"], "finetune": ft},
        ).json()["id"]
        job = poll(
            lambda: client.get(f"/jobs/{jid}").json(),
            lambda j: j["status"] in ("succeeded", "failed", "cancelled"),
            timeout=180,
            interval=0.5,
            what="the embedded job",
        )
        assert job["status"] == "succeeded", (job, serve.tail())
        assert job["chosen_model"] == job["ranking"][0]["model"]
        training = job["training"]
        assert training["world_size"] == 2 and training["status"] == "succeeded"
        assert [e["epoch"] for e in training["epochs"]] == [1]
        assert training["epochs"][0]["bytes_sent"] > 0
        model = client.get(f"/jobs/{jid}/model")
        assert model.status_code == 200, model.text
    finally:
        serve.stop()

    # the download is the fine-tuned chosen architecture with a 3-class head: it loads
    # strictly into a fresh model of that architecture
    import timm
    from safetensors.torch import load as load_safetensors

    arch = {"emb-resnet": "test_resnet", "emb-vit": "test_vit"}[job["chosen_model"]]
    weights = load_safetensors(model.content)
    fresh = timm.create_model(arch, pretrained=False, num_classes=3)
    fresh.load_state_dict(weights, strict=True)
    assert model.headers["digest"] == f"sha-256={hashlib.sha256(model.content).hexdigest()}"

    settings = Settings(data_dir=data)
    assert settings.database_url.startswith("sqlite:///") and settings.embedded_broker
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            assert session.get(Job, uuid.UUID(jid)).status == "succeeded"
            n = session.scalar(
                select(func.count()).select_from(Score).where(Score.job_id == uuid.UUID(jid))
            )
            assert n == 2 * len(DEFAULT_METRICS)  # one score per model and default metric
        # a second start keeps the same single local key
        assert bootstrap(settings, demo=False) == key
        with make_sessionmaker(engine)() as session:
            assert session.scalar(select(func.count()).select_from(ApiKey)) == 1
    finally:
        engine.dispose()
