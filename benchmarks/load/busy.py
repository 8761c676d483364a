"""Keep ``zoopick serve``'s local worker busy with real work while the load is measured.

What a client polls is a job that runs: with the local worker, that job's scoring and
fine-tune run on the API's own cores. :class:`BusyWorker` keeps one job of the demo zoo (three
tiny timm models built on the spot, no download) running in the worker for as long as it is
started: scored, then fine-tuned for many epochs, and submitted again whenever it finishes.
The load generator polls another job (the same one in every configuration), so the
configurations differ only in what the worker does.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

FINETUNE = {"epochs": 100, "workers": 1}
"""Long enough to outlast a measurement (the demo's epochs take a fraction of a second)."""
ACTIVE = ("queued", "scoring", "racing", "training")


def demo_zoo(folder: Path) -> tuple[Path, Path]:
    """(zoo manifest, target dataset) of the demo, built once into ``folder`` (about 15 s of
    CPU: its models are briefly pretrained here)."""
    manifest, target = folder / "zoo.json", folder / "target.npz"
    if not (manifest.exists() and target.exists()):
        from zoopick.selection.demo import build_demo

        manifest, target = map(Path, build_demo(folder))
    return manifest, target


def demo_models(manifest: Path) -> list[str]:
    import json

    return [m["id"] for m in json.loads(manifest.read_text())["models"]]


class BusyWorker:
    """One demo job at a time in the local worker of the server at ``base`` (its API
    ``/api/v1``), polled once a second from a thread (a second request a second, beside the
    hundreds measured)."""

    def __init__(self, base: str, token: str, target: Path, models: list[str]) -> None:
        self.client = httpx.Client(
            base_url=f"{base}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        self.target, self.models = target, models
        self.dataset_id: str | None = None
        self.job_id: str | None = None
        self.jobs: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ensure_dataset(self, timeout: float = 120) -> str:
        """The demo dataset, uploaded and validated by the worker (once per database)."""
        if self.dataset_id is None:
            with self.target.open("rb") as f:
                up = self.client.post("/datasets", files={"file": (self.target.name, f)})
            up.raise_for_status()
            self.dataset_id = up.json()["id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.client.get(f"/datasets/{self.dataset_id}").json()["status"]
            if status == "ready":
                return self.dataset_id
            if status == "invalid":
                raise RuntimeError("the demo dataset was refused")
            time.sleep(0.5)
        raise TimeoutError("the demo dataset was not validated in time")

    def _submit(self) -> None:
        body = {"dataset_id": self.dataset_id, "models": self.models, "finetune": FINETUNE}
        got = self.client.post("/jobs", json=body)
        got.raise_for_status()
        self.job_id = got.json()["id"]
        self.jobs.append({"id": self.job_id, "submitted": time.time()})

    def status(self) -> str:
        return self.client.get(f"/jobs/{self.job_id}").json()["status"]

    def start(self, timeout: float = 120) -> None:
        """Submit a job and return once the worker runs it (scoring or training)."""
        self.ensure_dataset()
        self._stop.clear()
        self._submit()
        deadline = time.monotonic() + timeout
        while self.status() not in ("scoring", "training"):
            if time.monotonic() > deadline:
                raise TimeoutError("the local worker did not start the demo job")
            time.sleep(0.3)
        self._thread = threading.Thread(target=self._loop, name="busy-worker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                status = self.status()
                if status not in ACTIVE:  # finished: the worker must stay busy
                    self.jobs[-1]["ended"] = status
                    self._submit()
            except httpx.HTTPError:
                continue

    def stop(self, timeout: float = 60) -> None:
        """Cancel the running job and wait until it has settled, so the worker is idle for
        whatever is measured next."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.job_id is None:
            return
        self.client.post(f"/jobs/{self.job_id}/cancel")
        deadline = time.monotonic() + timeout
        while self.status() in ACTIVE and time.monotonic() < deadline:
            time.sleep(0.3)
        self.jobs[-1]["ended"] = self.status()
