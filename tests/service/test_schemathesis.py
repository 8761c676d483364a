"""A bounded schemathesis run against a real uvicorn on PostgreSQL + Redis, so the API stays
free of 5xx answers (issue 10: "keep schemathesis in CI, a bounded run").

Every operation of the OpenAPI document gets a few generated cases (``MAX_EXAMPLES``) with an
ordinary tenant's key; the only check is that no answer is a server error. The full probe
(thousands of cases) is for a release; this keeps the suite's run well under a minute.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.service import procs

MAX_EXAMPLES = 6


@pytest.fixture(scope="module")
def live_api(isolated_settings):
    cfg = isolated_settings("schemathesis", validate_inline=True, upload_max_bytes=1024 * 1024)
    token = procs.create_token(cfg, "fuzz")
    extra = {"ZOOPICK_RATE_UPLOADS": "100000/minute", "ZOOPICK_RATE_JOBS": "100000/minute"}
    api, base = procs.start_api(cfg, cfg.data_dir, extra)
    try:
        yield base, {"Authorization": f"Bearer {token}"}
    finally:
        api.stop()


@pytest.fixture(scope="module")
def api_schema(live_api):
    base, _ = live_api
    return schemathesis.openapi.from_url(f"{base}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_no_operation_answers_5xx(case, live_api):
    base, headers = live_api
    response = case.call(base_url=base, headers=headers, timeout=30)
    case.validate_response(response, checks=[not_a_server_error])
