"""A fine-tune's checkpoint in the store (``service.run_checkpoints``, issue 40), against a real
S3 server (SeaweedFS): a run on one machine puts each checkpoint it writes in the store from a
thread; a machine with another data folder fetches it into its empty run folder and the real
trainer resumes there (the ``resumed`` event, the epoch numbering, the recipe's state); a store
that is down costs an upload only, and at a resume is named after its retries."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.comm_harness import launch
from tests.service.procs import free_port
from zoopick.service import run_checkpoints
from zoopick.service.storage import S3Store, StoreUnavailable, open_store, tenant_key
from zoopick.training.config import CHECKPOINT, METRICS, FinetuneConfig, RunEvent, parse_line


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


def _train(rank: int, world: int, config: dict) -> None:
    from zoopick.training.finetune import run

    run(FinetuneConfig(**config))


def _machine(root: Path, tiny_zoo: Path, tiny_npz: Path) -> dict[str, str]:
    """A machine's own copies of the job's zoo entry and dataset, and its run folder."""
    shutil.copytree(tiny_zoo.parent, root / "zoo")
    (root / "data").mkdir()
    shutil.copy(tiny_npz, root / "data" / "d.npz")
    return {
        "zoo": str(root / "zoo" / "zoo.json"),
        "data": str(root / "data" / "d.npz"),
        "out": str(root / "jobs" / "j" / "train"),
    }


def _lines(folder: str) -> list:
    return [parse_line(x) for x in (Path(folder) / METRICS).read_text().splitlines()]


def test_a_run_resumes_on_another_machine_from_the_stores_checkpoint(
    s3_env, tiny_zoo, tiny_npz, tmp_path
):
    store = open_store(s3_env.url(f"ck-{uuid.uuid4().hex[:10]}"))
    tenant, job = uuid.uuid4(), uuid.uuid4()
    key = run_checkpoints.stored_key(tenant, job)
    # under the job's prefix: deleting the job (job_records._remove_stored) deletes it
    assert key.startswith(tenant_key(tenant, "jobs", str(job)) + "/")
    common = dict(model="tiny-resnet", batch_size=4, lr=0.05, test_fraction=0.25)
    common |= dict(compressor="dense", recipe="fixed")

    a = _machine(tmp_path / "a", tiny_zoo, tiny_npz)
    first = FinetuneConfig(**a, **common, epochs=2).model_dump()
    uploads = run_checkpoints.Uploader(store, key, Path(a["out"]), every=0.05).start()
    try:
        launch(_train, 1, first)
        deadline = time.monotonic() + 20
        while uploads._stamp() != uploads._seen and time.monotonic() < deadline:
            time.sleep(0.05)  # the last checkpoint's upload
    finally:
        uploads.close()
    assert uploads.puts >= 1 and uploads.failures == 0
    assert store.list(tenant_key(tenant, "jobs", str(job))) == [key]

    # machine b: another data folder, nothing of a's run on it
    b = _machine(tmp_path / "b", tiny_zoo, tiny_npz)
    folder = Path(b["out"])
    assert run_checkpoints.fetch(store, key, folder)
    assert sorted(p.name for p in folder.iterdir()) == [CHECKPOINT, "comm-state-rank0.pt"]
    resumed = FinetuneConfig(**b, **common, epochs=3, resume=True)
    saved = torch.load(folder / CHECKPOINT, weights_only=False)
    assert resumed.same_run(saved["config"]) == ["data", "zoo"]  # a's folders, not b's
    run_checkpoints.rebase(folder, resumed.model_dump(mode="json"))
    assert resumed.same_run(torch.load(folder / CHECKPOINT, weights_only=False)["config"]) == []
    launch(_train, 1, resumed.model_dump())

    lines = _lines(b["out"])
    events = [r for r in lines if isinstance(r, RunEvent) and r.event != "progress"]
    epochs = [r.epoch for r in lines if not isinstance(r, RunEvent)]
    # it continued a's run after its 2 epochs, with a's recipe (no new choice made)
    assert events == [RunEvent("resumed", epoch=2, workers=1)] and epochs == [3]
    assert any(isinstance(r, RunEvent) and r.event == "recipe" for r in _lines(a["out"]))
    assert json.loads((folder / "model.json").read_text())  # and finished the model


def test_a_store_that_is_down_costs_an_upload_and_is_named_at_a_resume(
    s3_env, tmp_path, monkeypatch
):
    folder = tmp_path / "train"
    store = open_store(s3_env.url(f"ck-{uuid.uuid4().hex[:10]}"))
    key = run_checkpoints.stored_key(uuid.uuid4(), uuid.uuid4())
    # nothing stored yet: a fresh run, nothing fetched
    assert not run_checkpoints.fetch(store, key, folder, waits=())
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    down = S3Store(s3_env.url("down"))
    folder.mkdir(exist_ok=True)
    (folder / CHECKPOINT).write_bytes(b"epoch 1")
    uploads = run_checkpoints.Uploader(down, key, tmp_path / "train")
    uploads._seen = None  # as if the trainer had just written it
    assert not uploads.check() and uploads.failures == 1  # logged, nothing raised
    assert not list(folder.glob(".*"))  # its packed copy is gone
    (folder / CHECKPOINT).unlink()
    began = time.monotonic()
    with pytest.raises(StoreUnavailable, match="s3://"):
        run_checkpoints.fetch(down, key, folder, waits=(0.1,))
    assert time.monotonic() - began < 30 and not (folder / CHECKPOINT).exists()
