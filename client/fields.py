"""``--json [FIELDS]``: gh's field selection for the commands' JSON output.

``--json`` alone prints the whole object (or list), as it always did; ``--json id,status``
prints only those fields of each, in that order. The fields a command knows are the API's
(the server's ``JobOut``, ``JobSummary``, ``DatasetOut`` and ``ZooModelOut``; a test keeps
these lists equal to them) and are checked before any request is sent: an unknown field is a
usage error (exit 2) whose message lists the valid ones.

Click options take a value or none, not "maybe one", so ``JsonCommand.parse_args`` (in
``cli``) rewrites the command line first with :func:`rewrite`: ``--json`` followed by a word
becomes ``--json=WORD``, unless the command still needs that word as its argument (``zoopick
jobs wait --json ID`` waits for ID, as it always did), and a bare ``--json`` becomes
``--json=*`` (everything). ``--json=FIELDS`` is always a field list."""

from __future__ import annotations

from typing import Any

ALL = "*"
"""The value of a bare ``--json``: every field."""

Selection = str | tuple[str, ...] | None
"""What a command's ``--json`` asked: None (no JSON), ``ALL``, or the fields in order."""

JOB_SUMMARY = (
    "id", "status", "progress", "error", "dataset_id", "models", "metrics", "select_by",
    "finetune", "selection", "chosen_model", "cancel_requested", "recoveries", "model_errors",
    "created_at", "updated_at", "started_at", "finished_at", "name", "tags", "notes",
)  # fmt: skip
"""A job in ``jobs list`` (the API's ``JobSummary``)."""
JOB = (*JOB_SUMMARY, "ranking", "race", "training", "scoring", "mlflow", "links")
"""One job (the API's ``JobOut``)."""
DATASET = (
    "id", "name", "format", "filename", "size_bytes", "file_sha256", "status", "error",
    "classes", "counts", "num_samples", "digest", "created_at", "updated_at",
)  # fmt: skip
"""A dataset (the API's ``DatasetOut``)."""
ZOO_MODEL = (
    "id", "arch", "weights", "num_classes", "overrides", "source", "tags", "origin",
    "created_at", "data_config",
)  # fmt: skip
"""A zoo model (the API's ``ZooModelOut``)."""


def parse(text: str, valid: tuple[str, ...]) -> Selection:
    """``--json``'s value as a selection; ``ValueError`` naming an unknown or missing field
    and listing the valid ones."""
    if text == ALL:
        return ALL
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in valid]
    if unknown:
        what = ", ".join(repr(n) for n in unknown)
        raise ValueError(f"unknown field(s) {what}; valid fields: {', '.join(valid)}")
    return tuple(dict.fromkeys(names))


def select(data: Any, selection: Selection) -> Any:
    """``data`` (an object or a list of them) with only the selected fields; a field the
    server did not send is null."""
    if selection in (None, ALL):
        return data
    if isinstance(data, list):
        return [select(item, selection) for item in data]
    return {name: data.get(name) for name in selection}


def rewrite(args: list[str], arguments: int, value_options: frozenset[str]) -> list[str]:
    """``args`` with each ``--json`` given its value: the word after it when the command's
    ``arguments`` (how many it takes) are there without it, else ``*`` (the word is then
    one of them). ``value_options`` are the options that take a value (``--status done``:
    ``done`` is no argument). Nothing after ``--`` is touched."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out.extend(args[i:])
            break
        i += 1
        if arg != "--json":
            out.append(arg)
            continue
        after = args[i] if i < len(args) else None
        if (
            after is not None
            and not after.startswith("-")
            and _arguments_in(args, value_options, skip=i) >= arguments
        ):
            out.append(f"--json={after}")
            i += 1
        else:
            out.append(f"--json={ALL}")
    return out


def _arguments_in(args: list[str], value_options: frozenset[str], skip: int) -> int:
    """How many of ``args`` are the command's arguments, the word at ``skip`` left out."""
    count, i = 0, 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return count + len(args) - i - 1
        if i != skip and not arg.startswith("-"):
            count += 1
        i += 2 if arg in value_options else 1
    return count
