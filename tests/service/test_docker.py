"""The Docker deployment files (no Docker engine here): the compose file wires what the issue
asks for, and every ``zoopick`` command the images run parses against the real CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
import yaml

from zoopick.service_cli import service_app

DOCKER = Path(__file__).resolve().parents[2] / "docker"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def parses(argv: list[str]) -> None:
    """Resolve ``zoopick <argv>`` to its sub-command and parse its options (no run)."""
    assert argv[0] == "zoopick", argv
    group = typer.main.get_command(service_app)
    ctx = group.make_context("zoopick", list(argv[1:]), resilient_parsing=False)
    name, cmd, rest = group.resolve_command(ctx, list(argv[1:]))
    cmd.make_context(name, rest, parent=ctx)


def test_compose_services_and_dependencies(compose):
    services = compose["services"]
    assert {"postgres", "redis", "migrate", "api", "worker-cpu", "worker-gpu"} <= set(services)
    for name in ("postgres", "redis", "api", "worker-cpu", "worker-gpu"):
        assert "healthcheck" in services[name], name
        assert services[name]["restart"] == "unless-stopped", name  # back after a crash
    assert "restart" not in services["migrate"]  # one-shot: must not loop
    for name in ("api", "worker-cpu", "worker-gpu"):
        needs = services[name]["depends_on"]
        assert needs["migrate"]["condition"] == "service_completed_successfully"
        assert "data:/data" in services[name]["volumes"]  # uploads shared with the workers
    gpu = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    env = services["api"]["environment"]
    assert env["ZOOPICK_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert env["ZOOPICK_BROKER_URL"].startswith("redis://")


def test_compose_commands_parse(compose):
    for svc in compose["services"].values():
        cmd = svc.get("command")
        if cmd and cmd[0] == "zoopick":
            parses(cmd)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_images_run_as_non_root_and_their_command_parses(dockerfile):
    text = (DOCKER / dockerfile).read_text()
    assert re.search(r"^USER (?!root)\w+", text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    parses(cmd)


def test_worker_healthcheck_names_match_the_cli(compose):
    from zoopick.service.queue import worker_argv

    for name, queue in (("worker-cpu", "cpu"), ("worker-gpu", "gpu")):
        check = " ".join(compose["services"][name]["healthcheck"]["test"])
        node = worker_argv(queue, 1)[worker_argv(queue, 1).index("--hostname") + 1]
        assert node.replace("%h", "$$HOSTNAME") in check


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_images_copy_every_package_folder_and_install_the_pinned_set(dockerfile):
    """``pip install -e .`` needs every folder of pyproject's package-dir (the client was once
    left out), and the image installs what CI tested (constraints.txt)."""
    import tomllib

    root = DOCKER.parent
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    text = (DOCKER / dockerfile).read_text()
    copied = set(re.findall(r"^COPY (\S+) \./\1$", text, re.M))
    assert set(package_dir.values()) <= copied, set(package_dir.values()) - copied
    assert re.search(r"^COPY .*\bconstraints\.txt\b", text, re.M)
    assert "-c constraints.txt" in text


def test_the_ray_profile_is_a_head_and_gpu_workers_the_service_points_at(compose):
    services = compose["services"]
    head, worker = services["ray-head"], services["ray-worker"]
    assert head["profiles"] == worker["profiles"] == ["ray"]  # off unless asked for
    assert head["command"][:3] == ["ray", "start", "--head"]
    port = head["command"][head["command"].index("--port") + 1]
    joins = worker["command"][worker["command"].index("--address") + 1]
    assert joins == f"ray-head:{port}"
    assert "ray-head:" + port in services["api"]["environment"]["ZOOPICK_RAY_ADDRESS"]
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "data:/data" in worker["volumes"]  # checkpoints on the shared folder
    gpu_image = (DOCKER / "Dockerfile.gpu").read_text()
    assert '".[ray]"' in gpu_image  # the image the pool runs has Ray
