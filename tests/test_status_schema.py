"""One home per status: each status the API lists (a response field's ``Literal``, a list's
``?status=`` query pattern) is read from the one enum or tuple that the service writes, so
a status added there appears in the API's schema and is accepted by its filters, with no
copy to keep in step."""

from __future__ import annotations

import re

import pytest
from fastapi.openapi.utils import get_openapi

from zoopick.app.api import datasets, jobs
from zoopick.app.api.schemas import DatasetOut, JobSummary, MlflowOut, pattern_of
from zoopick.service import tracking
from zoopick.service.db.models import DatasetStatus, JobStatus


def _enum(model, field: str = "status") -> list[str]:
    return model.model_json_schema()["properties"][field]["enum"]


def test_response_statuses_are_the_services_own():
    assert _enum(DatasetOut) == [s.value for s in DatasetStatus]
    assert _enum(JobSummary) == [s.value for s in JobStatus]
    assert _enum(MlflowOut) == list(tracking.STATUSES)
    assert set(tracking.STATUSES) == {
        tracking.PENDING, tracking.LOGGING, tracking.LOGGED, tracking.FAILED
    }  # fmt: skip


def _status_query(router, path: str) -> str:
    """The ``pattern`` of ``GET path``'s ``status`` query parameter in the router's OpenAPI."""
    spec = get_openapi(title="t", version="0", routes=router.routes)
    params = spec["paths"][path]["get"]["parameters"]
    [status] = [p for p in params if p["name"] == "status"]
    return next(s["pattern"] for s in status["schema"]["anyOf"] if "pattern" in s)


@pytest.mark.parametrize(
    ("router", "path", "enum"),
    [(jobs.router, "/jobs", JobStatus), (datasets.router, "/datasets", DatasetStatus)],
    ids=["jobs", "datasets"],
)
def test_list_filters_accept_exactly_the_enums_values(router, path, enum):
    pattern = _status_query(router, path)
    assert pattern == pattern_of(enum)
    for status in enum:
        assert re.fullmatch(pattern, status.value)
    for wrong in ("", "x", f"{next(iter(enum)).value}x", f"{next(iter(enum)).value}|x"):
        assert not re.fullmatch(pattern, wrong), wrong


def test_download_formats_are_the_exports_own():
    """The model download's ``format`` (API and run page) is ``exports.FORMATS``."""
    from zoopick.app.dashboard import pages
    from zoopick.service import exports

    spec = get_openapi(title="t", version="0", routes=jobs.router.routes)
    params = spec["paths"]["/jobs/{job_id}/model"]["get"]["parameters"]
    [fmt] = [p for p in params if p["name"] == "format"]
    assert fmt["schema"]["enum"] == list(exports.FORMATS)
    assert list(pages.FORMATS) == list(exports.FORMATS)
