"""Check the import-linter contracts of pyproject.toml: ``python -m tests.lint_imports``.

import-linter (grimp) finds a package's modules by walking its folder on disk, but in this
repository ``zoopick``'s sub-packages live in the top-level folders that setuptools'
``package-dir`` maps into it (an editable install resolves them with an import hook grimp does
not follow). So the check runs on the package as a wheel would lay it out: the mapped folders
are copied into a temporary ``zoopick/`` tree (a second or two), and ``lint-imports`` runs on
that with the repository's own contracts. Exit status: lint-imports' own (0 when every
contract is kept).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_tree(dest: Path, root: Path = ROOT) -> Path:
    """Lay out the ``zoopick`` package under ``dest`` as ``package-dir`` maps it; returns
    ``dest`` (put it on ``PYTHONPATH``)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = config["package-dir"]
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    # parents first, so a mapped sub-package lands inside its parent's copy
    for package in sorted(mapping, key=lambda name: name.count(".")):
        target = dest.joinpath(*package.split("."))
        shutil.copytree(root / mapping[package], target, ignore=skip, dirs_exist_ok=True)
    return dest


def module_names(root: Path = ROOT) -> list[str]:
    """Every module of the ``zoopick`` package, found through ``package-dir`` (walking
    ``zoopick.__path__`` would see only the root folder)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    names = set()
    for package, folder in config["package-dir"].items():
        for path in (root / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.add(".".join((package, *parts)))
    return sorted(names)


def lint(tree: Path, root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with ``root``'s pyproject contracts over the package in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"]
        + [str(root / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="zoopick-lint-") as tmp:
        done = lint(package_tree(Path(tmp)))
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
