"""The pipelines in docs/ci run as written: their exact command lines, in bash with the
shells' own error settings, against a live server (uvicorn, a Celery worker, PostgreSQL,
Redis); the gate with ``jq`` passes a good score and stops the pipeline on a bad one. The
commands come from the light ``zoopick-client`` distribution, put by the examples' own install
step into a virtualenv that has nothing else (``tests/service/lightclient.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.service import lightclient
from tests.service.datafiles import npz_bytes

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "docs" / "ci"


@pytest.fixture(scope="module")
def stack(live_server):
    return live_server.tenant("ci")


@pytest.fixture(scope="module")
def client_bin(light_client) -> Path:
    return light_client


def workdir(tmp_path: Path, stack, client_bin: Path) -> tuple[Path, dict[str, str]]:
    """A checkout with the dataset file, and the environment the CI system would give: the
    light client's virtualenv first on PATH, not the dev environment's."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.npz").write_bytes(npz_bytes(seed=4))
    env = lightclient.clean_env(f"{client_bin}{os.pathsep}{lightclient.system_path()}")
    env.update(
        ZOOPICK_URL=stack.url,
        ZOOPICK_API_KEY=stack.key,
        OMP_NUM_THREADS="1",
    )
    return tmp_path, env


def bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def github_steps() -> tuple[dict[str, str], list[str]]:
    job = yaml.safe_load((CI / "github-actions.yml").read_text())["jobs"]["pick"]
    steps = [s["run"] for s in job["steps"] if "run" in s and s.get("id") != "install"]
    return job["env"], steps


def run_github(
    cwd: Path, env: dict[str, str], min_score: str, first: int = 0
) -> subprocess.CompletedProcess:
    """Each ``run:`` step (from step ``first``) in its own bash, as GitHub runs them;
    ``$GITHUB_ENV`` lines become the next steps' environment."""
    job_env, steps = github_steps()
    steps = steps[first:]
    env = dict(env)
    for k, v in job_env.items():
        if "${{" not in str(v):  # secrets come from the test's environment
            env[k] = str(v)
    env.update(MIN_SCORE=min_score, EPOCHS="1", GITHUB_RUN_ID="77", GITHUB_RUN_ATTEMPT="1")
    github_env = cwd / "github.env"
    github_env.touch()
    env["GITHUB_ENV"] = str(github_env)
    done = None
    for script in steps:
        done = bash(script, cwd, env)
        if done.returncode != 0:
            return done
        for line in github_env.read_text().splitlines():
            key, _, value = line.partition("=")
            env[key] = value
    assert done is not None
    return done


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq not installed (apt-get install jq)")
def test_github_actions_pipeline(stack, tmp_path, client_bin):
    cwd, env = workdir(tmp_path, stack, client_bin)
    done = run_github(cwd, env, min_score="-1e9")
    assert done.returncode == 0, (done.stdout, done.stderr, stack.logs())
    import json

    job = json.loads((cwd / "job.json").read_text())
    assert job["status"] == "succeeded" and job["chosen_model"] in {"tiny-resnet", "tiny-vit"}
    assert [e["epoch"] for e in job["training"]["epochs"]] == [1]
    from safetensors.numpy import load_file

    assert load_file(str(cwd / "model.safetensors"))  # the fine-tuned weights, complete

    # the gate: a bar above the chosen model's score stops the pipeline before the download
    (cwd / "model.safetensors").unlink()
    chosen = next(r for r in job["ranking"] if r["model"] == job["chosen_model"])
    too_high = str(chosen["scores"][job["select_by"]] + 1.0)
    _, steps = github_steps()
    gate = next(i for i, s in enumerate(steps) if s.lstrip().startswith("jq -e"))
    done = run_github(cwd, env, min_score=too_high, first=gate)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert not (cwd / "model.safetensors").exists()


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq not installed (apt-get install jq)")
def test_gitlab_ci_pipeline(stack, tmp_path, client_bin):
    spec = yaml.safe_load((CI / "gitlab-ci.yml").read_text())["pick-model"]
    cwd, env = workdir(tmp_path, stack, client_bin)
    env.update({k: str(v) for k, v in spec["variables"].items()})
    env.update(MIN_SCORE="-1e9", EPOCHS="1", CI_PIPELINE_ID="5", CI_JOB_ID="9")
    done = bash("\n".join(spec["script"]), cwd, env)  # GitLab: one shell, set -eo pipefail
    assert done.returncode == 0, (done.stdout, done.stderr, stack.logs())
    from safetensors.numpy import load_file

    assert load_file(str(cwd / "model.safetensors"))
    assert "job.json" in spec["artifacts"]["paths"]


def test_the_light_client_is_installed_alone(client_bin, tmp_path):
    """The examples' install step gave a virtualenv with the client and its command, and
    neither zoopick's service, its libraries nor torch (nothing of the dev environment)."""
    python = str(client_bin / "python")
    code = (
        "import importlib.util as u, zoopick_client; "
        "print(zoopick_client.Client.__module__, zoopick_client.__file__); "
        "print([m for m in ('zoopick', 'torch', 'fastapi', 'sqlalchemy') if u.find_spec(m)])"
    )
    env = lightclient.clean_env(f"{client_bin}{os.pathsep}{lightclient.system_path()}")
    run = {"env": env, "cwd": tmp_path, "capture_output": True, "text": True}  # off the checkout
    done = subprocess.run([python, "-c", code], **run)
    assert done.returncode == 0, done.stderr
    where, missing = done.stdout.strip().splitlines()
    assert where.startswith("zoopick_client.http ") and str(client_bin.parent) in where
    assert missing == "[]"
    helptext = subprocess.run([str(client_bin / "zoopick-client"), "--help"], **run).stdout
    assert all(group in helptext for group in ("datasets", "jobs", "model", "zoo"))
    # its version is its own distribution's (client/pyproject.toml), zoopick not being there
    light = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    version = subprocess.run([str(client_bin / "zoopick-client"), "--version"], **run)
    assert (version.returncode, version.stdout) == (0, f"zoopick-client {light['version']}\n")
    # GitLab's job installs it with the same line
    spec = yaml.safe_load((CI / "gitlab-ci.yml").read_text())["pick-model"]
    assert lightclient.install_step() in spec["before_script"]
