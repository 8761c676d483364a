"""The quick start shows what the service does by default (issue 22): the metric it
recommends (no ``--select-by isms``, which ties every demo model with ``sms``), the one
default density (``training.config.FinetuneOptions``, which the dashboard's form shows too),
and that it needs ``jq``; the CI examples leave the metric to the service as well."""

from __future__ import annotations

import re
from pathlib import Path

from zoopick.service.jobs import DEFAULT_SELECT_BY
from zoopick.training.config import FinetuneOptions

ROOT = Path(__file__).resolve().parents[1]


def quick_start() -> str:
    """The docs' quick start of the service (README's short one defers to it)."""
    return (ROOT / "docs" / "guide" / "quickstart.md").read_text()


def test_the_quick_start_uses_the_services_defaults():
    text = quick_start()
    assert "--select-by" not in text and '\\"select_by\\"' not in text
    assert f"`{DEFAULT_SELECT_BY}`, the default `select_by`" in text
    densities = re.findall(r'--density ([0-9.]+)|\\"density\\": ([0-9.]+)', text)
    assert len(densities) == 2  # the CLI and the curl example
    assert {float(a or b) for a, b in densities} == {FinetuneOptions().density}
    assert "`jq` reads the JSON\n(`apt-get install jq`)" in text


def test_the_ci_examples_leave_the_metric_to_the_service():
    for name in ("github-actions.yml", "gitlab-ci.yml"):
        example = (ROOT / "docs" / "ci" / name).read_text()
        assert "--select-by" not in example and "zoopick-client jobs submit" in example
