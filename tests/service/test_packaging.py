"""The installed distribution: one import package, ``zoopick``, that works away from the
checkout.

The wheel is built from a copy of the tree and installed into a fresh virtualenv whose
dependencies are the running interpreter's own (its site-packages folders are added by a
``.pth`` file, not by ``--system-site-packages``: in a user's virtualenv the base interpreter
is a bare system Python; ``--no-deps``, no network). From a folder outside the checkout: the
only new top-level import name is ``zoopick`` (plus the ``zoopick`` console script),
``zoopick --help`` and ``python -m zoopick.training.launch --help`` run, and the packaged
Alembic scripts migrate a fresh SQLite file to head. Every package of the tree is in the wheel
(pyproject lists them explicitly)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from zoopick.service.db import migrate

ROOT = Path(__file__).resolve().parents[2]
# repository folder -> where it lands in the package
FOLDERS = {
    "zoopick": "zoopick",
    "app": "zoopick/app",
    "client": "zoopick/client",
    "workers": "zoopick/workers",
    "service": "zoopick/service",
    "selection": "zoopick/selection",
    "training": "zoopick/training",
    "migrations": "zoopick/service/migrations",
}


def build_wheel(tmp: Path) -> Path:
    """``pip wheel . --no-deps`` on a copy of the tree (keeps build/ out of the checkout;
    no build isolation: tests make no network calls)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in FOLDERS:
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    out = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
        + ["--no-index", "-q", "-w", str(out)],
        check=True,
        cwd=tmp,
        timeout=240,
    )
    (wheel,) = out.glob("zoopick-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_one_package_with_every_module_and_the_migrations(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith((".dist-info", ".data"))} == {"zoopick"}

    expected = set()
    for folder, target in FOLDERS.items():
        for p in (ROOT / folder).rglob("*"):
            shipped = (".py", ".mako", ".html", ".css", ".js")  # the dashboard's files too
            if p.is_file() and p.suffix in shipped and "__pycache__" not in p.parts:
                expected.add(f"{target}/{p.relative_to(ROOT / folder).as_posix()}")
    assert "zoopick/service/migrations/env.py" in expected
    assert any(n.startswith("zoopick/service/migrations/versions/") for n in expected)
    assert "zoopick/app/dashboard/templates/base.html" in expected
    assert "zoopick/app/dashboard/static/app.js" in expected
    assert expected <= names, sorted(expected - names)


def _venv_site(venv: Path) -> Path:
    purelib = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    return Path(purelib)


def _dependency_folders() -> list[str]:
    """The site-packages folders the running interpreter imports from (a virtualenv's, and
    its base's where it sees them). Lines of a ``.pth`` file are put on ``sys.path`` as they
    are, and the ``.pth`` files inside them are not run: the checkout's editable install stays
    out of the new venv."""
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]


def test_installed_wheel_adds_only_zoopick_and_runs_away_from_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    site = _venv_site(venv)
    (site / "_test_dependencies.pth").write_text("\n".join(_dependency_folders()) + "\n")
    before = set(os.listdir(site))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install"]
        + ["--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        timeout=240,
    )
    added = set(os.listdir(site)) - before
    assert {a for a in added if not a.endswith(".dist-info")} == {"zoopick"}, added
    assert (venv / "bin" / "zoopick").is_file()

    away = tmp_path / "elsewhere"  # no repository folder is importable from here
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZOOPICK_", "PYTHON"))}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"

    def run(*cmd: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            list(cmd), cwd=away, env=env, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, done.stderr
        return done

    python = str(venv / "bin" / "python")
    where = run(python, "-c", "import zoopick; print(zoopick.__file__)").stdout.strip()
    assert Path(where).is_relative_to(site)  # the installed copy, not the checkout
    helptext = run(str(venv / "bin" / "zoopick"), "--help").stdout
    assert "score" in helptext and "jobs" in helptext  # the client's commands too
    assert "--config" in run(python, "-m", "zoopick.training.launch", "--help").stdout

    db = tmp_path / "installed.db"
    code = (
        "from zoopick.service.db import migrate; "
        "print(migrate.script_location()); "
        f"migrate.upgrade('sqlite:///{db}'); "
        f"print(sorted(migrate.current_heads('sqlite:///{db}')))"
    )
    location, heads = run(python, "-c", code).stdout.strip().splitlines()[-2:]
    assert Path(location) == site / "zoopick" / "service" / "migrations"
    assert heads == repr([migrate.head()])
    assert not (away / ".zoopick").exists()


def test_the_light_client_wheel_shares_no_file_or_command_with_zoopick(wheel, tmp_path):
    """``zoopick-client`` (built from client/) ships the same client as the top-level
    ``zoopick_client`` and the ``zoopick-client`` command: no path of its wheel is one of
    zoopick's, so pip installs and removes either without breaking the other."""
    from tests.service.lightclient import build_wheel

    light = build_wheel(tmp_path)
    files = {n for n in zipfile.ZipFile(light).namelist() if ".dist-info/" not in n}
    assert {n.split("/", 1)[0] for n in files} == {"zoopick_client"}
    assert {n.split("/", 1)[1] for n in files} == {
        p.name for p in (ROOT / "client").glob("*.py")
    }  # every module of client/, one copy of the code
    assert not files & set(zipfile.ZipFile(wheel).namelist())
    meta = zipfile.ZipFile(light).read("zoopick_client-0.1.0.dist-info/entry_points.txt")
    assert "zoopick-client = zoopick_client.main:main" in meta.decode()
    main_scripts = zipfile.ZipFile(wheel).read("zoopick-0.1.0.dist-info/entry_points.txt")
    assert "zoopick = " in main_scripts.decode() and "zoopick-client" not in main_scripts.decode()
    requires = [
        line.split(":", 1)[1].strip()
        for line in zipfile.ZipFile(light)
        .read("zoopick_client-0.1.0.dist-info/METADATA")
        .decode()
        .splitlines()
        if line.startswith("Requires-Dist:")
    ]
    assert sorted(r.split(">")[0] for r in requires) == ["httpx", "rich", "typer"]  # no torch
