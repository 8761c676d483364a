"""constraints.txt is the set CI tests: a fresh install with README's command resolves to it,
whatever the package index released since (pytest 9.2 once broke schemathesis' plugin the day
it came out). Two checks: every dependency pyproject names is pinned there, and this
environment holds exactly the pinned versions (so the suite never passes on a set nobody
pinned)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_EXTRAS = ("dev", "ray", "mlflow")  # what README's test command installs; bench is not
CUDA_STACK = ("nvidia-", "cuda-", "triton")
"""What only PyPI's CUDA build of torch brings: absent where PyTorch's CPU build is installed."""


def pins() -> dict[str, Version]:
    out: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line)
        assert match, f"constraints.txt: {line!r} is not NAME==VERSION"
        out[canonicalize_name(match[1])] = Version(match[2])
    return out


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in INSTALLED_EXTRAS:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    # the light client distribution (client/pyproject.toml) is tested with the same pins
    light = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    reqs += [Requirement(r) for r in light["dependencies"]]
    return [r for r in reqs if canonicalize_name(r.name) != "zoopick"]


def test_every_declared_dependency_is_pinned_inside_its_range():
    pinned = pins()
    for req in declared():
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pinned[name]} outside pyproject's {req}"
        )


def test_this_environment_is_the_pinned_set():
    wrong = {}
    for name, version in pins().items():
        try:
            found = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            if not name.startswith(CUDA_STACK):
                wrong[name] = "not installed"
            continue
        # PyTorch's CPU build is 2.13.0+cpu: the local label names the build, not the release
        if found.public != version.public:
            wrong[name] = str(found)
    assert not wrong, f"installed versions differ from constraints.txt: {wrong}"
