"""Uploaded datasets in the object store (issue 40, step 1), against a real S3 server
(SeaweedFS): an upload streams into the store under its tenant's prefix, is validated there,
and a worker of another machine reads it (and its decoded copy) through its own bounded cache;
a store that fails mid-upload answers 503 and leaves nothing visible; an upload over the
limit is cut off while streaming, its parts dropped; a dataset made before the store (an
absolute local path) still works; the cache keeps to its bound."""

from __future__ import annotations

import hashlib
import json
import uuid
from contextlib import contextmanager
from urllib.parse import urlparse

import pytest

from tests.service.datafiles import imagefolder_zip_bytes, npz_bytes
from tests.service.tcpcut import CuttableLink
from tests.service.test_api import API, assert_problem
from tests.service.test_dashboard import sign_in
from zoopick.service.db.models import Dataset


def upload(client, tenant, filename: str, data: bytes):
    files = {"file": (filename, data, "application/octet-stream")}
    return client.post(f"{API}/datasets", files=files, headers=tenant.headers)


@contextmanager
def s3_app(service_settings, s3_server, *, endpoint: str | None = None, **overrides):
    """An API (validation inline) whose store is a fresh prefix of the S3 server, reached at
    ``endpoint`` (default: the server itself); the same database as the session's app."""
    from fastapi.testclient import TestClient

    from zoopick.app.main import create_app

    settings = service_settings.model_copy(
        update={"storage_url": s3_server.url(f"ds-{uuid.uuid4().hex[:10]}"), **overrides}
    )
    with pytest.MonkeyPatch.context() as mp:
        env = {**s3_server.env, "AWS_ENDPOINT_URL": endpoint or s3_server.endpoint}
        for name, value in env.items():
            mp.setenv(name, value)
        from zoopick.service.storage import open_store

        store = open_store(settings.storage_url)  # made now: it reads these variables
        with TestClient(create_app(settings)) as client:
            yield client, settings, store


def keys_of(store, tenant_prefix: str = "tenants") -> list[str]:
    return store.list(tenant_prefix)


def pending_uploads(store) -> list:
    answer = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    return answer.get("Uploads", [])


def test_an_upload_lives_in_the_store_and_a_worker_reads_it_through_its_cache(
    service_settings, s3_server, make_key, tmp_path
):
    from zoopick.service import datasets

    ann, bob = make_key("ann-s3"), make_key("bob-s3")
    with s3_app(service_settings, s3_server) as (client, settings, store):
        archive = imagefolder_zip_bytes()
        resp = upload(client, ann, "pets.zip", archive)
        assert resp.status_code == 201, resp.text
        ds = resp.json()
        with client.app.state.sessionmaker() as session:
            row = session.get(Dataset, uuid.UUID(ds["id"]))
            key, tenant = row.storage_path, row.tenant_id
        prefix = f"tenants/{tenant}/datasets/{ds['id']}"
        assert key == f"{prefix}/pets.zip"
        kept = keys_of(store)
        made = ("pets.zip", "manifest.json", "decoded/pixels.npy", "decoded/index.npz",
                "thumbs/index.json")  # fmt: skip
        assert {f"{prefix}/{name}" for name in made} <= set(kept)
        assert b"".join(store.get(key)) == archive
        assert hashlib.sha256(archive).hexdigest() == row.file_sha256

        # a worker on another machine: its own scratch folder, the copy fetched once, checked
        worker = settings.model_copy(update={"data_dir": tmp_path / "worker"})
        scored = datasets.for_scoring(key, worker)
        assert scored.digest == ds["digest"] and len(scored) == ds["num_samples"]
        cached = tmp_path / "worker" / "objects" / prefix
        assert (cached / "decoded" / "pixels.npy").is_file()
        assert not (cached / "pets.zip").exists()  # the copy was enough: the archive not fetched
        data = datasets.run_data(key, worker)  # the trainer's: files of this machine
        assert data == {"data": str(cached / "pets.zip"), "decoded": str(cached / "decoded")}
        assert not (cached / "pets.zip").exists()  # the copy is all the trainer reads
        lowered = worker.model_copy(update={"dataset_max_pixels": 10})  # the copy is over it
        data = datasets.run_data(key, lowered)
        assert data == {"data": str(cached / "pets.zip"), "decoded": None}
        assert (cached / "pets.zip").read_bytes() == archive

        # the dashboard's thumbnails come from the store, to their tenant only
        with client.app.state.sessionmaker() as session:
            thumbs = datasets.store.thumbnails_of(settings, session.get(Dataset, row.id))
        assert sorted(thumbs) == ["cat", "dog"]
        first = thumbs["cat"][0]
        thumb = f"/datasets/{ds['id']}/thumbs/{first}"
        page = sign_in(client.app, ann.token).get(thumb)
        assert page.status_code == 200 and page.content[:4] == b"\x89PNG"
        assert sign_in(client.app, bob.token).get(thumb).status_code == 404
        assert client.get(f"{API}/datasets/{ds['id']}", headers=bob.headers).status_code == 404

        assert client.delete(f"{API}/datasets/{ds['id']}", headers=ann.headers).status_code == 204
        assert keys_of(store, prefix) == []


def test_a_row_cannot_point_into_another_tenants_prefix() -> None:
    from zoopick.service.datasets import owned_path

    mine, theirs, ds_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    row = Dataset(id=ds_id, tenant_id=mine, storage_path=f"tenants/{theirs}/datasets/{ds_id}/d.npz")
    with pytest.raises(ValueError, match="not under its own prefix"):
        owned_path(row)
    row.storage_path = f"tenants/{mine}/datasets/{ds_id}/d.npz"
    assert owned_path(row) == row.storage_path


def test_a_store_that_fails_mid_upload_answers_503_and_nothing_is_visible(
    service_settings, s3_server, make_key, monkeypatch
):
    """The link to the store is cut once the upload's first part is in: the request answers
    503 with Retry-After naming the store as the trouble, no object appears (an S3 multipart
    upload is invisible until completed) and no dataset is recorded."""
    from zoopick.service.storage import PART, S3Store

    cid = make_key("cid-s3")
    server = urlparse(s3_server.endpoint)
    link = CuttableLink(server.hostname, server.port)
    part = S3Store._part

    def cut_after_first_part(self, *args, **kwargs):
        answer = part(self, *args, **kwargs)
        link.cut()
        return answer

    big = npz_bytes() + b"\0" * (PART + 1024 * 1024)
    try:
        with s3_app(service_settings, s3_server, endpoint=f"http://127.0.0.1:{link.port}",
                    upload_max_bytes=4 * PART) as (client, settings, store):  # fmt: skip
            assert upload(client, cid, "first.npz", npz_bytes()).status_code == 201
            monkeypatch.setattr(S3Store, "_part", cut_after_first_part)
            resp = upload(client, cid, "big.npz", big)
            body = assert_problem(resp, 503)
            assert body["type"].endswith("store-unavailable") and "file store" in body["detail"]
            assert int(resp.headers["retry-after"]) >= 1
            link.restore()
            monkeypatch.setattr(S3Store, "_part", part)
            kept = [k for k in keys_of(store) if k.endswith(".npz") and "decoded" not in k]
            assert [k.rsplit("/", 1)[1] for k in kept] == ["first.npz"]  # nothing of big.npz
            listed = client.get(f"{API}/datasets", headers=cid.headers).json()["items"]
            assert [d["name"] for d in listed] == ["first.npz"]
            # once the store is back, the same upload is taken
            assert upload(client, cid, "big.npz", big).status_code in (201, 422)
    finally:
        link.close()


def post_in_pieces(client, path: str, headers: dict[str, str], pieces: list[bytes]) -> int:
    """POST a body to the app as a server hands it on, a piece per ASGI message (the test
    client hands the app the whole body at once); the answer's status."""
    import anyio

    messages = [{"type": "http.request", "body": p, "more_body": True} for p in pieces]
    messages.append({"type": "http.request", "body": b"", "more_body": False})
    answer: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        answer.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }  # fmt: skip

    async def call() -> None:
        await client.app(scope, receive, send)
        await anyio.sleep(0)

    client.portal.call(call)
    return next(m["status"] for m in answer if m["type"] == "http.response.start")


def test_an_upload_over_the_limit_is_cut_off_while_streaming_and_its_parts_dropped(
    service_settings, s3_server, make_key
):
    """A body of no declared length that goes over the limit after its first S3 part was
    sent: 413 while it streams (the rest of the body is never read), and the multipart upload
    is aborted (no object, no parts kept)."""
    from zoopick.service.storage import PART

    dee = make_key("dee-s3")
    boundary = "zpboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        'filename="big.npz"\r\nContent-Type: application/octet-stream\r\n\r\n'
    ).encode()
    mib = b"\1" * (1024 * 1024)
    pieces = [head, *[mib] * (PART // len(mib) + 4), f"\r\n--{boundary}--\r\n".encode()]
    headers = {**dee.headers, "content-type": f"multipart/form-data; boundary={boundary}"}
    limit = PART + 2 * len(mib)
    with s3_app(service_settings, s3_server, upload_max_bytes=limit) as (client, _, store):
        assert post_in_pieces(client, f"{API}/datasets", headers, pieces) == 413
        assert keys_of(store) == [] and pending_uploads(store) == []


def test_a_dataset_from_before_the_store_is_still_read_from_its_path(
    service_settings, s3_server, make_key, tmp_path
):
    """A row whose ``storage_path`` is an absolute local path (uploaded before the store) is
    validated, scored and served from there, and deleted with its folder, whatever the store
    is now."""
    from zoopick.service import datasets
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import get_or_create_tenant

    eve = make_key("eve-s3")
    with s3_app(service_settings, s3_server) as (client, settings, store):
        ds_id = uuid.uuid4()
        folder = datasets.dataset_dir(settings, ds_id)
        folder.mkdir(parents=True)
        (folder / "old.npz").write_bytes(npz_bytes())
        factory = client.app.state.sessionmaker
        with session_scope(factory) as session:
            tenant = get_or_create_tenant(session, "eve-s3")
            session.add(
                Dataset(
                    id=ds_id, tenant_id=tenant.id, name="old", format="npz", filename="old.npz",
                    size_bytes=len(npz_bytes()), file_sha256="0" * 64,
                    storage_path=str(folder / "old.npz"), status="uploaded",
                )
            )  # fmt: skip
        assert datasets.validate(factory, ds_id, settings) == "ready"
        assert (folder / "thumbs" / "index.json").is_file() and keys_of(store) == []
        assert len(datasets.for_scoring(str(folder / "old.npz"), settings)) == 18
        assert datasets.run_data(str(folder / "old.npz"), settings)["data"] == str(
            folder / "old.npz"
        )
        shown = client.get(f"{API}/datasets/{ds_id}", headers=eve.headers).json()
        assert shown["status"] == "ready" and shown["num_samples"] == 18
        index = json.loads((folder / "thumbs" / "index.json").read_text())
        thumb = sign_in(client.app, eve.token).get(f"/datasets/{ds_id}/thumbs/{index['0'][0]}")
        assert thumb.status_code == 200 and thumb.content[:4] == b"\x89PNG"
        assert client.delete(f"{API}/datasets/{ds_id}", headers=eve.headers).status_code == 204
        assert not folder.exists()


def test_the_cache_fetches_once_checks_the_digest_and_keeps_to_its_bound(
    s3_server, tmp_path, monkeypatch
):
    from zoopick.service.object_cache import DamagedObject, ObjectCache
    from zoopick.service.storage import open_store

    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    store = open_store(s3_server.url(f"cache-{uuid.uuid4().hex[:10]}"))
    blobs = {name: bytes([i]) * 1000 for i, name in enumerate("abc")}
    meta = {}
    for name, data in blobs.items():
        stored = store.put(f"tenants/t/{name}", [data])
        meta[name] = {"sha256": stored.sha256, "size": stored.size}
    cache = ObjectCache(store, tmp_path / "objects", max_bytes=2500)

    def fetch(name):
        return cache.fetch(f"tenants/t/{name}", **meta[name])

    assert fetch("a").read_bytes() == blobs["a"]
    store.delete("tenants/t/a")
    assert fetch("a").read_bytes() == blobs["a"]  # fetched once: the store is not asked again
    fetch("b"), fetch("c")  # 3000 bytes: the least recently used (a) goes
    assert sorted(p.name for p in (tmp_path / "objects/tenants/t").iterdir()) == ["b", "c"]
    fetch("b")  # used again: now c is the least recent
    store.put("tenants/t/a", [blobs["a"]])
    fetch("a")
    assert sorted(p.name for p in (tmp_path / "objects/tenants/t").iterdir()) == ["a", "b"]
    # an object that is not the one recorded is refused, and nothing of it kept
    with pytest.raises(DamagedObject, match="not the object recorded"):
        cache.fetch("tenants/t/c", sha256=meta["a"]["sha256"], size=1000)
    assert not (tmp_path / "objects/tenants/t/c").exists()
