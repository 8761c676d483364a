"""Dataset upload: streamed to storage, size-limited while streaming, validated with the
selection engine's loader (inline in these tests), listed with page tokens."""

from __future__ import annotations

import uuid

import pytest

from tests.service.datafiles import (
    imagefolder_tar_bytes,
    imagefolder_zip_bytes,
    not_a_dataset_zip_bytes,
    npz_bytes,
)
from tests.service.test_api import API, assert_problem


def upload(client, tenant, filename: str, data: bytes, name: str | None = None):
    form = {"name": name} if name else None
    return client.post(
        f"{API}/datasets",
        files={"file": (filename, data, "application/octet-stream")},
        data=form,
        headers=tenant.headers,
    )


def storage_files(settings) -> list:
    """Every dataset file in the (local) store, and anything left half-written."""
    root = settings.storage_dir
    found = [p for p in (root / "tenants").rglob("*") if p.is_file() and "datasets" in p.parts]
    return found + [p for p in (root / ".partial").glob("*")]


# -- streaming and limits (no dataset loader needed) -------------------------------------------


def test_not_multipart_is_415(client, alice):
    resp = client.post(f"{API}/datasets", content=b"x" * 10, headers=alice.headers)
    assert_problem(resp, 415, "multipart/form-data")


def test_unsupported_extension_is_415_and_nothing_kept(client, alice, service_settings):
    before = storage_files(service_settings)
    assert_problem(upload(client, alice, "data.csv", b"a,b\n1,2\n"), 415, "data.csv")
    assert storage_files(service_settings) == before


def test_missing_file_part_is_400(client, alice):
    resp = client.post(
        f"{API}/datasets",
        files={"attachment": ("d.npz", b"abc", "application/octet-stream")},
        data={"name": "x"},
        headers=alice.headers,
    )
    assert_problem(resp, 400, "'file'")


def test_oversized_upload_is_cut_off_with_413(client, alice, service_settings):
    before = storage_files(service_settings)
    big = b"\0" * (service_settings.upload_max_bytes + 1)
    assert_problem(upload(client, alice, "big.npz", big), 413, "limit")
    assert storage_files(service_settings) == before


def test_oversized_upload_without_length_is_cut_off_while_streaming(
    client, alice, service_settings
):
    """A chunked body (no Content-Length) is counted as it streams."""
    boundary = "zpboundary"
    limit = service_settings.upload_max_bytes

    def body():
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="big.npz"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()
        chunk = b"\1" * 65536
        for _ in range(limit // len(chunk) + 2):
            yield chunk
        yield f"\r\n--{boundary}--\r\n".encode()

    resp = client.post(
        f"{API}/datasets",
        content=body(),
        headers={**alice.headers, "content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert_problem(resp, 413)


# -- validation with the selection engine ----------------------------------------------------


@pytest.fixture(scope="module")
def loader():
    return pytest.importorskip("zoopick.selection.data", reason="selection engine")


def test_upload_npz_is_validated(client, alice, loader):
    resp = upload(client, alice, "shapes.npz", npz_bytes(), name="my shapes")
    assert resp.status_code == 201, resp.text
    ds = resp.json()
    assert resp.headers["location"] == f"{API}/datasets/{ds['id']}"
    assert ds["status"] == "ready" and ds["error"] is None
    assert ds["name"] == "my shapes" and ds["format"] == "npz"
    assert len(ds["classes"]) == 3 and sum(ds["counts"].values()) == 18 == ds["num_samples"]
    assert ds["digest"]
    assert client.get(f"{API}/datasets/{ds['id']}", headers=alice.headers).json() == ds


def test_upload_imagefolder_zip_is_validated(client, alice, loader):
    resp = upload(client, alice, "pets.zip", imagefolder_zip_bytes())
    assert resp.status_code == 201, resp.text
    ds = resp.json()
    assert ds["classes"] == ["cat", "dog"] and ds["counts"] == {"cat": 4, "dog": 4}
    assert ds["format"] == "zip" and ds["name"] == "pets.zip"


def test_validation_keeps_the_images_decoded_for_scoring(client, alice, service_settings, loader):
    """Validation decodes an archive's images once and keeps them beside it in the store: a
    scoring task reads that copy (the archive gone, it still gives the dataset the row
    describes), and the dataset's deletion removes it with the file."""
    from zoopick.service import datasets as store
    from zoopick.service.db.models import Dataset

    resp = upload(client, alice, "pets.zip", imagefolder_zip_bytes())
    assert resp.status_code == 201, resp.text
    ds = resp.json()
    with client.app.state.sessionmaker() as session:
        key = session.get(Dataset, uuid.UUID(ds["id"])).storage_path
    folder = service_settings.storage_dir / key.rsplit("/", 1)[0]
    assert key.startswith("tenants/") and key.endswith("/pets.zip")
    assert (folder / "decoded" / "pixels.npy").is_file()
    # the trainer reads the local store's own files, nothing copied
    assert store.run_data(key, service_settings) == {
        "data": str(service_settings.storage_dir / key),
        "decoded": str(folder / "decoded"),
    }
    (service_settings.storage_dir / key).unlink()
    scored = store.for_scoring(key, service_settings)
    assert scored.digest == ds["digest"] and len(scored) == ds["num_samples"]
    assert client.delete(f"{API}/datasets/{ds['id']}", headers=alice.headers).status_code == 204
    assert not [p for p in folder.rglob("*") if p.is_file()]


@pytest.mark.parametrize("compression", ["xz", "bz2"])
def test_upload_imagefolder_tar_of_every_compression_the_loader_reads(
    client, alice, service_settings, loader, compression
):
    """The API accepts what the one loader reads (``selection.formats``): a .tar.xz or
    .tar.bz2 was refused with a 415 that the workers would have read."""
    filename = f"pets.tar.{compression}"
    resp = upload(client, alice, filename, imagefolder_tar_bytes(compression))
    assert resp.status_code == 201, resp.text
    ds = resp.json()
    assert ds["status"] == "ready" and ds["error"] is None
    assert ds["classes"] == ["cat", "dog"] and ds["counts"] == {"cat": 4, "dog": 4}
    assert ds["format"] == f"tar.{compression}" and ds["name"] == filename
    stored = [p.name for p in storage_files(service_settings) if ds["id"] in str(p)]
    assert filename in stored  # kept under its suffix, which the loader reads it by


def test_archive_that_is_not_a_dataset_is_422(client, alice, service_settings, loader):
    before = storage_files(service_settings)
    body = assert_problem(upload(client, alice, "notes.zip", not_a_dataset_zip_bytes()), 422)
    assert "not a usable dataset" in body["detail"] and "class" in body["detail"]
    assert storage_files(service_settings) == before


def test_npz_whose_test_split_has_labels_training_never_has_is_422(
    client, alice, service_settings, loader
):
    """Validation reads a Keras npz's y_test too: a label the training split never has is
    refused, named, and the file is not kept."""
    import io

    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (12, 8, 8), dtype=np.uint8)
    buf = io.BytesIO()
    y_train, y_test = np.arange(12) % 3, np.array([0, 1, 2, 9])
    np.savez(buf, x_train=x, y_train=y_train, x_test=x[:4], y_test=y_test)
    before = storage_files(service_settings)
    body = assert_problem(upload(client, alice, "keras.npz", buf.getvalue()), 422, "y_test")
    assert "label(s) that y_train never has: 9 (1 test image(s))" in body["detail"]
    assert storage_files(service_settings) == before


def test_npz_class_names_that_differ_only_in_case_are_classes_a_zip_folders_are_not(
    client, alice, service_settings, loader
):
    """An npz's 'A' and 'a' (EMNIST's letters) are two classes: validated, counted and
    given thumbnails each under its own name. Two folders 'cat' and 'Cat' in a zip are one
    folder on macOS or Windows: a 422 naming them, and the file is not kept."""
    import io

    import numpy as np

    from zoopick.service.datasets.store import thumbnails_of
    from zoopick.service.db.models import Dataset

    x = np.broadcast_to(np.repeat(np.array([0, 100, 200], np.uint8), 4)[:, None, None], (12, 8, 8))
    y = np.repeat(np.arange(3), 4)
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y, class_names=np.array(["A", "a", "b"]))
    resp = upload(client, alice, "letters.npz", buf.getvalue())
    assert resp.status_code == 201, resp.text
    ds = resp.json()
    assert ds["status"] == "ready" and ds["error"] is None
    assert ds["classes"] == ["A", "a", "b"] and ds["counts"] == {"A": 4, "a": 4, "b": 4}
    with client.app.state.sessionmaker() as session:
        row = session.get(Dataset, uuid.UUID(ds["id"]))
        thumbs = thumbnails_of(service_settings, row)
    assert set(thumbs) == {"A", "a", "b"}
    assert len({f for files in thumbs.values() for f in files}) == 12  # none overwrote another
    before = storage_files(service_settings)
    pets = imagefolder_zip_bytes(classes=("cat", "Cat"))
    body = assert_problem(upload(client, alice, "pets.zip", pets), 422, "'cat'", "'Cat'")
    assert "differ only in letter case" in body["detail"]
    assert storage_files(service_settings) == before


def test_dataset_list_pagination_and_delete(client, make_key, service_settings, loader):
    fay = make_key("fay")
    ids = [upload(client, fay, f"d{i}.npz", npz_bytes(seed=i)).json()["id"] for i in range(3)]
    first = client.get(f"{API}/datasets?page_size=2", headers=fay.headers).json()
    assert [d["id"] for d in first["items"]] == ids[::-1][:2]
    second = client.get(
        f"{API}/datasets?page_size=2&page_token={first['next_page_token']}", headers=fay.headers
    ).json()
    assert [d["id"] for d in second["items"]] == ids[:1] and second["next_page_token"] is None
    assert client.delete(f"{API}/datasets/{ids[0]}", headers=fay.headers).status_code == 204
    assert not [p for p in storage_files(service_settings) if ids[0] in p.parts]
    left = client.get(f"{API}/datasets", headers=fay.headers).json()["items"]
    assert {d["id"] for d in left} == set(ids[1:])


def test_dataset_list_filters_by_every_status_of_the_enum_and_no_other(client, make_key, loader):
    """The filter's pattern and the body's status are both read from ``DatasetStatus``."""
    from zoopick.service.db.models import DatasetStatus

    gil = make_key("gil")
    ready = upload(client, gil, "d.npz", npz_bytes()).json()
    for status in DatasetStatus:
        resp = client.get(f"{API}/datasets?status={status.value}", headers=gil.headers)
        assert resp.status_code == 200, resp.text
        want = [ready["id"]] if status == DatasetStatus.ready else []
        assert [d["id"] for d in resp.json()["items"]] == want, status
    assert_problem(client.get(f"{API}/datasets?status=done", headers=gil.headers), 422, "status")
