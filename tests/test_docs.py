"""The docs site and README stay whole: the settings reference (made by ``docs/hooks.py``)
lists every ``ZOOPICK_*`` variable with its default and what it does, and the committed page
is the one the code makes today; README keeps its two set-up commands, and its test command
(which builds the site strictly: a broken link fails it) is the one ``.ci/run`` runs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from zoopick.service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
SERVE_COMMAND = "pip install -e . -c constraints.txt && zoopick serve"


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_test_command() -> str:
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines() if "python -m pytest" in ln]
    assert len(lines) == 1, lines
    return lines[0].strip()


def test_the_settings_reference_has_every_variable_its_default_and_what_it_does():
    page = hooks().settings_reference()
    row = re.compile(r"^\| `(ZOOPICK_\w+)` \| `(.+?)` \| (.+) \|$")
    rows = {m[1]: (m[2], m[3]) for m in map(row.match, page.splitlines()) if m}
    for name, field in Settings.model_fields.items():
        default, what = rows.pop(f"ZOOPICK_{name.upper()}")  # KeyError: a setting it lacks
        assert default.strip(), f"{name}: no default shown"
        assert field.description, f"{name}: no description (the reference would say nothing)"
        assert " ".join(field.description.split())[:40] in what, name
    assert not rows, f"the page names settings that do not exist: {sorted(rows)}"


def test_the_committed_settings_page_is_current():
    made = hooks()
    committed = (ROOT / "docs" / made.SETTINGS_PAGE).read_text()
    assert committed == made.settings_reference(), "run: python docs/hooks.py"


def test_defaults_read_as_they_are_typed():
    page = hooks().settings_reference()
    assert "| `ZOOPICK_UPLOAD_MAX_BYTES` | `2_147_483_648` |" in page
    assert "| `ZOOPICK_TRAIN_BACKEND` | `local` |" in page
    assert "| `ZOOPICK_METRICS_PUBLIC` | `false` |" in page
    assert '| `ZOOPICK_REDIS_KEY_PREFIX` | `""` |' in page


def test_readme_keeps_its_set_up_commands_and_ci_runs_its_test_command():
    readme = (ROOT / "README.md").read_text()
    assert SERVE_COMMAND in readme
    command = readme_test_command()
    assert "mkdocs build --strict" in command and "ruff check ." in command
    ci = (ROOT / ".ci" / "run").read_text().rstrip().splitlines()
    assert ci[-1] == command  # .ci/run runs README's test command verbatim
