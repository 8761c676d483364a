"""MkDocs hooks (``mkdocs.yml``'s ``hooks``) for the docs site, and the settings page's maker.

- ``operations/settings.md``, the settings reference, is made from
  ``zoopick.service.settings.Settings`` itself: every ``ZOOPICK_*`` variable with its default and
  its field's description. ``python docs/hooks.py`` writes it; ``tests/test_docs.py`` fails
  when the committed page is not what the code makes (a setting added, changed or described
  anew), so it is read on GitHub as on the site.
- The benchmarks' own READMEs and results (``benchmarks/**/*.md`` and the figures beside them)
  join the site where they live in the repository, so the docs link to the files the
  benchmarks write, never to a copy. The pages link to them as files of the repository
  (``../benchmarks/results/transfer.md``, which GitHub follows); the site rewrites such a link
  to the page it made of that file.
"""

from __future__ import annotations

import enum
import json
import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_PAGE = "operations/settings.md"
BENCHMARK_SUFFIXES = (".md", ".png", ".svg")

INTRO = """# Settings reference

Every setting is an environment variable, read by the API, the workers and the command line
alike (`zoopick.service.settings.Settings`); `zoopick serve` hands its own to the workers it
starts. Set the same values on every machine of a deployment. Sizes are in bytes, durations in
seconds; a list or a mapping is given as JSON (`ZOOPICK_WEBHOOK_ALLOW_NETWORKS='["10.0.0.0/8"]'`),
a boolean as `true` or `false`. An empty value counts as unset where the default is "none".

This page is made from the code (`python docs/hooks.py` writes it; a test fails when it is out of
date).

| variable | default | what it does |
|---|---|---|
"""


def default_text(field: Any) -> str:
    """A field's default as a reader would type it (or "none": computed, or unset)."""
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is None:
        return "none"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        return json.dumps(value)
    if isinstance(value, int) and value >= 100_000:
        return f"{value:,}".replace(",", "_")  # 1_073_741_824: as Python (and pydantic) read it
    if value == "":
        return '""'
    return str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def settings_reference() -> str:
    """The settings page: one row per ``Settings`` field, in the class's order."""
    from zoopick.service.settings import Settings

    rows = []
    for name, field in Settings.model_fields.items():
        rows.append(
            f"| `ZOOPICK_{name.upper()}` | `{_cell(default_text(field))}` "
            f"| {_cell(field.description or '')} |"
        )
    return INTRO + "\n".join(rows) + "\n"


LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path in sorted((ROOT / "benchmarks").rglob("*")):
        if path.suffix in BENCHMARK_SUFFIXES and path.is_file():
            uri = path.relative_to(ROOT).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def site_link(page_uri: str, target: str) -> str:
    """``target`` as linked from the docs page ``page_uri``: a link out of ``docs/`` to a file
    under ``benchmarks/`` becomes the link to the site's page of that file; others stay."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return target
    here = posixpath.dirname(page_uri)
    resolved = posixpath.normpath(posixpath.join("docs", here, target))
    if not resolved.startswith("benchmarks/") or not (ROOT / resolved).is_file():
        return target
    return posixpath.relpath(resolved, here or ".")  # the site's page of it, from this page


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    uri = page.file.src_uri
    if uri.startswith("benchmarks/"):
        return markdown  # the benchmarks' own files link among themselves
    return LINK.sub(lambda m: f"]({site_link(uri, m[1])}{m[2] or ''})", markdown)


if __name__ == "__main__":
    page = Path(__file__).parent / SETTINGS_PAGE
    page.write_text(settings_reference())
    print(f"wrote {page}")
