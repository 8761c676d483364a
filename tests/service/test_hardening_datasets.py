"""Hostile datasets through the real service (issue 10, items 1 and 3; issue 21, items 1-3):
uploads go through
uvicorn, a Celery cpu worker validates them (PostgreSQL + Redis), and each bomb ends
``invalid`` with an error naming the limit it broke, its files deleted, while the worker's
pool process stays far below the memory the file would have cost."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.bombs import MiB, many_classes_npz, npz_declaring, png_bytes, zip_bomb
from tests.hostile import Sizes, npz_ratio, tar_declaring_huge, zip_directory_flood
from tests.service import procs
from tests.service.test_api import API

PAD = {"a/0.png": png_bytes(8, 8), "b/0.png": png_bytes(8, 8), "b/1.png": png_bytes(8, 8)}


@pytest.fixture(scope="module")
def service(isolated_settings):
    settings = isolated_settings("hardening-datasets", upload_max_bytes=32 * MiB)
    token = procs.create_token(settings, "mallory")
    with procs.api_and_worker(settings, "cpu", token, prefix=API) as (http, worker):
        yield http, settings, worker


def pool_peak_rss(worker: procs.Proc) -> int:
    """Peak resident bytes (VmHWM) of the worker's pool children."""
    peak = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != worker.proc.pid:
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except (OSError, ValueError, IndexError):
            continue
    return peak


def validated(http, filename: str, data: bytes) -> dict:
    resp = http.post("/datasets", files={"file": (filename, data, "application/octet-stream")})
    assert resp.status_code == 202, resp.text
    ds_id = resp.json()["id"]
    return procs.poll(
        lambda: http.get(f"/datasets/{ds_id}").json(),
        lambda d: d["status"] in ("ready", "invalid"),
        timeout=90,
        what=f"validation of {filename}",
    )


@pytest.mark.parametrize(
    "filename, make, limit",
    [
        ("bomb.zip", lambda: zip_bomb([("a/bomb.png", 1024)], PAD), "max_member_bytes"),
        ("liar.zip", lambda: zip_bomb([("a/bomb.png", 1024)], PAD, declare=1000), "bomb.png"),
        ("ratio.zip", lambda: zip_bomb([("a/r.png", 16)], PAD), "max_compression_ratio"),
        ("pixels.zip", lambda: zip_bomb([], {"a/big.png": png_bytes(5000, 5000), **PAD}),
         "max_pixels"),
        ("huge.npz", lambda: npz_declaring((2, 23170, 23170)), "max_pixels"),
        ("long.npz", lambda: npz_declaring((5000, 4000, 4000)), "max_total_bytes"),
        ("classes.npz", lambda: many_classes_npz(200_000), "max_classes"),
        ("thin.npz", lambda: many_classes_npz(50, per_class=1), "min_per_class=2"),
        # issue 21: a header declaring 8 GiB before gzip members of zeros (1 GiB here); 250,000
        # zip directory records only (the end record claiming 2); float64 zeros in an npz
        ("huge.tar.gz", lambda: tar_declaring_huge(Sizes(bomb_mib=1)), "max_total_bytes"),
        ("records.zip", lambda: zip_directory_flood(Sizes(entries=250_000), declare=2),
         "max_members=200,000"),
        ("ratio.npz", lambda: npz_ratio(Sizes(images=600)), "max_compression_ratio"),
    ],
)  # fmt: skip
def test_hostile_upload_is_invalid_naming_the_limit(service, filename, make, limit):
    http, settings, worker = service
    data = make()
    assert len(data) < 16 * MiB
    ds = validated(http, filename, data)
    assert ds["status"] == "invalid", ds
    assert limit in ds["error"], ds["error"]
    assert "0x" not in ds["error"]
    kept = settings.storage_dir.glob(f"tenants/*/datasets/{ds['id']}/**/*")
    assert not [p for p in kept if p.is_file()]  # an invalid upload's file is gone
    assert worker.alive()
    assert pool_peak_rss(worker) < 600 * MiB


def test_a_fair_dataset_is_still_ready(service):
    from tests.service.datafiles import npz_bytes

    http, settings, worker = service
    ds = validated(http, "fair.npz", npz_bytes(n_per_class=3, classes=4))
    assert ds["status"] == "ready", ds
    assert ds["num_samples"] == 12
    # the worker made the dashboard's thumbnails while it held the dataset: a page view reads
    # them and never loads the dataset in the API process
    (folder,) = settings.storage_dir.glob(f"tenants/*/datasets/{ds['id']}/thumbs")
    index = json.loads((folder / "index.json").read_text())
    assert sorted(index) == sorted(ds["classes"]) and all(len(f) == 3 for f in index.values())
    assert all((folder / f).read_bytes()[:4] == b"\x89PNG" for fs in index.values() for f in fs)


def test_a_page_view_never_loads_a_dataset(tmp_path):
    from tests.service.datafiles import npz_bytes
    from zoopick.service.thumbnails import thumbnail, thumbnails

    stored = tmp_path / "upload.npz"  # a ready dataset from before thumbnails were made
    stored.write_bytes(npz_bytes(n_per_class=3, classes=2))
    folder = tmp_path / "thumbs"
    assert thumbnails(folder) == {} and thumbnail(folder, "0-0-0.png") is None
    assert list(tmp_path.iterdir()) == [stored]  # nothing loaded, nothing made
