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
    gpu = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    env = services["api"]["environment"]
    assert env["ZOOPICK_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert env["ZOOPICK_BROKER_URL"].startswith("redis://")


def volumes_of(service: dict) -> dict[str, str]:
    """``{mount point: volume}`` of a service's named volumes."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def test_compose_keeps_files_in_its_s3_store_and_shares_no_folder(compose):
    """Issue 40: the API and the workers reach one S3 store (the bundled SeaweedFS, its bucket
    made by a one-shot ``zoopick storage init`` before any of them starts) with the same
    settings, and none of them shares a volume with another, the Ray nodes included (a Ray
    run's workers fetch its files from the store)."""
    services = compose["services"]
    store, init = services["store"], services["storage-init"]
    assert store["command"][:2] == ["server", "-s3"]
    port = next(a.split("=")[1] for a in store["command"] if a.startswith("-s3.port="))
    config = next(a.split("=")[1] for a in store["command"] if a.startswith("-s3.config="))
    assert "restart" not in init  # one-shot: must not loop
    assert init["command"][:3] == ["zoopick", "storage", "init"]
    assert init["depends_on"]["store"]["condition"] == "service_healthy"
    assert port in " ".join(store["healthcheck"]["test"])

    identities = compose["configs"][store["configs"][0]["source"]]["content"]
    assert store["configs"][0]["target"] == config
    users = json.loads(
        identities.replace("${S3_ACCESS_KEY:-zoopick}", "KEY").replace(
            "${S3_SECRET_KEY:-zoopick-store-secret}", "SECRET"
        )
    )["identities"]
    assert users[0]["credentials"] == [{"accessKey": "KEY", "secretKey": "SECRET"}]
    assert "Admin" in users[0]["actions"]  # storage-init makes the bucket

    clients = ("storage-init", "api", "worker-cpu", "worker-gpu")
    for name in clients:
        env = services[name]["environment"]
        assert env["ZOOPICK_STORAGE_URL"].endswith("s3://zoopick/store}"), name
        assert env["AWS_ENDPOINT_URL"] == f"${{S3_ENDPOINT-http://store:{port}}}", name
        # the clients' credentials are the store's identity's
        assert env["AWS_ACCESS_KEY_ID"] == "${S3_ACCESS_KEY:-zoopick}", name
        assert env["AWS_SECRET_ACCESS_KEY"] == "${S3_SECRET_KEY:-zoopick-store-secret}", name
        assert env["AWS_REGION"], name
    for name in clients[1:]:
        needs = services[name]["depends_on"]["storage-init"]
        assert needs["condition"] == "service_completed_successfully", name

    owners: dict[str, set[str]] = {}
    for name, svc in services.items():
        for volume in volumes_of(svc).values():
            owners.setdefault(volume, set()).add(name)
    shared = {volume: names for volume, names in owners.items() if len(names) > 1}
    assert shared == {}, shared  # not even with the Ray nodes: they fetch from the store
    assert all(volumes_of(services[name]) for name in clients[1:])  # scratch and caches kept
    for volume in owners:
        assert volume in compose["volumes"], volume


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
    # no volume of the gpu worker's: a node's /data is its image's own (its scratch and cache)
    assert not volumes_of(worker) and not volumes_of(head)
    gpu_dockerfile = (DOCKER / "Dockerfile.gpu").read_text()
    assert "ZOOPICK_DATA_DIR=/data" in gpu_dockerfile and 'VOLUME ["/data"]' in gpu_dockerfile
    gpu_image = (DOCKER / "Dockerfile.gpu").read_text()
    assert '".[ray]"' in gpu_image  # the image the pool runs has Ray
