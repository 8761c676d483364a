"""Hostile inputs that used to give a 5xx or a wrong answer (issue 10, items 6-11), against a
real uvicorn on PostgreSQL + Redis (uploads validated in the request, so no worker is needed).
"""

from __future__ import annotations

import base64
import io
import json
import uuid
import zipfile

import httpx
import numpy as np
import pytest

from tests.service import procs
from tests.service.datafiles import npz_bytes
from tests.service.test_api import API, assert_problem


@pytest.fixture(scope="module")
def live(isolated_settings):
    """(base URL, settings, sessionmaker) of a real uvicorn on a fresh PostgreSQL database."""
    from zoopick.service.db.session import make_engine, make_sessionmaker

    settings = isolated_settings(
        "hardening-inputs", validate_inline=True, upload_max_bytes=4 * 1024 * 1024
    )
    db = settings.database_url
    api, base = procs.start_api(settings, settings.data_dir)
    engine = make_engine(db)
    try:
        yield base, settings, make_sessionmaker(engine)
    finally:
        api.stop()
        engine.dispose()


def key(live, tenant: str, *, admin: bool = False) -> dict[str, str]:
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import create_api_key

    with session_scope(live[2]) as session:
        _, token = create_api_key(session, tenant=tenant, name=f"{tenant}-k", admin=admin)
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live[0] + API, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def carol(live):
    return key(live, "carol")


@pytest.fixture(scope="module")
def root(live):
    return key(live, "root-ops", admin=True)


def multipart(filename: str, data: bytes, name: str | None = None, *, close: bool = True):
    """A multipart body built by hand (so NUL bytes and truncation reach the server as sent)."""
    parts = []
    if name is not None:
        parts.append(
            b'--zpb\r\nContent-Disposition: form-data; name="name"\r\n\r\n'
            + name.encode()
            + b"\r\n"
        )
    parts.append(
        b'--zpb\r\nContent-Disposition: form-data; name="file"; filename="'
        + filename.encode()
        + b'"\r\nContent-Type: application/octet-stream\r\n\r\n'
        + data
    )
    body = b"".join(parts) + (b"\r\n--zpb--\r\n" if close else b"")
    return {"content": body, "headers": {"content-type": "multipart/form-data; boundary=zpb"}}


def upload(http, headers, filename, data, name=None, *, close=True):
    kw = multipart(filename, data, name, close=close)
    return http.post("/datasets", content=kw["content"], headers={**headers, **kw["headers"]})


def datasets_of(http, headers) -> list[dict]:
    resp = http.get("/datasets", headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()["items"]


# -- 6: crafted page tokens ------------------------------------------------------------------


@pytest.mark.parametrize("resource", ["jobs", "datasets", "zoo"])
def test_page_token_at_the_calendars_edge_is_400(http, carol, resource):
    token = json.dumps({"c": "0001-01-01T00:00:00+14:00", "i": str(uuid.uuid4())})
    token = base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")
    resp = http.get(f"/{resource}", params={"page_token": token}, headers=carol)
    assert_problem(resp, 400, "page_token")
    for weird in ({"c": 5, "i": "x"}, ["c"], {"c": "9999-12-31T23:59:59-14:00", "i": "x"}):
        raw = base64.urlsafe_b64encode(json.dumps(weird).encode()).decode()
        resp = http.get(f"/{resource}", params={"page_token": raw}, headers=carol)
        assert_problem(resp, 400, "page_token")
    # nested arrays past the JSON parser's recursion limit (was a 500), and the most a
    # token may nest under the length cap
    for depth in (3000, 380):
        raw = base64.urlsafe_b64encode(b"[" * depth).decode()
        resp = http.get(f"/{resource}", params={"page_token": raw}, headers=carol)
        assert_problem(resp, 400, "page_token")


# -- 7: NUL bytes ----------------------------------------------------------------------------


def test_nul_in_upload_name_or_filename_is_422(http, carol, live):
    before = datasets_of(http, carol)
    assert_problem(upload(http, carol, "d.npz", npz_bytes(), name="a\x00b"), 422, "NUL")
    assert_problem(upload(http, carol, "d\x00.npz", npz_bytes()), 422, "NUL")
    assert datasets_of(http, carol) == before
    stored = list((live[1].storage_dir / "datasets").rglob("*"))
    assert not [p for p in stored if p.is_file()]


def test_nul_in_job_or_zoo_body_is_422(http, carol, root):
    body = {"dataset_id": str(uuid.uuid4()), "select_by": "is\x00ms"}
    assert_problem(http.post("/jobs", json=body, headers=carol), 422, "NUL")
    zoo = {"id": "nul-src", "arch": "test_resnet", "weights": "none", "num_classes": 3}
    resp = http.post("/zoo", json={**zoo, "source": "a\x00"}, headers=root)
    assert_problem(resp, 422, "NUL")
    resp = http.post("/zoo", json={**zoo, "tags": ["ok", "b\x00"]}, headers=root)
    assert_problem(resp, 422, "NUL")


# -- 8: truncated multipart ------------------------------------------------------------------


def test_multipart_without_closing_boundary_is_400_and_not_stored(http, carol, live):
    before = datasets_of(http, carol)
    resp = upload(http, carol, "d.npz", b"123456789", close=False)
    assert_problem(resp, 400, "closing boundary")
    resp = upload(http, carol, "d.npz", npz_bytes(), close=False)
    assert_problem(resp, 400, "closing boundary")
    assert datasets_of(http, carol) == before
    stored = list((live[1].storage_dir / "datasets").rglob("*"))
    assert not [p for p in stored if p.is_file()]


# -- 9: strict types in the job body ---------------------------------------------------------


@pytest.fixture(scope="module")
def ready(http, carol, root):
    zoo = {"id": "strict-net", "arch": "test_resnet", "weights": "none", "num_classes": 3}
    resp = http.post("/zoo", json=zoo, headers=root)
    assert resp.status_code in (201, 409), resp.text
    resp = upload(http, carol, "ok.npz", npz_bytes())
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


@pytest.mark.parametrize(
    "finetune, field",
    [
        ({"epochs": "2"}, "epochs"),
        ({"epochs": 2.0}, "epochs"),
        ({"epochs": True}, "epochs"),
        ({"workers": "1"}, "workers"),
        ({"density": "0.1"}, "density"),
        ({"lr": "0.01"}, "lr"),
        ({"compressor": 5}, "compressor"),
    ],
)
def test_job_body_types_are_strict(http, carol, ready, finetune, field):
    body = {"dataset_id": ready, "models": ["strict-net"], "finetune": finetune}
    assert_problem(http.post("/jobs", json=body, headers=carol), 422, field)


def test_strict_job_body_still_takes_well_typed_values(http, carol, ready):
    body = {"dataset_id": ready, "models": "all", "metrics": ["sms", "isms"], "select_by": "sms"}
    body["finetune"] = {"epochs": 2, "workers": 1, "density": 1, "lr": 0.01}
    resp = http.post("/jobs", json=body, headers=carol)
    assert resp.status_code == 202, resp.text
    assert resp.json()["finetune"]["epochs"] == 2
    http.post(f"/jobs/{resp.json()['id']}/cancel", headers=carol)
    for bad in ({"models": "some"}, {"metrics": "sms"}, {"dataset_id": 5}):
        assert_problem(http.post("/jobs", json={**body, **bad}, headers=carol), 422)


@pytest.mark.parametrize(
    "finetune, needle",
    [
        ({"batch_size": 65536}, "ZOOPICK_MAX_BATCH_SIZE"),  # was taken: a worker's memory
        ({"workers": 9}, "finetune.workers above the limit of 8"),
        ({"epochs": 101}, "finetune.epochs above the limit of 100"),
    ],
)
def test_the_deployments_training_limits_refuse_a_job(http, carol, ready, finetune, needle):
    body = {"dataset_id": ready, "models": ["strict-net"], "finetune": finetune}
    resp = http.post("/jobs", json=body, headers=carol)
    assert 400 <= resp.status_code < 500 and needle in resp.text, resp.text


@pytest.mark.parametrize(
    "finetune, needle",
    [
        ({"workers": 8}, "cannot feed 8 workers"),  # 18 images, 15 to train on
        ({"max_per_class": 1}, "no class 2 images"),
    ],
)
def test_a_fine_tune_the_dataset_cannot_feed_is_refused_at_submission(
    http, carol, ready, finetune, needle
):
    # it was accepted, every model scored, and the job failed once its workers had started
    body = {"dataset_id": ready, "models": ["strict-net"], "finetune": finetune}
    resp = http.post("/jobs", json=body, headers=carol)
    assert resp.status_code == 422 and needle in resp.text, resp.text


# -- 10: no internals in errors --------------------------------------------------------------


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def test_errors_name_the_problem_without_internals(http, carol):
    bad_png = _zip({f"{c}/{i}.png": b"not a png at all" for c in "ab" for i in range(2)})
    body = assert_problem(upload(http, carol, "bad.zip", bad_png), 422, "not a recognised image")
    assert "0x" not in body["detail"] and "BytesIO" not in body["detail"]

    npy = io.BytesIO()
    np.save(npy, np.zeros((4, 8, 8), np.uint8))
    body = assert_problem(upload(http, carol, "renamed.npz", npy.getvalue()), 422, ".npy")
    assert "TypeError" not in body["detail"] and "context manager" not in body["detail"]


def test_checkpoint_paths_are_shown_to_admins_only(http, carol, root, tmp_path_factory):
    from tests.service.checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "c10.safetensors", 10)
    zoo = {"id": "path-net", "arch": "test_resnet", "weights": str(path), "num_classes": 10}
    resp = http.post("/zoo", json=zoo, headers=root)
    assert resp.status_code == 201, resp.text
    assert http.get("/zoo/path-net", headers=root).json()["weights"] == str(path)
    seen = http.get("/zoo/path-net", headers=carol).json()["weights"]
    assert seen == "checkpoint"
    listed = http.get("/zoo", params={"page_size": 100}, headers=carol).json()["items"]
    assert all(str(path.parent) not in m["weights"] for m in listed)
    assert all(m["weights"] in ("hub", "none", "checkpoint") for m in listed)


# -- 11: a checkpoint that does not fit its architecture -------------------------------------


def test_a_checkpoint_that_does_not_fit_is_refused_at_registration(http, root, tmp_path_factory):
    from tests.service.checkpoints import write_checkpoint

    folder = tmp_path_factory.mktemp("ckpt-bad")
    ten = write_checkpoint(folder / "ten.safetensors", 10)
    vit = write_checkpoint(folder / "vit.safetensors", 10, arch="test_vit")
    base = {"arch": "test_resnet", "num_classes": 10}
    cases = [
        ({**base, "id": "wrong-head", "weights": str(ten), "num_classes": 7}, "7"),
        ({**base, "id": "wrong-arch", "weights": str(vit)}, "does not match"),
        ({**base, "id": "missing", "weights": str(folder / "nope.safetensors")}, "not found"),
    ]
    for body, needle in cases:
        assert_problem(http.post("/zoo", json=body, headers=root), 422, needle)
        assert http.get(f"/zoo/{body['id']}", headers=root).status_code == 404
    resp = http.post("/zoo", json={**base, "id": "fits", "weights": str(ten)}, headers=root)
    assert resp.status_code == 201, resp.text


# -- bodies read whole are capped ------------------------------------------------------------


def test_json_bodies_are_capped_and_uploads_stream_past_the_cap(http, carol, root):
    """A JSON body is read whole before it is validated: without a cap, a 300 MB job body grew
    the API process by 900 MB. Beyond ``ZOOPICK_BODY_MAX_BYTES`` (1 MiB) it is 413, with or
    without a Content-Length; an upload (4 MiB allowed here) streams past that cap.

    Starlette answers a Content-Length over the cap in plain text before reading a byte (it
    replaces whatever the app answers); a body that only turns out too large as it arrives
    gets the problem document naming the setting."""
    json_headers = {"content-type": "application/json"}
    big = b'{"dataset_id": "' + b"0" * (2 * 1024**2) + b'"}'
    for path, who in (("/jobs", carol), ("/zoo", root)):
        resp = http.post(path, content=big, headers={**who, **json_headers})
        assert resp.status_code == 413 and "Too Large" in resp.text, resp.text

    def chunked():
        yield b'{"dataset_id": "'
        for _ in range(40):
            yield b"0" * 65536
        yield b'"}'

    resp = http.post("/jobs", content=chunked(), headers={**carol, **json_headers})
    assert "content-length" not in resp.request.headers
    assert_problem(resp, 413, "ZOOPICK_BODY_MAX_BYTES")
    small = http.post("/jobs", json={"dataset_id": str(uuid.uuid4())}, headers=carol)
    assert_problem(small, 422, "unknown dataset")
    junk = upload(http, carol, "junk.npz", b"x" * (2 * 1024**2))
    assert_problem(junk, 422)


# -- found by an outside-style probe (session 19) ---------------------------------------------


def named_npz(class_names, labels=(0, 0, 1, 1), size=4) -> bytes:
    buf = io.BytesIO()
    x = np.random.default_rng(0).integers(0, 255, (len(labels), size, size), dtype=np.uint8)
    np.savez(buf, x=x, y=np.array(labels, dtype=np.int64), class_names=np.array(class_names))
    return buf.getvalue()


@pytest.mark.parametrize("filename", ["数据.npz", "é.npz", ".npz"])
def test_a_file_name_without_ascii_letters_keeps_its_format(http, carol, filename):
    # the stored name kept no suffix ("npz"), and a valid upload ended invalid
    resp = upload(http, carol, filename, npz_bytes())
    assert resp.status_code == 201, resp.text
    assert resp.json()["status"] == "ready" and resp.json()["filename"] == filename
    http.delete(f"/datasets/{resp.json()['id']}", headers=carol)


@pytest.mark.parametrize(
    "names, labels, needle",
    [
        (["a" * 5000, "b"], (0, 0, 1, 1), "max_class_name_chars=200"),
        (["a\x00b", "c"], (0, 0, 1, 1), "control character"),
        (["a\x1b[31m", "c"], (0, 0, 1, 1), "control character"),
        (["a", "b", "never"], (0, 0, 1, 1), "1 class(es) with no images ('never')"),
    ],
)
def test_class_names_are_bounded_clean_and_used(http, carol, names, labels, needle):
    # on PostgreSQL a NUL in a name was a 500 waiting to happen; a 5,000-character name made
    # every listing of the dataset megabytes long; a declared class with no image passed
    before = datasets_of(http, carol)
    resp = upload(http, carol, "names.npz", named_npz(names, labels))
    assert_problem(resp, 422, needle)
    assert datasets_of(http, carol) == before


def test_a_nul_or_space_in_a_webhook_url_is_422(http, carol):
    for url in (
        "http://93.184.216.34/a\x00b",
        "http://93.184.216.34/a b",
        "http://[64:ff9b::7f00:1]/",
    ):
        resp = http.put("/webhook", json={"url": url}, headers=carol)
        assert resp.status_code == 422, (url, resp.text)
    assert http.get("/webhook", headers=carol).json()["url"] is None


def test_a_zoo_input_size_beyond_any_model_is_422(http, root):
    body = {"id": "giant-input", "arch": "test_resnet", "weights": "none", "num_classes": 3}
    resp = http.post("/zoo", json={**body, "input_size": [3, 100000, 100000]}, headers=root)
    assert_problem(resp, 422, "2048")
    assert http.get("/zoo/giant-input", headers=root).status_code == 404


def test_a_dataset_deleted_while_it_is_validated_leaves_no_files(live, carol, monkeypatch):
    """The delete removes the files it finds; validation went on writing thumbnails for a
    dataset that no longer existed (no row, no quota, never removed). The delete is made to
    land while the validation runs (the API's own delete steps, in the thumbnail step)."""
    from zoopick.service.datasets import store
    from zoopick.service.db.models import Dataset, Tenant
    from zoopick.service.db.session import session_scope

    _, settings, factory = live
    ds_id = uuid.uuid4()
    folder = store.dataset_dir(settings, ds_id)
    folder.mkdir(parents=True)
    (folder / "d.npz").write_bytes(npz_bytes())
    with session_scope(factory) as session:
        tenant = session.query(Tenant).filter_by(name="carol").one()
        session.add(
            Dataset(
                id=ds_id, tenant_id=tenant.id, name="racing", format="npz", filename="d.npz",
                size_bytes=1, file_sha256="0" * 64, storage_path=str(folder / "d.npz"),
            )
        )  # fmt: skip
    thumbnails = store._thumbnails

    def deleted_meanwhile(loaded, ds, settings):
        with session_scope(factory) as session:
            session.delete(session.get(Dataset, ds_id))
        store.remove_files(settings, ds)
        thumbnails(loaded, ds, settings)
        assert any(folder.rglob("*")), "the thumbnails were written after the delete"

    monkeypatch.setattr(store, "_thumbnails", deleted_meanwhile)
    assert store.validate(factory, ds_id, settings) == "deleted"
    assert not folder.exists()
