"""A job over "all" models skips a broken zoo entry with a per-model error instead of failing
whole (issue 10, item 11): real worker (cpu and gpu queues), uvicorn, PostgreSQL and Redis.

The broken entry is written straight into the database (registration through the API now
refuses it): a ``test_resnet`` row whose checkpoint is a ``test_vit``'s, as an entry from an
older manifest or a checkpoint replaced on disk would be.
"""

from __future__ import annotations

import pytest

from tests.service import procs
from tests.service.checkpoints import write_checkpoint
from tests.service.test_api import API


@pytest.fixture(scope="module")
def service(isolated_settings):
    from zoopick.service.db.models import ZooModel
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope

    settings = isolated_settings("broken-zoo")
    token = procs.create_token(settings, "zed")
    vit = write_checkpoint(settings.data_dir / "vit.safetensors", 10, arch="test_vit")
    engine = make_engine(settings.database_url)
    with session_scope(make_sessionmaker(engine)) as session:
        session.add(ZooModel(id="good", arch="test_resnet", weights="none", num_classes=10,
                             overrides={"input_size": [3, 32, 32]}))  # fmt: skip
        session.add(ZooModel(id="broken", arch="test_resnet", weights=str(vit), num_classes=10,
                             overrides={"input_size": [3, 32, 32]}))  # fmt: skip
    engine.dispose()
    with procs.api_and_worker(settings, "cpu,gpu", token, prefix=API) as (http, worker):
        yield http, worker


def test_a_broken_zoo_entry_is_skipped_with_its_error(service):
    http, worker = service
    job = procs.rank_the_whole_zoo(http, "sms")
    assert job["status"] == "succeeded", (job, worker.tail())
    assert job["chosen_model"] == "good"
    assert [r["model"] for r in job["ranking"]] == ["good"]
    assert set(job["model_errors"]) == {"broken"}
    assert (
        "does not fit" in job["model_errors"]["broken"]
        or "checkpoint" in (job["model_errors"]["broken"])
    )
    assert job["progress"] == 1.0
