"""Zoo registration (``POST /zoo``) refuses entries that would cost or fail every scoring job,
and stores exactly what it checked (PostgreSQL and Redis; the last test with a real worker).

An outside probe registered: a crop_pct small enough to resize every image to ~14,500 px, a
1,000,000-class head, a std of 1e-300, ``num_classes: true`` (stored as 1) and a checkpoint
path through ``..`` and a symbolic link (stored as given, not as checked).
"""

from __future__ import annotations

import hashlib

import pytest

from tests.service import procs
from tests.service.checkpoints import write_checkpoint
from tests.service.test_api import API, assert_problem

BASE = {"arch": "test_resnet", "weights": "none", "num_classes": 10}


def register(client, admin, model_id: str, **fields):
    return client.post(f"{API}/zoo", json={**BASE, "id": model_id, **fields}, headers=admin.headers)


def assert_refused(client, admin, prefix: str, needles: tuple[str, ...], **fields) -> None:
    """422 naming ``needles``, and nothing stored. Each case has an id of its own, so one that
    got through cannot make the next a 409."""
    model_id = f"{prefix}-{hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:12]}"
    assert_problem(register(client, admin, model_id, **fields), 422, *needles)
    assert client.get(f"{API}/zoo/{model_id}", headers=admin.headers).status_code == 404


@pytest.mark.parametrize(
    "fields",
    [
        {"input_size": [3, 32, 32], "crop_pct": 0.0022},
        {"input_size": [3, 32, 32], "crop_pct": 1e-300},
        {"input_size": [3, 2048, 2048], "crop_pct": 0.02},
        {"crop_pct": 0.05},  # test_resnet's own 160 px input
    ],
)
def test_a_crop_pct_resizing_beyond_the_bound_is_422(client, admin, fields):
    assert_refused(client, admin, "tiny-crop", ("crop_pct", "input_size", "2048 px"), **fields)


def test_a_crop_pct_resizing_to_the_bound_is_accepted(client, admin):
    resp = register(client, admin, "edge-crop", input_size=[3, 32, 32], crop_pct=32 / 2048)
    assert resp.status_code == 201, resp.text
    assert resp.json()["overrides"] == {"input_size": [3, 32, 32], "crop_pct": 32 / 2048}


@pytest.mark.parametrize("num_classes", [1_000_000, 100_001])
def test_a_head_beyond_any_real_model_is_422(client, admin, num_classes):
    assert_refused(client, admin, "wide-head", ("num_classes", "100000"), num_classes=num_classes)


def test_a_head_of_imagenet_21k_is_accepted(client, admin):
    resp = register(client, admin, "in21k-head", num_classes=21_843)
    assert resp.status_code == 201, resp.text


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"std": [1e-300] * 3}, "std values must be between"),
        ({"std": [0.5, 1e-9, 0.5]}, "std values must be between"),
        ({"mean": [1e308] * 3}, "mean values must be between"),
        ({"mean": [-2e6, 0.5, 0.5]}, "mean values must be between"),
    ],
)
def test_a_normalisation_that_is_never_finite_is_422(client, admin, fields, needle):
    assert_refused(client, admin, "nan-norm", (needle, "float32"), **fields)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"num_classes": True}, "num_classes"),
        ({"num_classes": "8"}, "num_classes"),
        ({"num_classes": 8.0}, "num_classes"),
        ({"input_size": [3, True, True]}, "input_size.1"),
        ({"input_size": [3, "32", 32]}, "input_size.1"),
        ({"mean": ["0.5", "0.5", "0.5"]}, "mean.0"),
        ({"std": [0.5, 0.5, True]}, "std.2"),
        ({"crop_pct": True}, "crop_pct"),
        ({"crop_pct": "1"}, "crop_pct"),
        ({"arch": 7}, "arch"),
        ({"tags": ["a", 1]}, "tags.1"),
    ],
)
def test_registration_does_not_coerce_types(client, admin, fields, field):
    assert_refused(client, admin, "coerced", (field,), **fields)


def test_an_int_where_a_float_is_expected_is_accepted(client, admin):
    resp = register(client, admin, "int-floats", mean=[0, 1, 0], std=[1, 1, 1], crop_pct=1)
    assert resp.status_code == 201, resp.text
    overrides = resp.json()["overrides"]
    assert overrides == {"mean": [0.0, 1.0, 0.0], "std": [1.0, 1.0, 1.0], "crop_pct": 1.0}


def test_a_dotted_checkpoint_path_is_stored_resolved(client, admin, tmp_path):
    real = write_checkpoint(tmp_path / "ok.safetensors", 10)
    (tmp_path / "sub").mkdir()
    dotted = register(client, admin, "dotted-ckpt", weights=f"{tmp_path}/sub/../ok.safetensors")
    assert dotted.status_code == 201, dotted.text
    assert dotted.json()["weights"] == str(real.resolve())


def test_a_linked_checkpoint_is_stored_as_the_file_that_was_checked(client, admin, tmp_path):
    """Re-pointing the link after registration cannot change which file jobs load."""
    real = write_checkpoint(tmp_path / "ok.safetensors", 10)
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    linked = register(client, admin, "linked-ckpt", weights=str(link))
    assert linked.status_code == 201, linked.text
    other = write_checkpoint(tmp_path / "vit.safetensors", 10, arch="test_vit")
    link.unlink()
    link.symlink_to(other)  # re-pointed after the check
    shown = client.get(f"{API}/zoo/linked-ckpt", headers=admin.headers).json()
    assert shown["weights"] == str(real.resolve())


# -- at scoring time: logits over the bound skip the model, not the worker's memory -----------


@pytest.fixture(scope="module")
def bounded_service(isolated_settings):
    """An API and a worker whose extraction bound (``ZOOPICK_MAX_LOGITS_BYTES``) holds 18
    images of a 10-output head (720 bytes) but not of a 1,000-output one (72,000 bytes): the
    same refusal a 100,000-output head meets on a large dataset."""
    from zoopick.service.db.models import ZooModel
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope

    settings = isolated_settings("logits-bound")
    token = procs.create_token(settings, "zed")
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        for model_id, classes in (("narrow", 10), ("wide", 1000)):
            row = ZooModel(id=model_id, arch="test_resnet", weights="none", num_classes=classes)
            row.overrides = {"input_size": [3, 32, 32]}
            session.add(row)
    engine.dispose()
    extra = {"ZOOPICK_MAX_LOGITS_BYTES": "10000"}
    with procs.api_and_worker(settings, "cpu,gpu", token, extra, prefix=API) as (http, worker):
        yield http, worker


def test_logits_over_the_bound_skip_the_model_with_its_error(bounded_service):
    http, worker = bounded_service
    job = procs.rank_the_whole_zoo(http, "logme")
    assert job["status"] == "succeeded", (job, worker.tail())
    assert [r["model"] for r in job["ranking"]] == ["narrow"]
    error = job["model_errors"]["wide"]
    assert "'wide'" in error and "72,000 bytes" in error, error
    assert "10,000 bytes (ZOOPICK_MAX_LOGITS_BYTES)" in error, error
