"""``GET /jobs/{id}/model?format=timm|onnx`` on the live stack: the worker exports a job's
fine-tuned weights on first request (202 until then); the timm folder loads with
``timm.create_model`` both ways, and ONNX run by onnxruntime agrees with torch on a few
images."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
import uuid

import numpy as np
import pytest
import torch

from tests.service.datafiles import npz_bytes
from tests.service.test_client import cli
from zoopick.client import Client
from zoopick.service.db.models import Artefact, Dataset, Job, JobStatus
from zoopick.service.db.session import make_engine, make_sessionmaker
from zoopick.service.db.types import utcnow

ort = pytest.importorskip("onnxruntime")
timm = pytest.importorskip("timm")
ARCH, MODEL = "test_resnet", "tiny-resnet"


def _job_row(job_id, tenant_id, dataset_id) -> Job:
    """A job that fine-tuned ``MODEL`` and succeeded (its model recorded by the caller)."""
    from zoopick.training.config import FinetuneOptions

    return Job(
        id=job_id,
        tenant_id=tenant_id,
        dataset_id=dataset_id,
        request={},
        models=[MODEL],
        metrics=["sms"],
        select_by="sms",
        finetune=FinetuneOptions().model_dump(mode="json"),
        chosen_model=MODEL,
        status=JobStatus.succeeded.value,
        progress=1.0,
        finished_at=utcnow(),
    )


def _finished_job(stack, dataset_id: str) -> tuple[str, torch.nn.Module]:
    """A succeeded fine-tune job of ``stack``'s tenant whose model file is a test_resnet with
    a 3-class head (random weights: what matters is that every format computes the same)."""
    from zoopick.selection.zoo import save_checkpoint
    from zoopick.service import pipeline

    torch.manual_seed(0)
    model = timm.create_model(ARCH, num_classes=3).eval()
    job_id = uuid.uuid4()
    path = stack.dir / "exports" / str(job_id) / "model.safetensors"
    save_checkpoint(model, path)
    engine = make_engine(stack.settings.database_url)
    try:
        with make_sessionmaker(engine).begin() as session:
            ds = session.get(Dataset, uuid.UUID(dataset_id))
            session.add(_job_row(job_id, ds.tenant_id, ds.id))
            session.flush()
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            pipeline.add_artefact(session, job_id, "model", str(path), digest, path.stat().st_size)
    finally:
        engine.dispose()
    return str(job_id), model


def _images(model: torch.nn.Module) -> torch.Tensor:
    """A few of the dataset's images, as the model takes them (3 channels, the zoo entry's
    input size, normalised by the model's data config)."""
    from timm.data import resolve_data_config

    cfg = {**resolve_data_config({}, model=model), "input_size": (3, 32, 32)}  # stack.ZOO's
    x = torch.from_numpy(np.load(io.BytesIO(npz_bytes(seed=4)))["x"][::4]).float() / 255
    x = x[:, None].expand(-1, 3, -1, -1)
    x = torch.nn.functional.interpolate(x, size=cfg["input_size"][1:], mode="bilinear")
    mean, std = torch.tensor(cfg["mean"])[:, None, None], torch.tensor(cfg["std"])[:, None, None]
    return (x - mean) / std


def _download(api, job: str, fmt: str, timeout: float = 120) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        resp = api.get(f"/jobs/{job}/model", params={"format": fmt})
        if resp.status_code == 200:
            return resp.content
        assert resp.status_code == 202, resp.text
        assert resp.headers["Retry-After"] and resp.json()["status"] == "exporting"
        assert time.monotonic() < deadline, f"no {fmt} export in {timeout} s"
        time.sleep(0.3)


def _ready_dataset(api) -> str:
    """A small dataset uploaded and validated; its id."""
    upload = api.post("/datasets", files={"file": ("d.npz", npz_bytes(seed=4))})
    ds = upload.json()["id"]
    deadline = time.monotonic() + 60
    while api.get(f"/datasets/{ds}").json()["status"] != "ready":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return ds


def test_model_downloads_as_timm_folder_and_onnx(live_server, tmp_path):
    stack = live_server.tenant(f"export-{uuid.uuid4().hex[:6]}")
    with stack.api() as api:
        ds = _ready_dataset(api)
        job, model = _finished_job(stack, ds)

        bad = api.get(f"/jobs/{job}/model", params={"format": "pickle"})
        assert bad.status_code == 422 and "format" in bad.text
        plain = api.get(f"/jobs/{job}/model")  # the trainer's file, as before
        assert plain.status_code == 200
        assert plain.headers["ETag"] == f'"{hashlib.sha256(plain.content).hexdigest()}"'
        # both exports are asked for before either is awaited: the worker makes them in turn;
        # the requests that come while one is in the making send no other task (its marker)
        for fmt in ("onnx", "timm", "onnx", "onnx"):
            assert api.get(f"/jobs/{job}/model", params={"format": fmt}).status_code in (200, 202)
        onnx_bytes = _download(api, job, "onnx")
        _download(api, job, "timm")
        export_dir = stack.dir / "exports" / job / "export"
        assert export_dir.is_dir() and not list(export_dir.glob("*.pending"))  # all settled
    # the Python client and the CLI wait out the 202s themselves
    with Client(stack.url, stack.key) as client:
        path = client.download_model(job, tmp_path, format="onnx", timeout=120)
    assert path.name.endswith(".onnx") and path.read_bytes() == onnx_bytes
    done = cli(stack, "model", "download", job, "-o", str(tmp_path / "m.tar"), "--format", "timm")
    assert done.returncode == 0, done.stderr
    tar_bytes = (tmp_path / "m.tar").read_bytes()

    x = _images(model)
    with torch.no_grad():
        expected = model(x).numpy()

    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    [got] = session.run(["logits"], {"pixel_values": x.numpy()})
    assert got.shape == (len(x), 3)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    [one] = session.run(["logits"], {"pixel_values": x[:1].numpy()})  # the batch is dynamic
    np.testing.assert_allclose(one, expected[:1], rtol=1e-4, atol=1e-5)

    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        tar.extractall(tmp_path, filter="data")
    folder = tmp_path / "timm"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == ARCH and config["num_classes"] == 3
    assert config["label_names"] == ["0", "1", "2"]
    assert config["pretrained_cfg"]["input_size"] == [3, 32, 32]  # the zoo entry's override
    loaded = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    overlay = timm.create_model(
        ARCH,
        pretrained=True,
        num_classes=3,
        # the folder's pretrained_cfg says the head has 3 classes (else timm drops it)
        pretrained_cfg_overlay={
            **config["pretrained_cfg"],
            "file": str(folder / "model.safetensors"),
        },
    ).eval()
    with torch.no_grad():
        for other in (loaded, overlay):
            np.testing.assert_allclose(other(x).numpy(), expected, rtol=1e-5, atol=1e-6)


def _poll_export(api, job_id, fmt: str, **params) -> object:
    """The first answer to ``GET /jobs/{id}/model`` that is not 202 (``params`` on the first
    request only)."""
    deadline = time.monotonic() + 60
    while True:
        resp = api.get(f"/jobs/{job_id}/model", params={"format": fmt, **params})
        params = {}
        if resp.status_code != 202:
            return resp
        assert time.monotonic() < deadline, "the export neither finished nor failed"
        time.sleep(0.3)


def test_an_export_that_cannot_be_made_says_why(live_server, tmp_path):
    """A job whose dataset was deleted has no class names to export with: the worker records
    why, and the API answers 422 with it instead of 202 for ever. The failure is remembered
    until a request asks for the export again (``retry``): made again while the cause
    remains, it fails again; once the cause is fixed, the CLI's ``--retry-export`` gets it."""
    from zoopick.service import pipeline
    from zoopick.service.security import authenticate

    stack = live_server.tenant(f"export-{uuid.uuid4().hex[:6]}")
    job_id = uuid.uuid4()
    path = stack.dir / "exports" / str(job_id) / "model.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"never read: the export stops before")
    engine = make_engine(stack.settings.database_url)
    try:
        with make_sessionmaker(engine).begin() as session:
            tenant_id = authenticate(session, stack.key).tenant_id
            session.add(
                _job_row(job_id, tenant_id, None)  # its dataset deleted
            )
            session.flush()
            pipeline.add_artefact(session, job_id, "model", str(path), "0" * 64, 1)
    finally:
        engine.dispose()
    with stack.api() as api:
        resp = _poll_export(api, job_id, "onnx")
        assert resp.status_code == 422, resp.text
        assert resp.json()["type"].endswith("export-failed")
        assert "the onnx export failed" in resp.json()["detail"]
        assert "dataset was deleted" in resp.json()["detail"]
        assert "retry=true" in resp.json()["detail"]
        # asked again while the cause remains: a new export, which fails the same way
        again = api.get(f"/jobs/{job_id}/model", params={"format": "onnx", "retry": "true"})
        assert again.status_code == 202, again.text
        resp = _poll_export(api, job_id, "onnx")
        assert resp.status_code == 422 and "dataset was deleted" in resp.json()["detail"]

        # the cause fixed: the job's dataset and a real model file are back
        ds = _ready_dataset(api)
        from zoopick.selection.zoo import save_checkpoint

        save_checkpoint(timm.create_model(ARCH, num_classes=3).eval(), path)
        engine = make_engine(stack.settings.database_url)
        try:
            with make_sessionmaker(engine).begin() as session:
                session.get(Job, job_id).dataset_id = uuid.UUID(ds)
        finally:
            engine.dispose()
        # without retry the failure stands (nothing is made behind the user's back)
        still = api.get(f"/jobs/{job_id}/model", params={"format": "onnx"})
        assert still.status_code == 422
    done = cli(
        stack, "model", "download", str(job_id), "-o", str(tmp_path / "m.onnx"),
        "--format", "onnx", "--retry-export",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    session = ort.InferenceSession(
        (tmp_path / "m.onnx").read_bytes(), providers=["CPUExecutionProvider"]
    )
    assert session.get_outputs()[0].name == "logits"


def test_one_request_of_many_sends_the_export_and_a_stale_claim_is_taken_over(tmp_path):
    """``exports.claim_export``: of requests arriving together one sends the task (30 parallel
    requests had queued 30 exports); past ``PENDING_SECONDS`` (a worker died) the next one
    sends it again; a settled export may be sent again at once."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from zoopick.service import exports

    model = Artefact(path=str(tmp_path / "run" / "model.safetensors"))
    with ThreadPoolExecutor(8) as pool:
        claims = list(pool.map(lambda _: exports.claim_export(model.path, "onnx"), range(32)))
    assert claims.count(True) == 1
    assert exports.claim_export(model.path, "timm")  # another format: its own marker
    marker = exports.pending_file(model.path, "onnx")
    old = marker.stat().st_mtime - exports.PENDING_SECONDS - 1
    os.utime(marker, (old, old))
    assert exports.claim_export(model.path, "onnx") and not exports.claim_export(model.path, "onnx")
    exports.export_settled(model.path, "onnx")
    assert exports.claim_export(model.path, "onnx")


def test_a_damaged_model_file_fails_its_export_as_the_servers_fault_and_retry_is_not_followed(
    live_server,
):
    """A model file the worker cannot read (the server's fault) had been answered 422 quoting
    its storage path ("cannot read checkpoint /.../storage/jobs/<id>/model.safetensors"): it
    is a 500 ``model-file-damaged`` that names the file neutrally, stored so too. And the 202
    of ``retry=true`` had ``Location`` carrying ``retry=true``: a client following it made
    the export again on every poll, for ever, never seeing the failure; it names the same URL
    without ``retry``, which reaches the failure once the new export has failed too."""
    from urllib.parse import parse_qs, urlsplit

    from zoopick.service import exports

    stack = live_server.tenant(f"export-{uuid.uuid4().hex[:6]}")
    with stack.api() as api:
        ds = _ready_dataset(api)
        job, _ = _finished_job(stack, ds)
        path = stack.dir / "exports" / job / "model.safetensors"
        path.write_bytes(b"\xff" * 64)  # no safetensors header: unreadable

        resp = _poll_export(api, job, "onnx")
        assert resp.status_code == 500, resp.text
        problem = resp.json()
        assert problem["type"].endswith(":model-file-damaged")
        assert (
            "the onnx export failed: the fine-tuned model file cannot be read" in problem["detail"]
        )
        assert "damaged" in problem["detail"] and "retry=true" in problem["detail"]
        for where in (str(stack.dir), str(path), "storage", "/"):
            assert where not in problem["detail"], where
        stored = exports.error_file(path, "onnx").read_text()
        assert str(stack.dir) not in stored and "the fine-tuned model file" in stored

        again = api.get(f"/jobs/{job}/model", params={"format": "onnx", "retry": "true"})
        assert again.status_code == 202, again.text
        location = urlsplit(again.headers["Location"])
        assert location.path == f"/api/v1/jobs/{job}/model"
        assert parse_qs(location.query) == {"format": ["onnx"]}  # the rest kept, retry gone
        # a generic client: follows Location, waits Retry-After, until the answer is not 202
        deadline = time.monotonic() + 60
        while again.status_code == 202:
            assert time.monotonic() < deadline, "following Location never reached the failure"
            time.sleep(0.3)
            again = api.get(again.headers["Location"])
        assert again.status_code == 500 and again.json()["type"].endswith(":model-file-damaged")
