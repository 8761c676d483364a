"""The ``zoopick`` command line: library commands (``score``, ``demo``, ``train``,
``metrics``) and the service's (``serve``, ``worker``, ``migrate``, ``sweep``, ``keys``).

Library errors (bad zoo, bad dataset, unknown metric) become a one-line message on stderr and
exit code 2; heavy imports (torch, timm) happen inside the commands so ``--help`` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from zoopick.client.cli import add_version_option, guard_stdout
from zoopick.client.cli import register as register_client
from zoopick.client.tables import PlainConsole
from zoopick.client.tables import show as show_table
from zoopick.service_cli import service_app
from zoopick.training.backends import Backend
from zoopick.training.config import FinetuneConfig, FinetuneOptions, RunEvent, default

if TYPE_CHECKING:
    import subprocess

app = typer.Typer(
    name="zoopick",
    help="Pick the pretrained model to reuse for your dataset, without training any.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# the service's commands: serve, worker, migrate, keys (light imports only)
app.add_typer(service_app)
# the HTTP client's commands: datasets, jobs, model, zoo (speak to a server, import no service)
register_client(app)
add_version_option(app, "zoopick", "zoopick")  # zoopick --version

EXIT_BAD_INPUT = 2


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    """Print ``error: message`` on one line of stderr and return the Exit to raise."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    return typer.Exit(code)


def field_interval(name: str) -> str:
    """A fine-tune option's range as :class:`FinetuneOptions` states it (gt/ge/lt/le), for
    ``--help``: "(0, 10]" where the run checks lr > 0 and lr <= 10. The check itself is the
    options model's (a value outside exits 2 naming the option)."""
    metadata = FinetuneOptions.model_fields[name].metadata

    def bound(kind: str) -> float | None:
        found = (getattr(m, kind) for m in metadata if getattr(m, kind, None) is not None)
        return next(found, None)

    gt, ge, lt, le = bound("gt"), bound("ge"), bound("lt"), bound("le")
    low = f"({gt:g}" if gt is not None else f"[{ge:g}" if ge is not None else "(-inf"
    high = f"{lt:g})" if lt is not None else f"{le:g}]" if le is not None else "inf)"
    return f"{low}, {high}"


def default_cache_dir() -> Path:
    env = os.environ.get("ZOOPICK_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "zoopick" / "features"


def json_or_text(raw: str) -> Any:
    """An option value: JSON when it parses (numbers, booleans, lists), else the plain string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_options(items: list[str]) -> dict[str, dict[str, Any]]:
    """``--option sms.temperature=1.5`` -> ``{"sms": {"temperature": 1.5}}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        metric, dot, name = key.partition(".")
        if not sep or not dot or not metric or not name:
            raise fail(f"--option {item!r}: expected METRIC.NAME=VALUE")
        out.setdefault(metric, {})[name] = json_or_text(raw)
    return out


@app.command()
def score(
    zoo: Annotated[Path, typer.Option(help="Zoo manifest (JSON or YAML).")],
    data: Annotated[Path, typer.Option(help="ImageFolder dir/archive or .npz dataset.")],
    metric: Annotated[
        list[str], typer.Option("--metric", "-m", help="Metric name; repeat for several.")
    ] = ["fsms", "logme", "sms", "isms"],  # noqa: B006 (Typer reads, never mutates, this default)
    max_per_class: Annotated[
        int | None, typer.Option(min=1, help="Deterministic per-class subsample.")
    ] = None,
    model: Annotated[
        list[str] | None, typer.Option("--model", help="Only these zoo ids (repeatable).")
    ] = None,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-o", help="Metric option METRIC.NAME=VALUE (repeatable)."),
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1)] = 64,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1 ... (auto)")] = None,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Feature cache [$ZOOPICK_CACHE_DIR or ~/.cache]")
    ] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Do not read or write")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Rank every model of a zoo on a dataset with one or more transferability metrics."""
    from zoopick.selection.data import DatasetError, load_dataset
    from zoopick.selection.metrics import MetricError
    from zoopick.selection.rank import check_metrics
    from zoopick.selection.zoo import ZooError, load_zoo

    options = parse_options(option or [])
    try:
        metrics = check_metrics(metric)
        zoo_obj = load_zoo(zoo)
        if model:
            zoo_obj = zoo_obj.select(model)
        dataset = load_dataset(data, max_per_class=max_per_class)
    except (ZooError, DatasetError, MetricError) as exc:
        raise fail(str(exc)) from None

    cache = None if no_cache else (cache_dir or default_cache_dir())
    try:
        ranking = _rank_with_progress(
            zoo_obj, dataset, metrics, cache, batch_size, device, options, quiet=as_json
        )
    except (ZooError, DatasetError, MetricError) as exc:
        raise fail(str(exc)) from None

    for model_id, error in ranking.errors.items():
        typer.echo(f"warning: model {model_id!r} left out: {error}", err=True)
    if as_json:
        typer.echo(json.dumps(ranking.to_dict()))
    else:
        _print_table(ranking)


def _rank_with_progress(zoo, dataset, metrics, cache, batch_size, device, options, *, quiet):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from zoopick.selection.rank import rank_zoo

    console = PlainConsole(stderr=True)
    with Progress(
        TextColumn("scoring"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        console=console,
        disable=not sys.stderr.isatty() and quiet,
        transient=True,
    ) as bar:
        task = bar.add_task("", total=len(zoo))

        def progress(model_id: str, done: int, total: int) -> None:
            bar.update(task, completed=done, description=model_id)

        return rank_zoo(
            zoo,
            dataset,
            metrics,
            cache_dir=cache,
            batch_size=batch_size,
            device=device,
            metric_options=options,
            progress=progress,
        )


def _print_table(ranking) -> None:
    from rich.table import Table

    first = ranking.metrics[0]
    place = {}
    for rank, group in enumerate(ranking.ordered(first), start=1):
        tie = "=" if len(group) > 1 else ""
        for m in group:
            place[m.id] = f"{rank}{tie}"
    table = Table(title=f"{ranking.dataset}: ranked by {first} (= marks a tie)")
    table.add_column("rank", justify="right")
    table.add_column("model", overflow="fold")  # never cut: a model id is copied from here
    for name in ranking.metrics:
        table.add_column(name, justify="right")
    table.add_column("forward s", justify="right")
    for group in ranking.ordered(first):
        for m in group:
            row = [place[m.id], m.id]
            row += [f"{m.scores[name]:.4g}" for name in ranking.metrics]
            row.append("cached" if m.cached else f"{m.seconds['forward']:.2f}")
            table.add_row(*row)
    show_table(PlainConsole(), table)


@app.command()
def demo(
    folder: Annotated[Path, typer.Option("--dir", help="Where the demo zoo is built.")] = Path(
        ".zoopick/demo"
    ),
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric", "-m", help="Metric; the first ranks [the service's default metrics]."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Build a small demo zoo and target on the spot (seconds, no download) and rank it.

    Ranked by the metric the service picks with (its default ``select_by``) unless
    ``--metric`` says otherwise."""
    from zoopick.selection.demo import build_demo
    from zoopick.service.jobs import DEFAULT_METRICS, DEFAULT_SELECT_BY

    if not metric:
        metric = [DEFAULT_SELECT_BY] + [m for m in DEFAULT_METRICS if m != DEFAULT_SELECT_BY]

    typer.echo(f"building the demo zoo in {folder} ...", err=True)
    manifest, target = build_demo(folder)
    typer.echo(f"zoopick score --zoo {manifest} --data {target}", err=True)
    score(
        zoo=manifest,
        data=target,
        metric=metric,
        max_per_class=None,
        model=None,
        option=None,
        batch_size=64,
        device=None,
        cache_dir=folder / "cache",
        no_cache=False,
        as_json=as_json,
    )


@app.command()
def train(
    zoo: Annotated[Path, typer.Option(help="Zoo manifest.")],
    model: Annotated[str, typer.Option(help="Zoo id of the model to fine-tune.")],
    data: Annotated[Path, typer.Option(help="Training dataset (ImageFolder or .npz).")],
    out: Annotated[Path, typer.Option(help="Output folder (checkpoints, metrics.jsonl).")] = Path(
        "runs/latest"
    ),
    test_data: Annotated[
        Path | None, typer.Option(help="Test dataset [default: a stratified split]")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(min=1, help="Data-parallel workers [local: one per GPU, else 2; ray: 2]"),
    ] = None,
    min_workers: Annotated[
        int | None,
        typer.Option(min=1, help="Elastic (ray): carry on with as few as this after a loss."),
    ] = None,
    compressor: Annotated[str, typer.Option(help="Comm hook: dense, topk, spardl ...")] = default(
        "compressor"
    ),
    density: Annotated[
        float,
        typer.Option(help=f"Fraction of gradient entries sent, in {field_interval('density')}."),
    ] = default("density"),
    recipe: Annotated[
        str,
        typer.Option(
            help="auto: the recipe chooses what is unset (length, learning rate by a short "
            "search, schedule, best validation checkpoint); fixed: the old defaults (3 epochs, "
            "SGD at 0.01)."
        ),
    ] = default("recipe"),
    epochs: Annotated[int | None, typer.Option(min=1, help="Unset: the recipe's length.")] = None,
    batch_size: Annotated[int, typer.Option(min=2)] = default("batch_size"),
    lr: Annotated[
        float | None,
        typer.Option(help=f"Learning rate, in {field_interval('lr')}; unset: the recipe's."),
    ] = None,
    optimizer: Annotated[
        str | None, typer.Option(help="sgd, adam or adamw; unset: the recipe's.")
    ] = None,
    max_per_class: Annotated[int | None, typer.Option(min=1)] = None,
    hook_option: Annotated[
        list[str] | None, typer.Option("--hook-option", help="NAME=VALUE (repeatable)")
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from out/checkpoint")] = False,
    seed: int = 0,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines on stdout.")] = False,
    backend: Annotated[
        str, typer.Option(help="Where the workers run: local (torchrun here) or ray (a cluster).")
    ] = "local",
    ray_address: Annotated[
        str | None, typer.Option(help="The Ray cluster's HOST:PORT (with --backend ray).")
    ] = None,
    placement: Annotated[
        str, typer.Option(help="Ray placement of the workers: PACK, SPREAD, STRICT_SPREAD ...")
    ] = Backend.placement,
    ray_start_timeout: Annotated[
        int, typer.Option(min=1, help="Seconds a (re)start of the Ray workers waits for machines.")
    ] = Backend.start_timeout,
    ray_storage: Annotated[
        str | None,
        typer.Option(
            help="Where Ray keeps the run's checkpoints: s3://bucket/key (credentials and "
            "endpoint from AWS_*), so the machines share no folder; else OUT, shared by all."
        ),
    ] = None,
    comm_triton: Annotated[
        bool,
        typer.Option(
            "--comm-triton",
            envvar="ZOOPICK_COMM_TRITON",
            help="On CUDA, select with the fused Triton kernels instead of torch.topk "
            "(the same selection, ties aside; off until measured faster).",
        ),
    ] = False,
    config_only: Annotated[
        bool,
        typer.Option(
            "--write-config",
            help="Only write the checked run config (OUT/run.json) and print its path: run "
            "python -m zoopick.training.launch --config OUT/run.json under torchrun yourself.",
        ),
    ] = False,
) -> None:
    """Fine-tune a zoo model on a dataset, data-parallel with a sparse comm hook."""
    from pydantic import ValidationError

    from zoopick.training.backends import spawn
    from zoopick.training.config import DEFAULT_WORKERS, describe
    from zoopick.training.launch import local_workers, write_config

    hook_options = _hook_options(hook_option or [])
    # reject bad input here, before any worker process starts
    try:
        where = Backend(
            kind=backend,  # type: ignore[arg-type]
            ray_address=ray_address,
            placement=placement,
            start_timeout=ray_start_timeout,
            storage=ray_storage,
        )
    except ValueError as exc:
        raise fail(str(exc)) from None
    count = workers or (local_workers() if backend == "local" else DEFAULT_WORKERS)
    try:
        cfg = FinetuneConfig(
            zoo=str(zoo),
            model=model,
            data=str(data),
            out=str(out),
            test_data=str(test_data) if test_data else None,
            max_per_class=max_per_class,
            workers=count if min_workers is None else {"min": min_workers, "max": count},
            recipe=recipe,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            optimizer=optimizer,
            compressor=compressor,
            density=density,
            hook_options=hook_options,
            seed=seed,
            resume=resume,
            comm_triton=comm_triton,
        ).with_absolute_paths()  # run.json works from any directory; a resume knows its files
    except ValidationError as exc:
        raise fail(describe(exc)) from None
    _check_run_inputs(cfg, zoo, model, data, test_data)
    if config_only:
        typer.echo(str(write_config(cfg)))
        return
    _follow_run(spawn(cfg, where), out, as_json)


def _hook_options(items: list[str]) -> dict[str, Any]:
    """``--hook-option NAME=VALUE`` flags as the hook's options (a value read as JSON where
    it is, else as text); their names and values are checked with the run's config."""
    options: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise fail(f"--hook-option {item!r}: expected NAME=VALUE")
        options[name] = json_or_text(raw)
    return options


def _check_run_inputs(
    cfg: FinetuneConfig, zoo: Path, model: str, data: Path, test_data: Path | None
) -> None:
    """Refuse a run whose model, datasets or split cannot work, before any worker starts
    (else each worker, once started, would find it)."""
    from zoopick.selection.data import DatasetError, load_dataset, load_test_data
    from zoopick.selection.zoo import ZooError, load_zoo

    try:
        load_zoo(zoo)[model]
        train = load_dataset(data, max_per_class=cfg.max_per_class)
        if test_data:
            load_test_data(test_data, data, train.class_names)
    except (ZooError, DatasetError, ValueError) as exc:
        raise fail(str(exc)) from None
    problem = cfg.feeding_problem(train.class_counts().values(), test_share=not test_data)
    if problem is not None:
        raise fail(problem)


def _follow_run(proc: subprocess.Popen[str], out: Path, as_json: bool) -> None:
    """Print a started run's records as they come (JSON lines with ``as_json``), then its
    outcome: the recipe's choice and where the model is, or the failing rank's error."""
    from zoopick.training.config import FINAL_CONFIG, FINAL_WEIGHTS, TrainerError, parse_line
    from zoopick.training.launch import run_records
    from zoopick.training.recipe import describe as recipe_line

    for record in run_records(proc):
        if as_json:
            typer.echo(record.to_json())
        elif isinstance(record, RunEvent) and record.event == "progress":
            continue  # the service's live view; the terminal shows the epochs
        elif isinstance(record, RunEvent) and record.event == "recipe":
            typer.echo(recipe_line(record.recipe or {}), err=True)
        elif isinstance(record, RunEvent):
            typer.echo(
                f"started on {record.backend} (job {record.ref})"
                if record.event == "started"
                else f"resumed after epoch {record.epoch} on {record.workers} worker(s)",
                err=True,
            )
        else:
            typer.echo(
                f"epoch {record.epoch}: loss {record.loss:.4f} "
                f"train {record.train_accuracy:.3f} test {record.test_accuracy:.3f} "
                f"sent {record.bytes_sent / 1e6:.2f} MB "
                f"(compute {record.compute_seconds:.1f}s select {record.select_seconds:.1f}s "
                f"comm {record.comm_seconds:.1f}s)"
            )
    code = proc.wait()
    err = proc.stderr.read() if proc.stderr else ""
    if code != 0:
        reasons = [r for r in map(parse_line, err.splitlines()) if isinstance(r, TrainerError)]
        raise fail(reasons[0].error if reasons else err.strip()[-500:], code=1)
    final = out / FINAL_CONFIG
    if final.is_file():  # the best validation step is known once the run ended
        chosen = json.loads(final.read_text()).get("recipe")
        if chosen and not as_json:
            typer.echo(recipe_line(chosen), err=True)
    typer.echo(f"model written to {out / FINAL_WEIGHTS}", err=True)


@app.command()
def metrics() -> None:
    """List the available metrics, the inputs each needs and its options."""
    from zoopick.selection.metrics import available, get

    for name in available():
        spec = get(name)
        opts = ", ".join(spec.options) or "-"
        typer.echo(f"{name:14s} needs {'+'.join(sorted(spec.needs)):16s} options: {opts}")
        typer.echo(f"{'':14s} {spec.summary}")


def main() -> None:
    guard_stdout()
    app()


if __name__ == "__main__":
    main()
