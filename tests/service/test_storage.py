"""The object store (``zoopick.service.storage``): one body per behaviour, run against a local
folder and against a real S3 server (SeaweedFS, ``s3server.py``), since both must behave alike
for the service to move between them."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.procs import free_port
from zoopick.service.settings import Settings
from zoopick.service.storage import (
    PART,
    LocalStore,
    ObjectMissing,
    S3Store,
    Store,
    StoreUnavailable,
    TooLarge,
    open_store,
    retrying,
    tenant_key,
)


@pytest.fixture(params=["local", "s3"])
def store(request, s3_server, tmp_path, monkeypatch) -> Store:
    """A fresh store of each kind (on S3: a new prefix of the session's bucket)."""
    if request.param == "local":
        return open_store(Settings(data_dir=tmp_path).storage_url)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return open_store(Settings(storage_url=s3_server.url(f"t-{uuid.uuid4().hex[:12]}")).storage_url)


def _chunks(data: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_round_trip_counts_size_and_sha256(store: Store) -> None:
    # more than one S3 part: the multipart path, and a small object: the single PUT
    big = os.urandom(PART + 300_000)
    stored = store.put("tenants/a/model.bin", _chunks(big))
    assert (stored.size, stored.sha256) == (len(big), hashlib.sha256(big).hexdigest())
    assert b"".join(store.get("tenants/a/model.bin")) == big
    assert store.size("tenants/a/model.bin") == len(big)
    small = store.put("tenants/a/note.json", [b'{"a": 1}'])
    assert small.sha256 == hashlib.sha256(b'{"a": 1}').hexdigest()
    assert store.list("tenants/a") == ["tenants/a/model.bin", "tenants/a/note.json"]
    store.put("tenants/a/note.json", [b"replaced"])
    assert b"".join(store.get("tenants/a/note.json")) == b"replaced"
    store.delete("tenants/a/model.bin")
    assert not store.exists("tenants/a/model.bin")
    with pytest.raises(ObjectMissing):
        store.get("tenants/a/model.bin")
    store.delete("tenants/a/model.bin")  # deleting what is gone is no error


def test_a_file_given_up_is_moved_in_and_a_kept_one_copied(store: Store, tmp_path) -> None:
    """``put_file(move=True)``: a worker's model is not kept twice (a local store links it
    into place); without it the file stays."""
    data = os.urandom(300_000)
    for move in (True, False):
        path = tmp_path / f"model-{move}.safetensors"
        path.write_bytes(data)
        stored = store.put_file(f"tenants/a/m-{move}", path, move=move)
        assert stored.sha256 == hashlib.sha256(data).hexdigest() and stored.size == len(data)
        assert path.exists() is not move
        assert b"".join(store.get(f"tenants/a/m-{move}")) == data
    if isinstance(store, LocalStore):  # linked, not copied: one file, and nothing left over
        assert (store.root / "tenants/a/m-True").stat().st_nlink == 1
        assert not any((store.root / ".partial").iterdir())


def test_size_limit_refused_mid_stream_leaves_nothing(store: Store) -> None:
    read = []

    def source() -> Iterator[bytes]:
        for i in range(40):
            read.append(i)
            yield b"x" * (512 * 1024)

    with pytest.raises(TooLarge):
        store.put("tenants/a/huge", source(), max_bytes=PART + 1024 * 1024)
    assert len(read) < 40  # refused on the way, not after reading it all
    assert store.list("tenants") == [] and not store.exists("tenants/a/huge")
    if isinstance(store, LocalStore):  # the partial file was removed
        assert not any((store.root / ".partial").iterdir())
    if isinstance(store, S3Store):  # the parts already sent were dropped
        uploads = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
        assert not uploads.get("Uploads")


def test_an_object_is_invisible_until_complete(store: Store) -> None:
    store.put("tenants/a/m", [b"old"])
    seen = []

    def source() -> Iterator[bytes]:
        yield b"n" * (PART + 1)  # one part already sent to S3
        seen.append((store.list("tenants/a"), b"".join(store.get("tenants/a/m"))))
        seen.append(store.exists("tenants/a/new"))
        yield b"end"

    store.put("tenants/a/new", source())
    store.put("tenants/a/m", iter([b"new"]))
    assert seen == [(["tenants/a/m"], b"old"), False]

    def failing() -> Iterator[bytes]:
        yield b"p" * (PART + 1)
        raise OSError("the upload's client went away")

    with pytest.raises(OSError, match="went away"):
        store.put("tenants/a/broken", failing())
    assert store.list("tenants/a") == ["tenants/a/m", "tenants/a/new"]
    assert b"".join(store.get("tenants/a/m")) == b"new"


def test_tenant_prefixes_are_apart(store: Store) -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    store.put(tenant_key(a, "jobs", "1", "model.safetensors"), [b"a"])
    store.put(tenant_key(b, "jobs", "1", "model.safetensors"), [b"b"])
    assert store.list(f"tenants/{a}") == [f"tenants/{a}/jobs/1/model.safetensors"]
    assert store.list(f"tenants/{a}"[:-1]) == []  # a prefix is a folder, not a string start
    for bad in ("../x", "a/../../b", "/etc/passwd", "a//b", ".partial/x", "a/.hidden", ""):
        with pytest.raises(ValueError, match="object key"):
            store.put(bad, [b"x"])
    with pytest.raises(ValueError, match="object key"):
        tenant_key(a, "..", str(b), "jobs")


def test_an_unreachable_store_is_a_clear_error(store: Store, tmp_path, monkeypatch) -> None:
    """A stopped server (nothing listening on its port) or a folder that cannot be written:
    an error that names the store, within seconds (bounded timeouts and retries)."""
    if isinstance(store, S3Store):
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        name = f"s3://{store.bucket}/x"
        down: Store = S3Store(name)
    else:
        (tmp_path / "file").write_text("not a folder")
        name = str(tmp_path / "file" / "store")
        down = LocalStore(name)
    began = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"the store {name} is unavailable") as err:
        down.put("tenants/a/m", [b"x"])
    assert "secret" not in str(err.value)
    assert time.monotonic() - began < 15


def test_a_worker_tries_an_unavailable_store_again_then_names_it(tmp_path) -> None:
    """``retrying``: a store back within the waits takes the write; one still down after them
    raises the error naming it (the worker then fails its work saying so)."""
    blocker = tmp_path / "mount"
    blocker.write_text("a file where the store's folder should be")
    store = LocalStore(blocker / "store")
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 2:
            blocker.unlink()  # the store is back

    stored = retrying(lambda: store.put("tenants/a/m", [b"x"]), waits=(1, 2, 3), sleep=sleep)
    assert waits == [1, 2] and stored.size == 1 and store.exists("tenants/a/m")
    down = LocalStore(tmp_path / "mount" / "store" / "tenants" / "a" / "m" / "x")
    waits.clear()
    with pytest.raises(StoreUnavailable, match="the store .* is unavailable"):
        retrying(lambda: down.put("tenants/b/m", [b"x"]), waits=(1, 2), sleep=waits.append)
    assert waits == [1, 2]


def test_one_of_racing_creators_wins_and_export_markers_live_in_the_store(
    store: Store, monkeypatch
) -> None:
    """``create`` is exclusive (a conditional PUT on S3), so of API processes on several
    machines one sends an export; its markers (pending, then a failure) are objects beside the
    model that every machine reads, and a stale claim is taken over."""
    from concurrent.futures import ThreadPoolExecutor

    from zoopick.service import exports

    with ThreadPoolExecutor(6) as pool:
        won = list(pool.map(lambda _: store.create("tenants/a/flag", b""), range(12)))
    assert won.count(True) == 1
    assert abs(store.modified("tenants/a/flag") - time.time()) < 120
    assert store.modified("tenants/a/none") is None

    marks = exports.Markers(store, "tenants/a/jobs/j/export")
    assert marks.claim("onnx") and not marks.claim("onnx") and marks.claim("timm")
    monkeypatch.setattr(exports, "PENDING_SECONDS", -1.0)  # every claim is stale now
    assert marks.claim("onnx")
    marks.settle("onnx")
    assert not store.exists("tenants/a/jobs/j/export/onnx.pending")
    model = "/srv/run/model.safetensors"
    marks.record_failure("onnx", exports.EXPORT_FAILED, f"E: {model} /srv/d.npz", model)
    failed = marks.failure("onnx")
    assert failed is not None and failed.kind == exports.EXPORT_FAILED
    assert failed.error == "E: the fine-tuned model file a server file"
    assert marks.forget("onnx") and not marks.forget("onnx") and marks.failure("onnx") is None


def test_mlflow_gets_a_remote_stores_model_through_a_scratch_copy(store: Store, tmp_path) -> None:
    """A run whose model is kept in the store: its files are copied to the machine's scratch
    folder for the MLflow upload (``tracking.fetch_stored``); a recipe the run lacks is left
    out."""
    from zoopick.service import tracking

    url = store.name if isinstance(store, S3Store) else store.root.as_uri()
    settings = Settings(data_dir=tmp_path / "data", storage_url=url)
    store.put("tenants/a/jobs/j/model.safetensors", [b"weights"])
    record = tracking.RunRecord(
        job_id="j", experiment="e", status="FINISHED", start_ms=0, end_ms=0, tags={},
        params={}, metrics=[], stored=[("tenants/a/jobs/j/model.safetensors", "model"),
                                       ("tenants/a/jobs/j/model.json", "model")],
    )  # fmt: skip
    fetched = tracking.fetch_stored(record, settings, tmp_path / "scratch")
    assert [(Path(p).name, f) for p, f in fetched.artifacts] == [("model.safetensors", "model")]
    assert Path(fetched.artifacts[0][0]).read_bytes() == b"weights" and fetched.stored == []
