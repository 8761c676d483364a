"""Two-stage selection end to end, with real processes: a uvicorn API, Celery workers on
Redis, PostgreSQL, and the real trainer (torchrun, gloo) for every rung.

A job with ``selection`` scores every model, races the metric's shortlist (successive halving
on a validation split of the training data), picks the race's winner and fine-tunes it from its
race checkpoint. The race never spends more than its budget (counted from the candidates'
checkpoints on disk, not from what the service says), stops when cancelled, and a candidate
whose worker was killed resumes its checkpoint on another worker."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from sqlalchemy import select

from tests.service.datafiles import npz_bytes
from tests.service.procs import on_machine, poll, start_api, start_worker, wait_worker_ready
from tests.service.test_e2e import trainer_processes
from zoopick.service.db.models import RaceEntry, TrainingRun
from zoopick.service.db.session import make_engine, make_sessionmaker
from zoopick.service.pipeline import SCORING_SHARE_WITH_TRAINING
from zoopick.service.security import create_api_key
from zoopick.training.config import CHECKPOINT, METRICS

API = "/api/v1"
ZOO = [("race-resnet", "test_resnet"), ("race-vit", "test_vit"), ("race-resnet-b", "test_resnet")]
FINISHED = ("succeeded", "failed", "cancelled")
LEASE = 8


@pytest.fixture(scope="module")
def stack(new_pg_database, redis_url, tmp_path_factory):
    pytest.importorskip("zoopick.selection.extract", reason="selection engine")
    from zoopick.service.db import migrate
    from zoopick.service.settings import Settings

    url, prefix = redis_url
    data = tmp_path_factory.mktemp("race")
    settings = Settings(
        data_dir=data,
        database_url=new_pg_database(),
        broker_url=url,
        redis_key_prefix=prefix + "race:",
        lease_seconds=LEASE,  # a killed candidate's lease runs out fast
        sweep_interval_seconds=3600,  # the test sweeps itself, when it means to
    )
    migrate.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    factory = make_sessionmaker(engine)
    with factory.begin() as session:
        _, user = create_api_key(session, tenant="racer", name="racer")
        _, admin = create_api_key(session, tenant="ops", name="ops", admin=True)
    procs = []
    try:
        api, base = start_api(settings, data)
        procs.append(api)
        cpu = start_worker(settings, "cpu", data)
        gpu = start_worker(settings, "gpu", data)
        procs += [cpu, gpu]
        client = httpx.Client(
            base_url=base + API, headers={"Authorization": f"Bearer {user}"}, timeout=60
        )
        for mid, arch in ZOO:
            body = {"id": mid, "arch": arch, "weights": "none", "num_classes": 10}
            resp = client.post(
                "/zoo",
                json=body | {"input_size": [3, 32, 32]},
                headers={"Authorization": f"Bearer {admin}"},
            )
            assert resp.status_code == 201, resp.text
        resp = client.post("/datasets", files={"file": ("race.npz", npz_bytes(12, seed=3), "x")})
        assert resp.status_code == 202, resp.text
        dataset = poll(
            lambda: client.get(f"/datasets/{resp.json()['id']}").json(),
            lambda d: d["status"] in ("ready", "invalid"),
            timeout=90,
            what="validation",
        )
        assert dataset["status"] == "ready", dataset
        wait_worker_ready(gpu)
        yield {
            "url": base,
            "key": user,
            "settings": settings,
            "client": client,
            "factory": factory,
            "procs": procs,
            "gpu": gpu,
            "dir": data,
            "dataset": dataset["id"],
        }
    finally:
        for p in procs:
            p.stop()
        engine.dispose()


FINETUNE = {"epochs": 1, "workers": 1, "compressor": "dense", "lr": 0.01, "batch_size": 4}


def _submit(stack, selection: dict, models=None) -> str:
    body = {
        "dataset_id": stack["dataset"],
        "models": models or [m for m, _ in ZOO],
        "metrics": ["logme"],
        "selection": selection,
        "finetune": FINETUNE,
    }
    resp = stack["client"].post("/jobs", json=body)
    assert resp.status_code == 202, resp.text
    assert resp.json()["selection"] == {"validation_fraction": 0.2} | selection
    return resp.json()["id"]


def _job(stack, jid):
    return stack["client"].get(f"/jobs/{jid}").json()


def _wait(stack, jid, until, timeout=300, what="the job"):
    return poll(lambda: _job(stack, jid), until, timeout=timeout, interval=0.5, what=what)


def _race_dir(stack, jid) -> object:
    """The race's folder on the machine of the gpu worker now running."""
    return stack.get("gpu_settings", stack["settings"]).storage_dir / "jobs" / jid / "race"


def _stored_checkpoints(stack, jid, into: Path) -> list[dict]:
    """Each candidate's last checkpoint as the store keeps it (what a rung or the fine-tune
    on another machine starts from)."""
    from zoopick.service import run_checkpoints
    from zoopick.service.storage import open_store

    store = open_store(stack["settings"].storage_url)
    keys = [k for k in store.list("tenants") if f"/jobs/{jid}/race/" in k]
    blobs = []
    for i, key in enumerate(keys):
        tar = store.get_to_file(key, into / f"{i}.tar")
        run_checkpoints.unpack(tar, into / str(i))
        blobs.append(torch.load(into / str(i) / CHECKPOINT, map_location="cpu", weights_only=False))
    return blobs


def _steps(blobs: list[dict], steps_per_epoch: int) -> dict[str, int]:
    """Optimizer steps each candidate's checkpoint holds."""
    return {b["config"]["model"]: b["epoch"] * steps_per_epoch + b.get("step", 0) for b in blobs}


def _best(entries, order, keep):
    ranked = sorted(entries, key=lambda e: (-(e["val_accuracy"]), order.index(e["model"])))
    return [e["model"] for e in ranked[:keep]]


def _running_in_last_rung(job) -> bool:
    rungs = (job.get("race") or {}).get("rungs", [])
    return len(rungs) == 2 and any(e["status"] == "running" for e in rungs[1]["entries"])


def test_a_race_runs_its_rungs_within_budget_survives_a_killed_worker_and_seeds_the_fine_tune(
    stack, tmp_path
):
    """Two rungs; while a candidate trains in the second, its gpu worker is killed (SIGKILL to
    its process group: the trainer dies with it). Once the leases run out the sweeper
    re-queues it, a new worker on another machine (its own data folder, the same store)
    resumes its first-rung checkpoint from the store, the race ends within its budget with
    every candidate's checkpoint in the store, and the fine-tune starts from the winner's."""
    from zoopick.service import recovery
    from zoopick.service.dispatch import Dispatcher

    settings = stack["settings"]
    jid = _submit(stack, {"shortlist": 3, "budget_epochs": 9.0})
    stack["race_job"] = jid
    job = _wait(
        stack,
        jid,
        lambda j: _running_in_last_rung(j) or j["status"] in FINISHED,
        what="a candidate training in the last rung",
    )
    assert _running_in_last_rung(job), job
    old = stack["gpu"]
    os.killpg(old.proc.pid, signal.SIGKILL)
    old.proc.wait()
    with stack["factory"]() as session:
        running = session.scalars(
            select(RaceEntry).where(
                RaceEntry.job_id == uuid.UUID(jid), RaceEntry.status == "running"
            )
        ).all()
        assert running, "no candidate was training when its worker was killed"
        killed = running[0].model_id
    there = on_machine(settings, stack["dir"] / "gpu-2")  # shares no folder with the first
    new = start_worker(there, "gpu", stack["dir"])
    stack["procs"].append(new)
    stack["gpu"], stack["gpu_settings"] = new, there
    # once the dead task's leases (job and candidate) run out, a sweep re-queues the
    # candidate (the new worker's own sweep at start may get there first)
    dispatcher = Dispatcher(settings)

    def sweep_then_read():
        return recovery.sweep(stack["factory"], dispatcher, settings) or _job(stack, jid)

    poll(
        sweep_then_read,
        # >= 1: on a loaded machine both last-rung candidates may have been on the killed worker
        lambda j: isinstance(j, dict) and j["recoveries"] >= 1,
        timeout=120,
        interval=1,
        what="the sweeper to re-queue the killed candidate",
    )

    job = _wait(stack, jid, lambda j: j["status"] in FINISHED)
    assert job["status"] == "succeeded", (job["error"], job["race"], new.tail())
    race = job["race"]
    ranked = [r["model"] for r in job["ranking"]]
    assert race["shortlist"] == ranked[:3]  # stage 1 shortlists by the metric

    # 12 a class: 2 test (round 2.4), then 2 validation of 10: 8 a class to train on,
    # 24 images in batches of 4 = 6 steps an epoch; 9 epochs = 54 steps; 2 rungs of 27
    assert (race["train_images"], race["steps_per_epoch"], race["budget_steps"]) == (24, 6, 54)
    first, last = race["rungs"]
    assert (first["candidates"], first["steps_each"], first["total_steps"]) == (3, 9, 9)
    assert (last["candidates"], last["steps_each"], last["total_steps"]) == (2, 13, 22)
    assert all(e["status"] == "done" and e["steps"] == 9 for e in first["entries"])
    assert all(e["status"] == "done" and e["steps"] == 22 for e in last["entries"]), last
    # the better half (by validation accuracy, ties to the metric's order) went on ...
    survivors = _best(first["entries"], race["shortlist"], 2)
    assert sorted(e["model"] for e in last["entries"]) == sorted(survivors)
    # ... and the better of those won, was chosen, and is what was fine-tuned
    winner = _best(last["entries"], race["shortlist"], 1)[0]
    assert race["winner"] == job["chosen_model"] == job["training"]["model"] == winner
    assert race["why"].startswith(f"{winner} won the last rung")

    # the budget, counted from the checkpoints the candidates left: 3 x 9 + 2 x 13 = 53
    stored = _stored_checkpoints(stack, jid, tmp_path)
    on_disk = _steps(stored, race["steps_per_epoch"])
    assert sorted(on_disk.values()) == [9, 22, 22]
    assert race["spent_steps"] == sum(on_disk.values()) <= race["budget_steps"]
    # every rung annealed (the killed candidate's too, resumed mid-rung): a checkpoint's last
    # step ran at lr (1 + cos(pi (n - 1) / n)) / 2 of its rung's n steps (9, then 13 from 9)
    for blob in stored:
        n = {9: 9, 22: 13}[on_disk[blob["config"]["model"]]]
        want = FINETUNE["lr"] * (1 + math.cos(math.pi * (n - 1) / n)) / 2
        assert blob["optimizer"]["param_groups"][0]["lr"] == pytest.approx(want)

    # the killed candidate's rung ran twice and resumed its first-rung checkpoint, which the
    # new machine had only from the store
    entry = next(e for e in last["entries"] if e["model"] == killed)
    assert entry["attempts"] >= 2 and job["recoveries"] >= 1  # more under heavy load
    folder = next(
        p
        for p in _race_dir(stack, jid).iterdir()
        if torch.load(p / CHECKPOINT, weights_only=False)["config"]["model"] == killed
    )
    events = [json.loads(x) for x in (folder / METRICS).read_text().splitlines()]
    resumed = [e for e in events if e.get("event") == "resumed"]
    assert resumed and resumed[-1]["epoch"] >= 1, events  # its first rung: 9 steps, 1.5 epochs

    # the final fine-tune started from the winner's race checkpoint (no step thrown away)
    with stack["factory"]() as session:
        run = session.scalar(select(TrainingRun).where(TrainingRun.job_id == uuid.UUID(jid)))
        start = run.config["init_from"]
    blob = torch.load(start, map_location="cpu", weights_only=False)
    assert blob["config"]["model"] == winner and start.endswith(CHECKPOINT)
    assert start.startswith(str(there.storage_dir))  # this machine's copy of the winner's
    assert [e["epoch"] for e in job["training"]["epochs"]] == [1]


def test_a_race_is_cancelled_during_a_rung_and_leaves_no_trainer(stack):
    # rung 1: 3 x 16 epochs of 6 steps, far longer than the test waits
    jid = _submit(stack, {"shortlist": 3, "budget_epochs": 99.0})
    _wait(
        stack,
        jid,
        lambda j: any(
            e["status"] == "running"
            for r in (j.get("race") or {}).get("rungs", [])
            for e in r["entries"]
        ),
        timeout=120,
        what="a running rung",
    )
    poll(
        lambda: list(_race_dir(stack, jid).rglob(METRICS)),
        bool,
        timeout=60,
        what="the first epoch of a rung",
    )
    # the rung shows how far it has got while it runs, and the job's progress moves with it
    live = _wait(
        stack,
        jid,
        lambda j: any(
            e["status"] == "running" and (e["reached_steps"] or 0) >= j["race"]["steps_per_epoch"]
            for r in j["race"]["rungs"]
            for e in r["entries"]
        ),
        timeout=60,
        what="a running candidate past its first epoch",
    )
    # scoring ends at its share and no candidate of this rung settles while the test waits:
    # any progress past it comes from the running candidates' steps
    assert live["progress"] > SCORING_SHARE_WITH_TRAINING, live["progress"]
    running = [e for r in live["race"]["rungs"] for e in r["entries"] if e["reached_steps"]]
    assert all(e["steps"] is None and e["reached_steps"] < e["target_steps"] for e in running)
    resp = stack["client"].post(f"/jobs/{jid}/cancel")
    assert resp.status_code in (200, 202), resp.text
    job = _wait(stack, jid, lambda j: j["status"] in FINISHED, timeout=60, what="the cancel")
    assert job["status"] == "cancelled", job
    statuses = [e["status"] for r in job["race"]["rungs"] for e in r["entries"]]
    assert "running" not in statuses and "cancelled" in statuses, statuses
    poll(lambda: trainer_processes(_race_dir(stack, jid)), lambda p: not p, timeout=30,
         what="the trainers to stop")  # fmt: skip


@pytest.mark.parametrize(
    "selection, field",
    [
        ({"shortlist": 1}, "shortlist"),
        ({"shortlist": "3"}, "shortlist"),
        ({"budget_epochs": 0}, "budget_epochs"),
        ({"budget_epochs": "2"}, "budget_epochs"),
        ({"validation_fraction": 1.0}, "validation_fraction"),
        ({"rungs": 3}, "rungs"),
        ({"budget_epochs": 0.01}, "budget_epochs"),  # less than a step for each candidate
    ],
)
def test_bad_selection_options_get_a_422_naming_the_field(stack, selection, field):
    body = {"dataset_id": stack["dataset"], "models": "all", "selection": selection}
    resp = stack["client"].post("/jobs", json=body)
    assert resp.status_code == 422, resp.text
    assert field in resp.text, resp.text


def test_a_race_needs_two_models(stack):
    body = {"dataset_id": stack["dataset"], "models": ["race-vit"], "selection": {}}
    resp = stack["client"].post("/jobs", json=body)
    assert resp.status_code == 422 and "at least 2 models" in resp.text, resp.text


def _cli(stack, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZOOPICK_")}
    env.update(ZOOPICK_URL=stack["url"], ZOOPICK_API_KEY=stack["key"], ZOOPICK_RETRIES="1")
    cmd = [str(Path(sys.executable).parent / "zoopick"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_the_cli_asks_for_a_race_and_shows_its_rungs(stack):
    models = "race-resnet,race-vit"
    bad = _cli(stack, "jobs", "submit", "--dataset", stack["dataset"], "--models", models,
               "--shortlist", "2", "--budget", "0.01")  # fmt: skip
    assert bad.returncode == 2 and "selection.budget_epochs" in bad.stderr, bad.stderr
    if "race_job" not in stack:
        pytest.skip("needs the race of the first test")
    shown = _cli(stack, "jobs", "results", stack["race_job"])
    assert shown.returncode == 0, shown.stderr
    assert "race" in shown.stdout and "val accuracy" in shown.stdout, shown.stdout
    assert "53 of 54 budget steps spent" in shown.stdout, shown.stdout


def test_the_dashboard_shows_the_race_and_asks_for_one(stack):
    import re

    from tests.service.procs import dashboard_client

    with dashboard_client(stack["url"], stack["key"]) as browser:
        form = browser.get("/submit")
        assert 'name="race"' in form.text and 'name="budget_epochs"' in form.text
        csrf = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
        fields = {"csrf": csrf, "dataset_id": stack["dataset"], "metrics": "logme"}
        fields.update(race="on", shortlist="2", budget_epochs="0.01")
        refused = browser.post("/submit", data=fields)
        assert refused.status_code == 422, refused.text
        assert "less than one step" in refused.text  # shown beside the budget field
        if "race_job" not in stack:
            pytest.skip("needs the race of the first test")
        page = browser.get(f"/jobs/{stack['race_job']}")
    assert page.status_code == 200
    job = _job(stack, stack["race_job"])
    assert 'id="race"' in page.text and "race: validation accuracy by steps trained" in page.text
    for rung in job["race"]["rungs"]:
        for e in rung["entries"]:
            row = f'data-rung="{rung["index"] + 1}" data-model="{e["model"]}"'
            assert row in page.text
    assert f"{job['race']['spent_steps']} of a budget of {job['race']['budget_steps']}" in page.text
    from markupsafe import escape

    assert str(escape(job["race"]["why"])) in page.text
