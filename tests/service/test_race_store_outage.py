"""A race rung whose gpu worker finds the store out while it fetches the rung's files (issue
40). The candidate's claim is committed first: while the worker tries the store again, the
entry reads ``running``, its lease renewed past its length (no transaction held through the
fetch). Once the retries are spent, the entry is settled as failed naming the store, as a
rung whose checkpoint could not be fetched is, and the race, left with no candidate, fails
the job. The worker reaches the real S3 server (SeaweedFS) through a link the test cuts
(``tcpcut.CuttableLink``): the store's outage as that worker sees it."""

from __future__ import annotations

import contextlib
import time
import uuid
from datetime import timedelta
from urllib.parse import urlparse

from sqlalchemy import select

from tests.service.procs import free_port, poll, start_worker, wait_worker_ready
from tests.service.tcpcut import CuttableLink
from zoopick.service.datasets.store import dataset_key
from zoopick.service.db.models import Dataset, Job, RaceEntry, ZooModel
from zoopick.service.db.session import make_engine, make_sessionmaker
from zoopick.service.db.types import utcnow
from zoopick.service.dispatch import Dispatcher
from zoopick.service.security import get_or_create_tenant

LEASE = 4
"""The worker's lease (s): the store's retries (about 22 s) outlast it several times."""
RETRIED = "trying again"
"""What ``storage.retrying`` logs each time the store was unavailable."""
MODEL = "outage-resnet"
PLAN = {
    "train_images": 24, "steps_per_epoch": 6, "budget_steps": 12, "shortlist": [MODEL],
    "rung": 0, "winner": None, "why": None,
    "rungs": [{"candidates": 1, "steps_each": 12, "total_steps": 12}],
}  # fmt: skip


def _racing_job(factory) -> Job:
    """A job as selection left it: racing, its one candidate's rung queued (the dataset a
    key of the store: what the worker cannot reach)."""
    with factory.begin() as session:
        tenant = get_or_create_tenant(session, "outage").id
        if session.get(ZooModel, MODEL) is None:
            session.add(ZooModel(id=MODEL, arch="test_resnet", weights="none", num_classes=10))
        ds_id = uuid.uuid4()
        key = dataset_key(tenant, ds_id, "race.npz")
        session.add(Dataset(id=ds_id, tenant_id=tenant, name="race", format="npz",
                            filename="race.npz", size_bytes=1, file_sha256="0" * 64,
                            status="ready", storage_path=key))  # fmt: skip
        job = Job(tenant_id=tenant, request={}, models=[MODEL], metrics=["logme"],
                  select_by="logme", dataset_id=ds_id, status="racing", race=PLAN,
                  selection={"shortlist": 2})  # fmt: skip
        session.add(job)
        session.flush()
        session.add(RaceEntry(job_id=job.id, model_id=MODEL, rung=0, status="queued",
                              target_steps=12, attempts=0))  # fmt: skip
        session.flush()
        session.expunge(job)
    return job


def _entry(factory, jid: uuid.UUID) -> RaceEntry:
    with factory() as session:
        return session.scalars(select(RaceEntry).where(RaceEntry.job_id == jid)).one()


@contextlib.contextmanager
def _racing_on_a_cut_store(s3_server, isolated_settings, tmp_path, **overrides):
    """A gpu worker whose store is out (its link to the real server cut), sent the rung of a
    racing job's one candidate: yields (settings, session factory, job, worker)."""
    cfg = isolated_settings(
        "raceout",
        storage_url=s3_server.url(f"raceout-{uuid.uuid4().hex[:8]}"),
        lease_seconds=LEASE,
        **overrides,
    )
    server = urlparse(s3_server.endpoint)
    link = CuttableLink(server.hostname, server.port)
    link.cut()  # the store is out, as the gpu worker sees it
    cut_off = {**s3_server.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{link.port}"}
    worker = start_worker(cfg, "gpu", tmp_path, cut_off)
    engine = make_engine(cfg.database_url)
    factory = make_sessionmaker(engine)
    try:
        job = _racing_job(factory)
        Dispatcher(cfg).race_steps(job, 0, [MODEL])
        wait_worker_ready(worker)
        yield cfg, factory, job, worker
    finally:
        link.close()
        worker.stop()
        engine.dispose()


def _race_ended(factory, jid: uuid.UUID) -> Job:
    return poll(lambda: _job(factory, jid), lambda j: j.status != "racing", timeout=90,
                what="the race to end")  # fmt: skip


def test_a_rung_whose_files_meet_a_store_outage_is_settled_failed_naming_the_store(
    s3_server, isolated_settings, tmp_path
):
    with _racing_on_a_cut_store(s3_server, isolated_settings, tmp_path) as raced:
        _, factory, job, worker = raced
        poll(lambda: RETRIED in worker.log.read_text(errors="replace"), bool, timeout=60,
             what="the worker to meet the stopped store")  # fmt: skip
        claimed = _entry(factory, job.id)
        # the claim was committed before the fetch: no transaction holds it
        assert claimed.status == "running" and claimed.lease_owner, worker.tail()
        time.sleep(LEASE + 1)  # the store is still being tried: the lease was renewed
        held = _entry(factory, job.id)
        assert held.status == "running" and held.lease_owner == claimed.lease_owner
        assert held.lease_expires_at > utcnow() - timedelta(seconds=0.5), worker.tail()
        assert held.lease_expires_at > claimed.lease_expires_at

        done = _race_ended(factory, job.id)
        entry = _entry(factory, job.id)
        assert entry.status == "failed", (entry.error, worker.tail())
        assert entry.error.startswith("the rung's files could not be fetched: ")
        assert "the store s3://" in entry.error and "is unavailable" in entry.error, entry.error
        assert (entry.lease_owner, entry.lease_expires_at) == (None, None)
        assert done.status == "failed" and done.error.startswith(
            f"the race failed: every candidate of rung 1 failed ({MODEL}: the rung's files"
        ), done.error


def test_a_ray_rung_fetches_no_dataset_on_the_gpu_worker(s3_server, isolated_settings, tmp_path):
    """On Ray the nodes fetch the dataset (``ray_inputs``): the gpu worker, its store out,
    goes straight to the driver, which finds no cluster at the address given."""
    ray = f"127.0.0.1:{free_port()}"  # nothing listens there
    cut = _racing_on_a_cut_store(
        s3_server, isolated_settings, tmp_path, train_backend="ray", ray_address=ray
    )
    with cut as (_, factory, job, worker):
        done = _race_ended(factory, job.id)
        entry = _entry(factory, job.id)
        assert entry.status == "failed", (entry.error, worker.tail())
        assert f"cannot reach the Ray cluster at {ray}" in entry.error, entry.error
        assert RETRIED not in worker.log.read_text(errors="replace")  # the store: untouched
        assert done.status == "failed" and "cannot reach the Ray cluster" in done.error


def _job(factory, jid: uuid.UUID) -> Job:
    with factory() as session:
        return session.get(Job, jid)
