"""``zoopick datasets|jobs|model|zoo``: the client's command line, for people and pipelines.

Settings: ``--url`` / ``--api-key``, else ``ZOOPICK_URL`` / ``ZOOPICK_API_KEY``. An option
given empty is refused (exit 2, naming it); an empty variable counts as unset, as a shell
reads it (a CI template's unset variable), with a note on stderr saying what is used. With
``--json`` only the machine-readable result goes to stdout, also when a wait ends short of
success (the dataset or job as last seen); progress bars and messages go to stderr either way.
``--json id,status`` keeps only those fields, gh's way (``fields``).

Exit codes (a pipeline can branch on them):

- 0: done (a waited-for job succeeded)
- 1: the job failed or was cancelled
- 2: usage error or bad input (unknown dataset, metric or option; invalid file; 404/409/422;
  an unknown ``--json`` field, with the valid ones listed)
- 3: timed out waiting (``--timeout``); the job keeps running
- 4: server unreachable (after retries), unauthorised, a persisting server error, or an answer
  that is not a zoopick server's
- 130: interrupted (Ctrl-C) while waiting; the job keeps running
- 141: stdout was closed before everything was written (``| head``), as a shell reports a
  program that SIGPIPE ended
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from typer.core import TyperCommand

from . import fields
from .errors import EXIT_BAD_INPUT, EXIT_JOB_FAILED, JobFailed, ZoopickError
from .http import DEFAULT_URL, Client, regular_file
from .models import Dataset, Job, ZooModel
from .retry import RetryPolicy
from .tables import PlainConsole, show, table, visible

EXIT_CODES_HELP = (
    "Exit codes: 0 done/succeeded, 1 job failed or cancelled, 2 usage or bad input, "
    "3 timed out waiting, 4 server unreachable or unauthorised, 130 interrupted, "
    "141 stdout closed."
)
EXIT_INTERRUPTED = 130
EXIT_CLOSED_OUTPUT = 141

err = PlainConsole(stderr=True, soft_wrap=True)
out = PlainConsole(soft_wrap=True)

datasets_app = typer.Typer(
    help="Upload and manage datasets. " + EXIT_CODES_HELP, no_args_is_help=True
)
jobs_app = typer.Typer(help="Submit and follow jobs. " + EXIT_CODES_HELP, no_args_is_help=True)
model_app = typer.Typer(help="Download fine-tuned models. " + EXIT_CODES_HELP, no_args_is_help=True)
zoo_app = typer.Typer(help="The candidate models. " + EXIT_CODES_HELP, no_args_is_help=True)

Url = Annotated[
    str | None,
    typer.Option("--url", envvar="ZOOPICK_URL", help="Server URL (default http://127.0.0.1:8000)."),
]
Key = Annotated[
    str | None,
    typer.Option("--api-key", envvar="ZOOPICK_API_KEY", help="API key.", show_default=False),
]


def _json_option(valid: tuple[str, ...]) -> Any:
    """``--json [FIELDS]`` for a command whose JSON has ``valid`` fields (``fields``)."""

    def check(value: str | None) -> fields.Selection:
        if value is None:
            return None
        try:
            return fields.parse(value, valid)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None

    return typer.Option(
        "--json",
        metavar="[FIELDS]",
        callback=check,
        show_default=False,
        help="Machine-readable output on stdout only; with FIELDS (comma-separated: "
        "id,status), only those fields.",
    )


DatasetJson = Annotated[str | None, _json_option(fields.DATASET)]
JobJson = Annotated[str | None, _json_option(fields.JOB)]
JobsJson = Annotated[str | None, _json_option(fields.JOB_SUMMARY)]
ZooJson = Annotated[str | None, _json_option(fields.ZOO_MODEL)]


class JsonCommand(TyperCommand):
    """A command whose ``--json`` takes its fields or none (``fields.rewrite``)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if any(p.name == "as_json" for p in self.params):
            arguments = sum(p.param_type_name == "argument" for p in self.params)
            valued = frozenset(
                name
                for p in self.params
                if p.param_type_name == "option" and not p.is_flag and p.name != "as_json"
                for name in p.opts
            )
            args = fields.rewrite(args, arguments, valued)
        return super().parse_args(ctx, args)


Timeout = Annotated[
    float | None, typer.Option("--timeout", min=0, help="Give up waiting after S seconds (exit 3).")
]


def register(app: typer.Typer) -> None:
    """Mount the client's command groups on the ``zoopick`` command."""
    app.add_typer(datasets_app, name="datasets")
    app.add_typer(jobs_app, name="jobs")
    app.add_typer(model_app, name="model")
    app.add_typer(zoo_app, name="zoo")


def add_version_option(app: typer.Typer, command: str, distribution: str) -> None:
    """``COMMAND --version``: print ``COMMAND VERSION``, the installed ``distribution``'s
    version, and exit 0 (before any other option or command is looked at)."""

    def print_version(value: bool) -> None:
        if value:
            typer.echo(f"{command} {metadata.version(distribution)}")
            raise typer.Exit()

    # the option as a default, not in Annotated: this module's annotations are strings,
    # which typer evaluates in the module's globals, where print_version is not
    @app.callback()
    def _options(
        version: bool = typer.Option(
            False,
            "--version",
            callback=print_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ) -> None:
        pass


class _PipeGuard:
    """stdout, with a closed pipe (``zoopick jobs list | head -1``) turned into exit 141 and
    nothing more: click turned it into exit 1, "the job failed", and lost what stderr said."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed()
            return 0

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()

    def _closed(self) -> None:
        # what is still buffered goes nowhere at exit, instead of raising again there
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        raise typer.Exit(EXIT_CLOSED_OUTPUT)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_stdout() -> None:
    """Install :class:`_PipeGuard` on ``sys.stdout`` (the commands' ``main``, once), and
    have stdout and stderr write what their encoding cannot carry as escapes (``\\xe9``):
    on an ASCII stream (``PYTHONIOENCODING=ascii``, a CI log) a dataset or model name with
    an accent ended a table in a traceback. Rich draws its tables and bars in ASCII there."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")
    if not isinstance(sys.stdout, _PipeGuard):
        sys.stdout = _PipeGuard(sys.stdout)  # type: ignore[assignment]


def _refuse_empty(*given: tuple[str, str | None]) -> None:
    """Exit 2 naming the first option given empty (``--select-by ""``, ``--api-key "$UNSET"``):
    each had meant its default without a word (for ``--api-key``, ZOOPICK_API_KEY's key).
    Click reads an empty environment variable as unset, so only a typed option gets here."""
    for option, value in given:
        if value is not None and not value.strip():
            typer.echo(f"error: {option} is empty: give a value, or leave the option out", err=True)
            raise typer.Exit(EXIT_BAD_INPUT)


def _note_empty_settings(url: str | None, key: str | None) -> None:
    """An empty ``ZOOPICK_URL`` or ``ZOOPICK_API_KEY`` (a CI template's unset variable) counts
    as unset, as a shell reads it, but not silently: a note on stderr says what is used."""
    if url is None and os.environ.get("ZOOPICK_URL") == "":
        err.print(f"note: ZOOPICK_URL is empty: using {DEFAULT_URL}", highlight=False)
    if key is None and os.environ.get("ZOOPICK_API_KEY") == "":
        err.print("note: ZOOPICK_API_KEY is empty: sending no API key", highlight=False)
    if os.environ.get("ZOOPICK_RETRIES") == "":
        err.print("note: ZOOPICK_RETRIES is empty: using the default tries", highlight=False)


def _client(url: str | None, key: str | None) -> Client:
    """The client of ``--url`` / ``--api-key``, else ZOOPICK_URL / ZOOPICK_API_KEY; an empty
    option is refused (exit 2), an empty variable is unset (with a note)."""
    _refuse_empty(("--url", url), ("--api-key", key))
    _note_empty_settings(url, key)
    attempts = os.environ.get("ZOOPICK_RETRIES") or None  # empty: unset, as the others
    policy = None
    if attempts is not None:
        if not (attempts.isascii() and attempts.isdigit() and int(attempts) >= 1):
            # "abc" or "-1" once meant the default 5 tries, without a word
            typer.echo(
                f"error: ZOOPICK_RETRIES={attempts!r}: give a whole number of tries, 1 or more",
                err=True,
            )
            raise typer.Exit(EXIT_BAD_INPUT)
        policy = RetryPolicy(attempts=int(attempts))
    return Client(url, key, retry=policy)


@contextmanager
def _errors() -> Iterator[None]:
    """A client error: one line on stderr and its exit code."""
    try:
        yield
    except ZoopickError as exc:
        typer.echo(f"error: {visible(' '.join(str(exc).split()))}", err=True)
        raise typer.Exit(exc.exit_code) from None


def _emit(data: Any, selection: fields.Selection = fields.ALL) -> None:
    """``data`` as JSON on stdout: the fields ``--json`` asked for, in its order."""
    data = fields.select(data, selection)
    keep_order = selection not in (None, fields.ALL)
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=not keep_order) + "\n")
    sys.stdout.flush()


def _show_one(
    url: str | None,
    api_key: str | None,
    as_json: fields.Selection,
    fetch: Callable[[Client], Any],
    printer: Callable[[Any], None],
) -> None:
    """A ``get`` command's body: one resource fetched, then shown as JSON (``--json``, its
    selected fields) or by ``printer``."""
    with _errors(), _client(url, api_key) as client:
        item = fetch(client)
    _emit(item.raw, as_json) if as_json else printer(item)


def _show_list(
    url: str | None,
    api_key: str | None,
    as_json: fields.Selection,
    fetch: Callable[[Client], list[Any]],
    columns: tuple[str, ...],
    cells: Callable[[Any], tuple[str, ...]],
) -> None:
    """A ``list`` command's body: the items fetched, then shown as JSON (``--json``, their
    selected fields) or as a table of ``columns``, a row of ``cells(item)`` each."""
    with _errors(), _client(url, api_key) as client:
        items = fetch(client)
    if as_json:
        _emit([item.raw for item in items], as_json)
        return
    rows = table(*columns)
    for item in items:
        rows.add_row(*cells(item))
    show(out, rows)


def _split(values: list[str] | None) -> list[str] | None:
    """Repeatable options that also take commas: ``--models a,b --models c``; given but
    empty (``--models ""``) is an empty list, which the server refuses, not "all"."""
    if values is None:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _bytes_progress(label: str) -> Progress:
    return Progress(
        TextColumn(visible(label), markup=False),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
    )


# -- datasets ------------------------------------------------------------------------------


def _print_dataset(ds) -> None:
    out.print(f"{ds.id}  {ds.name}  {ds.status}  {ds.format}  {ds.size_bytes} bytes")
    if ds.error:
        out.print(f"  error: {ds.error}", markup=False)
    if ds.counts:
        out.print("  classes: " + ", ".join(f"{k} ({v})" for k, v in ds.counts.items()))


@datasets_app.command("upload", cls=JsonCommand)
def datasets_upload(
    path: Annotated[Path, typer.Argument(help=".npz or an ImageFolder .zip/.tar/.tar.gz.")],
    name: Annotated[str | None, typer.Option(help="Dataset name (default: file name).")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until it is validated.")] = False,
    timeout: Timeout = None,
    url: Url = None,
    api_key: Key = None,
    as_json: DatasetJson = None,
) -> None:
    """Upload a dataset; prints its id (with --json, the dataset). Once it is uploaded, it is
    printed whatever follows: with --wait, also when it turns out invalid (exit 2), the wait
    times out (3) or the server goes away (4), as last seen."""
    _refuse_empty(("--name", name))
    with _errors(), _client(url, api_key) as client:
        with _bytes_progress(f"uploading {path.name}") as bar:
            task = bar.add_task("upload", total=None)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            ds = client.upload_dataset(path, name=name, progress=progress)
        err.print(f"uploaded {path.name} as dataset {ds.id} ({ds.status})", highlight=False)
        if wait and ds.status != "ready":
            ds = _wait_dataset(client, ds, 600 if timeout is None else timeout, as_json)
            err.print(f"dataset {ds.id} is ready: {ds.num_samples} images", highlight=False)
    _show_uploaded(ds, as_json)


def _show_uploaded(ds: Dataset, as_json: fields.Selection) -> None:
    _emit(ds.raw, as_json) if as_json else out.print(ds.id)


def _wait_dataset(
    client: Client, ds: Dataset, timeout: float, as_json: fields.Selection
) -> Dataset:
    """Wait for ``ds`` to be validated. However the wait ends short of ``ready`` (invalid,
    timed out, the server gone, Ctrl-C), the dataset as last seen is printed before the
    error's exit: its id went to stderr only, and a pipeline reading stdout got nothing."""
    seen = [ds]
    try:
        with err.status("validating..."):
            return client.wait_dataset(ds.id, timeout=timeout, on_update=seen.append)
    except ZoopickError:
        _show_uploaded(seen[-1], as_json)
        raise
    except KeyboardInterrupt:
        _show_uploaded(seen[-1], as_json)
        err.print(f"interrupted: dataset {ds.id} is still being validated", highlight=False)
        raise typer.Exit(EXIT_INTERRUPTED) from None


@datasets_app.command("list", cls=JsonCommand)
def datasets_list(
    status: Annotated[str | None, typer.Option(help="Only this status.")] = None,
    limit: Annotated[int | None, typer.Option(min=1)] = None,
    url: Url = None,
    api_key: Key = None,
    as_json: DatasetJson = None,
) -> None:
    """Your datasets, newest first."""
    _refuse_empty(("--status", status))
    _show_list(
        url, api_key, as_json, lambda client: client.list_datasets(status=status, limit=limit),
        ("id", "name", "status", "classes", "images", "created"),
        lambda d: (
            d.id, d.name, d.status, str(len(d.classes or [])), str(d.num_samples or ""),
            d.created_at,
        ),
    )  # fmt: skip


@datasets_app.command("get", cls=JsonCommand)
def datasets_get(
    dataset_id: Annotated[str, typer.Argument(metavar="ID")],
    url: Url = None,
    api_key: Key = None,
    as_json: DatasetJson = None,
) -> None:
    """One dataset: status, classes and counts, or why it is invalid."""
    _show_one(url, api_key, as_json, lambda client: client.get_dataset(dataset_id), _print_dataset)


@datasets_app.command("delete")
def datasets_delete(
    dataset_id: Annotated[str, typer.Argument(metavar="ID")],
    url: Url = None,
    api_key: Key = None,
) -> None:
    """Delete a dataset and its files (refused while an unfinished job uses it)."""
    with _errors(), _client(url, api_key) as client:
        client.delete_dataset(dataset_id)
    err.print(f"deleted dataset {dataset_id}", highlight=False)


# -- jobs ----------------------------------------------------------------------------------


def _wait(
    client: Client,
    job: Job | str,
    timeout: float | None,
    seen: Callable[[Job], None] | None = None,
) -> Job:
    """Follow a job (or a job id: its first poll is the wait's, within ``timeout``) with a
    progress bar on stderr, ``seen`` called with each state polled; JobFailed unless it
    succeeded."""
    jid, status = (job, "waiting") if isinstance(job, str) else (job.id, job.status)
    with Progress(
        TextColumn("job {task.fields[jid]}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%  {task.fields[status]}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("job", total=1.0, jid=jid[:8], status=status)

        def update(j: Job) -> None:
            bar.update(task, completed=j.progress, status=j.status)
            if seen is not None:
                seen(j)

        try:
            return client.wait_job(jid, timeout=timeout, on_update=update, check=True)
        except KeyboardInterrupt:
            raise _Interrupted(jid) from None


class _Interrupted(Exception):
    """Ctrl-C during a wait (exit 130, the job keeps running); ``args[0]`` is its id."""


def _summary_line(job: Job) -> str:
    line = f"job {job.id} {job.status}"
    if job.chosen_model:
        score = job.chosen_score
        line += f"; chosen model {job.chosen_model}"
        if score is not None:
            line += f" ({job.select_by} {score:.4g})"
    if job.error:
        line += f": {job.error}"
    return line


def _finish(job: Job, exc: JobFailed | None, as_json: fields.Selection) -> None:
    """Print the job (stdout), the one-line summary (stderr) and exit 1 if it failed."""
    if as_json:
        _emit(job.raw, as_json)
    else:
        _print_results(job)
    err.print(_summary_line(job), markup=False, highlight=False)
    if exc is not None:
        raise typer.Exit(exc.exit_code)


@jobs_app.command("submit", cls=JsonCommand)
def jobs_submit(
    ctx: typer.Context,
    dataset: Annotated[str, typer.Option("--dataset", help="Dataset id.")],
    models: Annotated[
        list[str] | None, typer.Option("--models", help="Zoo ids (repeat or comma-separate).")
    ] = None,
    metric: Annotated[
        list[str] | None, typer.Option("--metric", help="Metric (repeat or comma-separate).")
    ] = None,
    select_by: Annotated[
        str | None,
        typer.Option(
            "--select-by",
            help="Metric that picks (server's default: fsms if requested, else the first).",
        ),
    ] = None,
    finetune_epochs: Annotated[
        int | None,
        typer.Option(
            "--finetune-epochs", min=1, help="Fine-tune the chosen model for this many epochs."
        ),
    ] = None,
    finetune_default: Annotated[
        bool,
        typer.Option(
            "--finetune",
            help="Fine-tune the chosen model with every option the server's default (its "
            "auto recipe: length, learning rate and best checkpoint chosen from the data).",
        ),
    ] = False,
    recipe: Annotated[
        str | None,
        typer.Option(help="Fine-tune recipe: auto (the server's default) or fixed."),
    ] = None,
    compressor: Annotated[str | None, typer.Option(help="Comm hook (dense, spardl...).")] = None,
    density: Annotated[float | None, typer.Option(help="Fraction of gradients sent.")] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="Data-parallel workers.")] = None,
    min_workers: Annotated[
        int | None,
        typer.Option(
            "--min-workers",
            min=1,
            help="An elastic run (with --max-workers): it goes on with as few as this when a "
            "machine of the Ray pool is lost.",
        ),
    ] = None,
    max_workers: Annotated[
        int | None,
        typer.Option("--max-workers", min=1, help="An elastic run's most workers."),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", min=1, help="Images per worker and optimizer step."),
    ] = None,
    optimizer: Annotated[
        Optimizer | None,
        typer.Option(help="Fine-tune optimizer (default: the recipe's, AdamW)."),
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Fine-tune learning rate.")] = None,
    shortlist: Annotated[
        int | None,
        typer.Option(
            "--shortlist",
            min=2,
            help="Race the metric's K best models with short fine-tunes and choose the "
            "winner (server's default: 3 when --budget is given).",
        ),
    ] = None,
    budget: Annotated[
        float | None,
        typer.Option(
            "--budget",
            help="The race's training budget in epochs of the training data, summed over "
            "every candidate (server's default: 3 when --shortlist is given).",
        ),
    ] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option(help="Retrying with the same key returns the same job (default: fresh)."),
    ] = None,
    webhook: Annotated[
        str | None,
        typer.Option(
            help="URL the server POSTs the job's summary to when it ends (signed; in place of "
            "your tenant's webhook)."
        ),
    ] = None,
    webhook_phases: Annotated[
        bool,
        typer.Option(
            "--webhook-phases", help="Also call --webhook at each phase (scoring, racing, ...)."
        ),
    ] = False,
    name: Annotated[
        str | None, typer.Option(help="The job's name (the job list searches it).")
    ] = None,
    tag: Annotated[
        list[str] | None,
        typer.Option("--tag", help="A tag for the job (repeat for more; the list filters them)."),
    ] = None,
    notes: Annotated[str | None, typer.Option(help="Free text kept with the job.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait for the job to finish.")] = False,
    timeout: Timeout = None,
    url: Url = None,
    api_key: Key = None,
    as_json: JobJson = None,
) -> None:
    """Submit a job: score the models, pick one, and (with any fine-tune option) fine-tune it.
    With --shortlist/--budget the metric's best models first race short fine-tunes.

    Without --wait prints the job id (with --json, the job). With --wait, exits 0 if the job
    succeeded, 1 if it failed or was cancelled, 3 on --timeout."""
    _refuse_empty(
        ("--dataset", dataset),
        ("--select-by", select_by),
        ("--compressor", compressor),
        ("--webhook", webhook),
        ("--name", name),
    )
    given = {"epochs": finetune_epochs, "compressor": compressor, "density": density}
    given.update(workers=_worker_count(workers, min_workers, max_workers), lr=lr, recipe=recipe)
    given.update(batch_size=batch_size, optimizer=optimizer.value if optimizer else None)
    if webhook_phases and webhook is None:
        _usage("--webhook-phases needs --webhook URL")
    finetune = {k: v for k, v in given.items() if v is not None} or None
    if finetune is None and finetune_default:
        finetune = {}
    race = {"shortlist": shortlist, "budget_epochs": budget}
    selection = {k: v for k, v in race.items() if v is not None} or None
    with _errors(), _client(url, api_key) as client:
        job = client.submit_job(
            dataset,
            models=_split(models),
            metrics=_split(metric),
            select_by=select_by,
            finetune=finetune,
            selection=selection,
            idempotency_key=idempotency_key,
            webhook=None if webhook is None else {"url": webhook, "phases": webhook_phases},
            name=name,
            tags=tag or None,
            notes=notes,
        )
        err.print(f"submitted job {job.id} ({job.status})", highlight=False)
        if not wait:
            _emit(job.raw, as_json) if as_json else out.print(job.id)
            return
        job, failed = _wait_json(client, job, timeout, as_json, _program(ctx))
    _finish(job, failed, as_json)


class Optimizer(StrEnum):
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


def _usage(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def _worker_count(
    workers: int | None, low: int | None, high: int | None
) -> int | dict[str, int] | None:
    """``--workers N``, or ``--min-workers``/``--max-workers`` as the API's elastic range
    ``{"min": m, "max": n}`` (both needed; not with ``--workers``)."""
    if low is None and high is None:
        return workers
    if workers is not None:
        _usage("give --workers, or --min-workers and --max-workers (an elastic run), not both")
    if low is None or high is None:
        _usage("an elastic run needs both --min-workers and --max-workers")
    return {"min": low, "max": high}


def _program(ctx: typer.Context) -> str:
    """The command as the user ran it (``zoopick``, ``zoopick-client``, ``python -m
    zoopick.cli``), for a hint that names a command to run next."""
    return ctx.find_root().info_name or "zoopick"


def _wait_json(
    client: Client, job: Job | str, timeout: float | None, as_json: fields.Selection, program: str
) -> tuple[Job, JobFailed | None]:
    """``_wait``, the failure kept for the exit code. However else the wait ends (timed out,
    the server gone, Ctrl-C), ``--json`` still prints the job as last seen before the exit
    (a pipeline reads stdout whatever the exit code): the submitted job, else the last poll's;
    nothing when no state of it was ever seen (``jobs wait`` on a server that never
    answered: the caller has the id it gave). On Ctrl-C, stderr says how to wait again,
    with ``program``: the command the user ran (the light client has no ``zoopick``)."""
    last: list[Job] = [job] if isinstance(job, Job) else []
    try:
        return _wait(client, job, timeout, last.append), None
    except JobFailed as exc:
        return exc.job, exc
    except (ZoopickError, _Interrupted) as exc:
        if as_json and last:
            _emit(last[-1].raw, as_json)
        if isinstance(exc, _Interrupted):
            jid = exc.args[0]
            err.print(
                f"interrupted: job {jid} keeps running ({program} jobs wait {jid})",
                highlight=False,
            )
            raise typer.Exit(EXIT_INTERRUPTED) from None
        raise


@jobs_app.command("status", cls=JsonCommand)
def jobs_status(
    job_id: Annotated[str, typer.Argument(metavar="ID")],
    url: Url = None,
    api_key: Key = None,
    as_json: JobJson = None,
) -> None:
    """A job's status, progress and chosen model."""
    with _errors(), _client(url, api_key) as client:
        job = client.get_job(job_id)
    if as_json:
        _emit(job.raw, as_json)
    else:
        out.print(f"{job.status} {job.progress:.0%}", highlight=False)
        err.print(_summary_line(job), markup=False, highlight=False)


@jobs_app.command("wait", cls=JsonCommand)
def jobs_wait(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(metavar="ID")],
    timeout: Timeout = None,
    url: Url = None,
    api_key: Key = None,
    as_json: JobJson = None,
) -> None:
    """Wait for a job: exit 0 if it succeeded, 1 if it failed or was cancelled, 3 on timeout."""
    with _errors(), _client(url, api_key) as client:
        job, failed = _wait_json(client, job_id, timeout, as_json, _program(ctx))
    _finish(job, failed, as_json)


@jobs_app.command("list", cls=JsonCommand)
def jobs_list(
    status: Annotated[str | None, typer.Option(help="Only this status.")] = None,
    limit: Annotated[int | None, typer.Option(min=1)] = 20,
    url: Url = None,
    api_key: Key = None,
    as_json: JobsJson = None,
) -> None:
    """Your jobs, newest first."""
    _refuse_empty(("--status", status))
    _show_list(
        url, api_key, as_json, lambda client: client.list_jobs(status=status, limit=limit),
        ("id", "status", "progress", "chosen", "select by", "created"),
        lambda j: (
            j.id, j.status, f"{j.progress:.0%}", j.chosen_model or "", j.select_by, j.created_at
        ),
    )  # fmt: skip


@jobs_app.command("cancel", cls=JsonCommand)
def jobs_cancel(
    job_id: Annotated[str, typer.Argument(metavar="ID")],
    url: Url = None,
    api_key: Key = None,
    as_json: JobJson = None,
) -> None:
    """Cancel a job (a running one stops at its next model or epoch)."""
    with _errors(), _client(url, api_key) as client:
        job = client.cancel_job(job_id)
    if as_json:
        _emit(job.raw, as_json)
    err.print(
        f"job {job.id} {job.status}" + (" (cancel requested)" if not job.done else ""),
        highlight=False,
    )


def _number(value: Any) -> str:
    """A number to 4 significant digits (``loss 1.638``, not ``1.638114869594574``), as the
    ranking's scores; anything else (None, an odd server's text) as it is."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:.4g}"
    return str(value)


def _print_results(job: Job) -> None:
    rows = table("rank", "model", *job.metrics, "seconds", title=f"job {job.id} ({job.status})")
    for r in job.ranking:
        mark = " *" if r.model == job.chosen_model else ""
        rows.add_row(
            str(r.rank),
            r.model + mark,
            *[f"{r.scores[m]:.4g}" if m in r.scores else "" for m in job.metrics],
            f"{sum(r.seconds.values()):.2f}",
        )
    show(out, rows)
    race = job.raw.get("race")
    if race:
        rungs = table("rung", "model", "steps", "val accuracy", "status", title="race")
        for rung in race["rungs"]:
            for e in rung["entries"]:
                acc = e.get("val_accuracy")
                rungs.add_row(
                    str(rung["index"] + 1),
                    e["model"],
                    str(e.get("steps") if e.get("steps") is not None else ""),
                    "" if acc is None else f"{acc:.4f}",
                    e["status"],
                )
        show(out, rungs)
        out.print(
            f"race: {race['spent_steps']} of {race['budget_steps']} budget steps spent"
            + (f"; {race['why']}" if race.get("why") else ""),
            highlight=False,
        )
    if job.training and job.training.epochs:
        last = job.training.epochs[-1]
        out.print(
            f"fine-tuned {job.training.model}: {len(job.training.epochs)} epoch(s), "
            f"loss {_number(last.loss)}, test accuracy {_number(last.test_accuracy)}",
            highlight=False,
        )
    if job.training and job.training.recipe:
        chosen = job.training.recipe
        plan = chosen.get("plan") or {}
        best = chosen.get("best_step")
        out.print(
            f"recipe {plan.get('recipe')}: {plan.get('optimizer')} "
            f"at lr {_number(chosen.get('lr'))} ({plan.get('lr_source')}), "
            f"{plan.get('steps')} steps"
            + (", then trained on every image" if plan.get("refit") else "")
            + (f", best validation step {best}" if best is not None else ""),
            highlight=False,
        )


@jobs_app.command("results", cls=JsonCommand)
def jobs_results(
    job_id: Annotated[str, typer.Argument(metavar="ID")],
    url: Url = None,
    api_key: Key = None,
    as_json: JobJson = None,
) -> None:
    """The ranking (best first by the job's select-by metric; * marks the chosen model)."""
    _show_one(url, api_key, as_json, lambda client: client.results(job_id), _print_results)


jobs_app.command(
    "get",
    cls=JsonCommand,
    help="One job: its ranking, as results (with --json, the job or its FIELDS).",
)(jobs_results)


@jobs_app.command("log")
def jobs_log(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(metavar="ID")],
    out: Annotated[
        str | None,
        typer.Option("--output", "-o", help="File or folder to write (default: stdout)."),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Print the log as it grows until the job ends (waiting for its run to "
            "start); exit 0 if it succeeded, 1 if it failed or was cancelled.",
        ),
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.05, help="With --follow: seconds between polls.")
    ] = 2.0,
    timeout: Timeout = None,
    url: Url = None,
    api_key: Key = None,
) -> None:
    """A fine-tune job's training log: what the trainer printed.

    Exit 2 when the job fine-tunes nothing or its run has written no log yet (with --follow:
    when the job ended without one)."""
    if follow:
        if out is not None:
            err.print("error: --follow prints to stdout; leave out --output", highlight=False)
            raise typer.Exit(EXIT_BAD_INPUT)
        _follow_log(job_id, interval, timeout, url, api_key, _program(ctx))
        return
    output = _output_path(out)
    if output is not None and not output.parent.exists():
        err.print(f"error: folder {output.parent} does not exist", highlight=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    with _errors(), _client(url, api_key) as client:
        text = client.get_job_log(job_id)
        if output is not None:
            path = _write_text(output, f"train-{job_id}.log", text, "the log")
            err.print(f"log written to {path}", highlight=False)
            return
    # a terminal gets control characters as escapes (as every name the CLI shows); a pipe
    # or a file gets the log as the trainer wrote it
    sys.stdout.write(visible(text) if sys.stdout.isatty() else text)
    sys.stdout.flush()


def _follow_log(
    job_id: str,
    interval: float,
    timeout: float | None,
    url: str | None,
    api_key: str | None,
    program: str,
) -> None:
    """``jobs log --follow``: each new piece of the log to stdout as it comes (escaped on a
    terminal, as written to a pipe), then the job's summary line and its exit code."""
    tty = sys.stdout.isatty()

    def write(text: str) -> None:
        sys.stdout.write(visible(text) if tty else text)
        sys.stdout.flush()

    with _errors(), _client(url, api_key) as client:
        try:
            job = client.follow_job_log(job_id, write, interval=interval, timeout=timeout)
        except KeyboardInterrupt:
            err.print(
                f"interrupted: job {job_id} keeps running ({program} jobs log {job_id} -f)",
                highlight=False,
            )
            raise typer.Exit(EXIT_INTERRUPTED) from None
    err.print(_summary_line(job), markup=False, highlight=False)
    if job.status != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


def _output_path(given: str | None) -> Path | None:
    """``-o``'s path; given empty (``-o "$UNSET"``) it is refused (exit 2), where a ``Path``
    option had read it as ``.`` and written into the current folder without a word."""
    if given is None:
        return None
    _refuse_empty(("--output", given))
    return Path(given).expanduser()


def _write_text(dest: Path, name: str, text: str, what: str) -> Path:
    """Write ``text`` to ``dest`` (a folder: to ``name`` in it) through a ``.part`` file
    renamed over it, never through a link or into a special file."""
    if dest.is_dir():
        dest = dest / name
    regular_file(dest, what)
    part = dest.with_name(dest.name + ".part")
    try:
        part.write_text(text, encoding="utf-8")
        part.replace(dest)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise ZoopickError(f"cannot write {what} to {dest}: {exc.strerror or exc}") from None
    return dest


# -- model and zoo -------------------------------------------------------------------------


class ModelFormat(StrEnum):
    safetensors = "safetensors"
    timm = "timm"
    onnx = "onnx"


@model_app.command("download")
def model_download(
    job_id: Annotated[str, typer.Argument(metavar="JOB")],
    out: Annotated[str, typer.Option("--output", "-o", help="File or folder to write.")],
    format: Annotated[  # noqa: A002 - the option's name
        ModelFormat,
        typer.Option(
            "--format",
            help="safetensors (the weights), timm (a tar of the folder timm.create_model "
            "loads: config.json + model.safetensors) or onnx; the server makes the last two "
            "on first request.",
        ),
    ] = ModelFormat.safetensors,
    retry_export: Annotated[
        bool,
        typer.Option(
            "--retry-export",
            help="Make a failed timm or onnx export again (once its cause is fixed).",
        ),
    ] = False,
    url: Url = None,
    api_key: Key = None,
) -> None:
    """Download a succeeded job's fine-tuned model, checked by its SHA-256."""
    output = _output_path(out)
    assert output is not None  # a required option
    if output.parent and not output.parent.exists():
        err.print(f"error: folder {output.parent} does not exist", highlight=False)
        raise typer.Exit(EXIT_BAD_INPUT)
    with _errors(), _client(url, api_key) as client, _bytes_progress("downloading") as bar:
        task = bar.add_task("download", total=None)
        path = client.download_model(
            job_id,
            output,
            format=format.value,
            progress=lambda d, t: bar.update(task, completed=d, total=t or None),
            retry_export=retry_export,
        )
    err.print(f"model written to {path}", highlight=False)


@zoo_app.command("list", cls=JsonCommand)
def zoo_list(url: Url = None, api_key: Key = None, as_json: ZooJson = None) -> None:
    """The zoo's candidate models."""
    _show_list(
        url, api_key, as_json, lambda client: client.list_zoo(),
        ("id", "architecture", "classes", "source", "tags"),
        lambda m: (m.id, m.arch, str(m.num_classes), m.source or "", ", ".join(m.tags)),
    )  # fmt: skip


def _numbers(option: str, given: str | None, kind: type) -> list | None:
    """``--mean 0.5,0.5,0.5`` as three numbers (exit 2 naming the option otherwise)."""
    if given is None:
        return None
    try:
        values = [kind(v) for v in given.split(",")]
    except ValueError:
        values = []
    if len(values) != 3:
        typer.echo(f"error: {option} {given!r}: give three comma-separated numbers", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    return values


def _print_model(model: ZooModel) -> None:
    raw = model.raw
    out.print(
        f"{model.id}  {model.arch}  {model.num_classes} classes  weights {raw.get('weights')}",
        markup=False,
        highlight=False,
    )
    cfg = raw.get("data_config")
    if cfg:
        size = "x".join(str(v) for v in cfg.get("input_size", []))
        out.print(
            f"  data config: input {size}, {cfg.get('interpolation')}, crop_pct "
            f"{cfg.get('crop_pct')} ({cfg.get('crop_mode')}), mean {cfg.get('mean')}, "
            f"std {cfg.get('std')}",
            markup=False,
            highlight=False,
        )


@zoo_app.command("get", cls=JsonCommand)
def zoo_get(
    model_id: Annotated[str, typer.Argument(metavar="ID")],
    url: Url = None,
    api_key: Key = None,
    as_json: ZooJson = None,
) -> None:
    """One model, with the data config timm resolves for it (what scoring feeds it)."""
    _show_one(url, api_key, as_json, lambda client: client.get_model(model_id), _print_model)


@zoo_app.command("add", cls=JsonCommand)
def zoo_add(
    arch: Annotated[
        str,
        typer.Argument(
            metavar="NAME",
            help="A timm name, with a pretrained tag if wanted (resnet50.a1_in1k), or a "
            "hub name timm knows (hf-hub:timm/resnet50.a1_in1k).",
        ),
    ],
    weights: Annotated[
        str,
        typer.Option(
            help="hub (the tag's pretrained weights), none (random init), a checkpoint path "
            "on the workers' file system or a checkpoint in the server's S3 store "
            "(s3://bucket/key)."
        ),
    ] = "hub",
    model_id: Annotated[
        str | None, typer.Option("--id", help="Its id in jobs (default: timm's name).")
    ] = None,
    num_classes: Annotated[
        int | None,
        typer.Option(
            "--num-classes", min=1, help="Source head size (default for hub weights: theirs)."
        ),
    ] = None,
    input_size: Annotated[
        str | None, typer.Option(help="Override: C,H,W (default: timm's data config).")
    ] = None,
    mean: Annotated[str | None, typer.Option(help="Override: three numbers.")] = None,
    std: Annotated[str | None, typer.Option(help="Override: three numbers.")] = None,
    interpolation: Annotated[str | None, typer.Option(help="Override: bicubic...")] = None,
    crop_pct: Annotated[float | None, typer.Option(help="Override: 0 < crop_pct <= 1.")] = None,
    crop_mode: Annotated[str | None, typer.Option(help="Override: center...")] = None,
    source: Annotated[str | None, typer.Option(help="Where the weights come from.")] = None,
    tag: Annotated[list[str] | None, typer.Option("--tag", help="A tag (repeat).")] = None,
    url: Url = None,
    api_key: Key = None,
    as_json: ZooJson = None,
) -> None:
    """Add a model to the zoo (an admin key). The server checks it (the architecture, the
    tag, a checkpoint's shapes) and resolves its data config with timm, downloading
    nothing; prints the model as registered, data config included."""
    _refuse_empty(("NAME", arch), ("--weights", weights), ("--id", model_id))
    fields = {
        "id": model_id,
        "num_classes": num_classes,
        "input_size": _numbers("--input-size", input_size, int),
        "mean": _numbers("--mean", mean, float),
        "std": _numbers("--std", std, float),
        "interpolation": interpolation,
        "crop_pct": crop_pct,
        "crop_mode": crop_mode,
        "source": source,
        "tags": tag,
    }
    with _errors(), _client(url, api_key) as client:
        model = client.add_model(arch, weights=weights, **fields)
    err.print(f"added {model.id} to the zoo", highlight=False)
    _emit(model.raw, as_json) if as_json else _print_model(model)


@zoo_app.command("remove")
def zoo_remove(
    model_id: Annotated[str, typer.Argument(metavar="ID")],
    url: Url = None,
    api_key: Key = None,
) -> None:
    """Take a model out of the zoo (an admin key). Jobs that used it keep their results and
    downloads; its id stays with them (it cannot be registered again)."""
    with _errors(), _client(url, api_key) as client:
        client.remove_model(model_id)
    err.print(f"removed {model_id} from the zoo", highlight=False)
