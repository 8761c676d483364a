"""Issue 40: a job whose worker finds the store stopped waits for it and finishes once it is
back. The gpu worker reaches the real S3 server (SeaweedFS) through a link the test cuts
(``tcpcut.CuttableLink``: the store's outage as that worker sees it, without stopping the
server other tests share); the API, which took the upload, reaches it directly."""

from __future__ import annotations

import uuid
from urllib.parse import urlparse

from tests.service.datafiles import npz_bytes
from tests.service.procs import (
    create_token,
    poll,
    start_api,
    start_worker,
    wait_worker_ready,
)
from tests.service.tcpcut import CuttableLink

API = "/api/v1"
RETRIED = "trying again"
"""What ``storage.retrying`` logs each time the store was unavailable."""


def test_a_job_waiting_on_a_stopped_store_finishes_once_it_is_back(
    s3_server, isolated_settings, tmp_path
):
    import httpx

    cfg = isolated_settings(
        "outage", validate_inline=True, storage_url=s3_server.url(f"outage-{uuid.uuid4().hex[:8]}")
    )
    token, admin = create_token(cfg, "outage"), create_token(cfg, "ops", admin=True)
    server = urlparse(s3_server.endpoint)
    link = CuttableLink(server.hostname, server.port)
    # the worker's machine: its own folder (nothing of the API's upload cached there)
    there = type(cfg)(
        data_dir=tmp_path / "worker",
        **{k: getattr(cfg, k) for k in ("database_url", "broker_url", "redis_key_prefix")},
        storage_url=cfg.storage_url,
    )
    cut_off = {**s3_server.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{link.port}"}
    worker = start_worker(there, "cpu,gpu", tmp_path, cut_off)
    api, base = start_api(cfg, cfg.data_dir, s3_server.env)
    try:
        wait_worker_ready(worker)
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=base + API, headers=auth, timeout=60) as http:
            zoo = {"id": "tiny", "arch": "test_resnet", "weights": "none", "num_classes": 10,
                   "input_size": [3, 32, 32]}  # fmt: skip
            added = http.post("/zoo", json=zoo, headers={"Authorization": f"Bearer {admin}"})
            assert added.status_code == 201, added.text
            up = http.post("/datasets", files={"file": ("shapes.npz", npz_bytes(12), "x")})
            assert up.status_code == 201 and up.json()["status"] == "ready", up.text

            link.cut()  # the store stops, as the worker sees it
            resp = http.post("/jobs", json={"dataset_id": up.json()["id"], "metrics": ["logme"]})
            assert resp.status_code == 202, resp.text
            jid = resp.json()["id"]
            poll(lambda: RETRIED in worker.log.read_text(errors="replace"), bool, timeout=60,
                 what="the worker to meet the stopped store")  # fmt: skip
            assert http.get(f"/jobs/{jid}").json()["status"] in ("queued", "scoring")
            link.restore()

            job = poll(
                lambda: http.get(f"/jobs/{jid}").json(),
                lambda j: j["status"] in ("succeeded", "failed", "cancelled"),
                timeout=60,
                what=f"job {jid}",
            )
            assert job["status"] == "succeeded", (job, worker.tail())
            assert job["ranking"] and job["ranking"][0]["model"] == "tiny", job
    finally:
        link.close()
        api.stop()
        worker.stop()
