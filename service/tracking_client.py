"""The MLflow side of ``zoopick.service.tracking``: one :class:`~zoopick.service.tracking.
RunRecord` written to the tracking server with ``MlflowClient`` (``mlflow-skinny``, imported
here only, when a job is logged).

Bounded: every request waits at most ``mlflow_timeout_seconds`` and is retried once
(MLflow's own default is 7 retries over minutes), and the whole try stops between requests
once it passed ``tracking.deadline_seconds`` (plus a second per MiB of model to upload); a
server that is down fails at once.
Idempotent: the run is found by its ``zoopick.job_id`` tag; a run already ended is left as it
is, and a run a lost try left open is completed (every point carries its timestamp from the
database, so logging it again adds nothing new).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from zoopick.service.settings import Settings
from zoopick.service.tracking import JOB_TAG, Logged, RunRecord, deadline_seconds

BATCH = 1000  # MLflow's most metrics per log_batch (and entities in all)
PARAMS_TAGS = 100  # its most params, and tags, per log_batch
UPLOAD_BYTES_PER_SECOND = 1024**2
"""The slowest upload of the model a try allows for before its deadline (the deadline is for
a server that hangs, not for a big model on a slow link)."""


class TrackingError(Exception):
    """Logging a job failed; the message is what the job shows (plain, no class names)."""


def public_uri(uri: str) -> str:
    """The tracking URI without credentials (``https://user:token@host`` -> ``https://host``):
    what messages and the job may show."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        netloc = f"{host}:{parts.port}" if parts.port else host
        parts = parts._replace(netloc=netloc)
    return urlunsplit(parts)


def run_url(uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI, for an http(s) tracking server."""
    if not uri.startswith(("http://", "https://")):
        return None
    return f"{public_uri(uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def describe(exc: BaseException, settings: Settings) -> str:
    """Why logging failed, as a sentence: what was tried and what the server said."""
    where = f"the MLflow tracking server at {public_uri(settings.mlflow_tracking_uri or '')}"
    text = str(exc)
    if isinstance(exc, TrackingError):
        return f"{where}: {text}"
    if "Connection refused" in text or "Failed to establish a new connection" in text:
        return f"{where} did not answer (connection refused)"
    if "timed out" in text.lower():
        return f"{where} did not answer within {settings.mlflow_timeout_seconds:g} s"
    if "Name or service not known" in text or "nodename nor servname" in text:
        return f"{where} does not resolve"
    message = getattr(exc, "message", None) or text
    message = re.sub(r"\s+", " ", str(message)).strip()[:500]
    return f"{where} refused the run: {message}"


@contextmanager
def _bounded(settings: Settings) -> Iterator[None]:
    """MLflow reads its HTTP timeout and retries from the environment at each request: set
    ours for the duration of one try."""
    ours = {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(settings.mlflow_timeout_seconds))),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # a worker's log is no notebook
    }
    saved = {k: os.environ.get(k) for k in ours}
    os.environ.update(ours)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def extend(self, seconds: float) -> None:
        self.seconds += seconds
        self.end += seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise TrackingError(f"logging took longer than {self.seconds:.0f} s; stopped")


def log(record: RunRecord, settings: Settings) -> Logged:
    """Write ``record`` as the job's run (found or created); returns where it is."""
    uri = settings.mlflow_tracking_uri
    if not uri:
        raise TrackingError("no tracking server is configured (ZOOPICK_MLFLOW_TRACKING_URI)")
    deadline = _Deadline(deadline_seconds(settings))
    with _bounded(settings):
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        experiment_id = _experiment(client, record.experiment)
        deadline.check()
        run = _find(client, experiment_id, record.job_id)
        if run is not None and run.info.status != "RUNNING":  # an earlier try finished it
            return Logged(run.info.run_id, experiment_id, run_url(uri, experiment_id,
                                                                  run.info.run_id))  # fmt: skip
        if run is None:
            # the run's user (RunInfo.user_id, MLflow's "User" column) is read from the
            # mlflow.user tag when the run is created: set later, it is only a tag
            user = {k: v for k, v in record.tags.items() if k == "mlflow.user"}
            run = client.create_run(
                experiment_id,
                start_time=record.start_ms,
                tags={JOB_TAG: record.job_id, **user},
                run_name=record.job_id,
            )
        run_id = run.info.run_id
        for batch in _batches(record):
            deadline.check()
            client.log_batch(run_id, **batch)
        if record.dataset is not None:
            deadline.check()
            _log_dataset(client, run_id, record)
        deadline.extend(sum(Path(p).stat().st_size for p, _ in record.artifacts)
                        / UPLOAD_BYTES_PER_SECOND)  # fmt: skip
        for path, folder in record.artifacts:
            deadline.check()
            client.log_artifact(run_id, path, folder)
        with tempfile.TemporaryDirectory(prefix="zoopick-mlflow-") as tmp:
            for name, document in record.documents.items():
                deadline.check()
                file = Path(tmp) / Path(name).name
                file.write_text(_json(document))
                client.log_artifact(run_id, str(file), str(Path(name).parent))
        deadline.check()
        client.set_terminated(run_id, status=record.status, end_time=record.end_ms)
    return Logged(run_id, experiment_id, run_url(uri, experiment_id, run_id))


def _json(document: Any) -> str:
    import json

    return json.dumps(document, indent=2, sort_keys=True, default=str)


def _experiment(client: Any, name: str) -> str:
    """The experiment's id, made on first use (two workers making it at once: both get it)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name)
        except MlflowException:
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if found.lifecycle_stage != "active":
        raise TrackingError(
            f"its experiment {name!r} is deleted: restore it or set ZOOPICK_MLFLOW_EXPERIMENT"
        )
    return found.experiment_id


def _find(client: Any, experiment_id: str, job_id: str) -> Any:
    """The job's run, if a try made one."""
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'", max_results=1
    )
    return runs[0] if runs else None


def _batches(record: RunRecord) -> Iterator[dict[str, list[Any]]]:
    """Tags, params and metrics within MLflow's per-request limits."""
    from mlflow.entities import Metric, Param, RunTag

    tags = [RunTag(k, v) for k, v in record.tags.items()]
    params = [Param(k, v) for k, v in record.params.items()]
    metrics = [Metric(p.key, p.value, p.timestamp, p.step) for p in record.metrics]
    while tags or params:
        yield {"tags": tags[:PARAMS_TAGS], "params": params[:PARAMS_TAGS], "metrics": []}
        tags, params = tags[PARAMS_TAGS:], params[PARAMS_TAGS:]
    for start in range(0, len(metrics), BATCH):
        yield {"metrics": metrics[start : start + BATCH], "params": [], "tags": []}


def _log_dataset(client: Any, run_id: str, record: RunRecord) -> None:
    from mlflow.entities import Dataset, DatasetInput, InputTag

    ds = record.dataset
    entity = Dataset(
        name=ds.name, digest=ds.digest, source_type="zoopick", source=ds.source,
        profile=ds.profile,
    )  # fmt: skip
    client.log_inputs(
        run_id, datasets=[DatasetInput(entity, tags=[InputTag("mlflow.data.context", "training")])]
    )
