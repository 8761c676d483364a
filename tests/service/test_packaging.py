"""The service installed from a wheel (not an editable checkout) can still migrate its
database: the wheel carries the Alembic scripts (top-level ``migrations/``, shipped as
``app/migrations``) and every package of the source tree, and ``app.db.migrate`` run from the
unpacked wheel, away from the checkout, brings a fresh SQLite file to head with them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from app.db import migrate

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("app", "workers", "selection", "training", "migrations")


def build_wheel(tmp: Path) -> Path:
    """``pip wheel . --no-deps`` on a copy of the tree (keeps build/ out of the checkout;
    no build isolation: tests make no network calls)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
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


def test_wheel_ships_the_migrations_and_they_run_installed(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())

    scripts = ROOT / "migrations"
    expected = {
        "app/migrations/" + p.relative_to(scripts).as_posix()
        for p in scripts.rglob("*")
        if p.is_file() and p.suffix in (".py", ".mako") and "__pycache__" not in p.parts
    }
    assert {"app/migrations/env.py", "app/migrations/script.py.mako"} <= expected
    assert any(n.startswith("app/migrations/versions/") for n in expected)
    assert expected <= names, sorted(expected - names)

    # every package of the tree is in the wheel (pyproject lists them explicitly)
    packages = {
        p.parent.relative_to(ROOT).as_posix()
        for top in ("app", "workers", "selection", "training")
        for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    shipped = {n.rsplit("/", 1)[0] for n in names if n.endswith(".py")}
    assert packages <= shipped, sorted(packages - shipped)

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    db = tmp_path / "installed.db"
    code = (
        "from app.db import migrate; "
        "print(migrate.script_location()); "
        f"migrate.upgrade('sqlite:///{db}'); "
        f"print(sorted(migrate.current_heads('sqlite:///{db}')))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZOOPICK_")}
    env["PYTHONPATH"] = str(site)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    location, heads = done.stdout.strip().splitlines()[-2:]
    assert Path(location) == site / "app" / "migrations"  # the packaged copy, not the checkout
    assert heads == repr([migrate.head()])
