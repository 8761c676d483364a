"""The light ``zoopick-client`` distribution as a user outside this repository gets it: its
wheel built from ``client/`` (client/pyproject.toml), installed by the CI example's own
install step (``pip install "$CLIENT_PACKAGE"``, the wheel's path in place of the pinned git
URL) into a fresh virtualenv that has nothing else: no ``zoopick``, no torch, not the dev
environment's packages (``python -m venv`` without system site-packages; the running
interpreter's pip installs into it with ``PIP_PYTHON``, resolving the client's dependencies
from the package index, pinned by constraints.txt, from pip's cache where it can).

Resolving from the index takes tens of seconds that are mostly network waits, so the build
runs in a background process (``python -m tests.service.lightclient DEST``) started as soon
as pytest has collected a test that needs it (``tests/service/conftest.py``), while the
tests before it run; the fixture waits for what is left.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
GITHUB = ROOT / "docs" / "ci" / "github-actions.yml"
INSTALL_STEP_ID = "install"
TIMEOUT = 400


def install_step() -> str:
    """The GitHub example's install step, as written."""
    job = yaml.safe_load(GITHUB.read_text())["jobs"]["pick"]
    (step,) = [s for s in job["steps"] if s.get("id") == INSTALL_STEP_ID]
    return step["run"]


def clean_env(path: str) -> dict[str, str]:
    """The environment of a process outside the checkout: no ``ZOOPICK_*`` or ``PYTHON*``
    settings (no PYTHONPATH into the repository), and ``path`` as PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZOOPICK_", "PYTHON"))}
    env["PATH"] = path
    return env


def system_path() -> str:
    """PATH without the dev virtualenv's bin folder."""
    dev = str(Path(sys.executable).parent)
    return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != dev)


def build_wheel(dest: Path) -> Path:
    """The ``zoopick-client`` wheel, built from a copy of ``client/`` (no build/ folder left
    in the checkout; no build isolation, no network)."""
    src = dest / "src" / "client"
    shutil.copytree(ROOT / "client", src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = dest / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
        + ["--no-index", "-q", "-w", str(wheels)],
        check=True,
        timeout=TIMEOUT,
    )
    (wheel,) = wheels.glob("zoopick_client-*.whl")
    return wheel


def build(dest: Path) -> None:
    """Wheel, virtualenv and the install step under ``dest`` (``dest/venv/bin`` then holds
    ``zoopick-client``); raises CalledProcessError with pip's output on failure."""
    wheel = build_wheel(dest)
    venv = dest / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # `pip` of the step is the running interpreter's pip, installing into the new venv
    shim = dest / "pip-bin"
    shim.mkdir()
    (shim / "pip").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pip "$@"\n')
    (shim / "pip").chmod(0o755)
    env = clean_env(os.pathsep.join([str(shim), str(venv / "bin"), system_path()]))
    env.update(
        CLIENT_PACKAGE=str(wheel),
        PIP_PYTHON=str(venv / "bin" / "python"),
        PIP_CONSTRAINT=str(ROOT / "constraints.txt"),
        PIP_QUIET="1",
    )
    subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", install_step()],
        cwd=dest,
        env=env,
        check=True,
        timeout=TIMEOUT,
    )


if __name__ == "__main__":
    build(Path(sys.argv[1]))
