"""The light client's release workflow (.github/workflows/release-client.yml): a version tag
builds the zoopick-client wheel and attaches it to the tag's release. GitHub's runner is not
here, so the checks run the workflow's own shell steps that need no network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "release-client.yml"


def _steps() -> dict[str, dict]:
    doc = yaml.safe_load(WORKFLOW.read_text())
    assert doc[True] == {"push": {"tags": ["v*"]}}  # YAML reads the key `on` as True
    return {s.get("name", s.get("uses")): s for s in doc["jobs"]["wheel"]["steps"]}


def _run_step(step: dict, tag: str) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"  # `python` is this interpreter
    return subprocess.run(["bash", "-ec", step["run"]], cwd=ROOT, capture_output=True, text=True,
                          env={"GITHUB_REF_NAME": tag, "PATH": path})  # fmt: skip


def test_a_tag_must_be_the_clients_version():
    import tomllib

    version = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]["version"]
    check = _steps()["The tag is the client's version"]
    assert _run_step(check, f"v{version}").returncode == 0
    wrong = _run_step(check, "v999.0.0")
    assert wrong.returncode == 1 and f"is not v{version}" in wrong.stdout


def test_it_builds_the_client_and_uploads_its_wheel():
    steps = _steps()
    assert steps["Build the wheel"]["run"].strip() == (
        "python -m pip wheel ./client --no-deps -w dist"
    )
    upload = steps["Attach it to the release"]
    assert "dist/zoopick_client-*.whl" in upload["run"]  # the wheel's name (lightclient.py)
    assert "OWNER" not in WORKFLOW.read_text()
