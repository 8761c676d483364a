"""Service commands, mounted into the ``zoopick`` CLI: ``serve``, ``worker``, ``migrate``,
``sweep``, ``keys create|list|revoke``, ``storage init|copy`` (``zoopick.storage_cli``).

``zoopick serve`` on defaults needs nothing installed beyond Python: SQLite and a file-system
broker in ``.zoopick/data``, the API and one local worker process. With
``ZOOPICK_DATABASE_URL=postgresql+psycopg://...`` and ``ZOOPICK_BROKER_URL=redis://...`` the same
commands run distributed: ``zoopick serve --no-worker`` on one machine, ``zoopick worker
--queues gpu`` on each GPU machine.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from zoopick.service.processes import LOCAL_WORKER_NICE
from zoopick.service.queue import QUEUES, worker_argv
from zoopick.service.settings import Settings, get_settings
from zoopick.storage_cli import storage_app

service_app = typer.Typer(
    help="Run the web service and its workers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
keys_app = typer.Typer(help="Manage API keys.", no_args_is_help=True)
service_app.add_typer(keys_app, name="keys")
service_app.add_typer(storage_app, name="storage")

LOCAL_TENANT = "local"
KEY_FILE = "api-key"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
WORKER_STOP_GRACE_SECONDS = 20.0
"""How long ``serve`` lets its worker finish a short task (a warm shutdown) before killing
it, at most ``ZOOPICK_SHUTDOWN_GRACE_SECONDS``, counted from the stop signal (the API drains
meanwhile); a re-delivered or swept task redoes whatever was cut off."""


class ServerStopped(Exception):
    """A stop signal arrived (after uvicorn's own graceful shutdown)."""


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise ServerStopped(signal.Signals(signum).name)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def bootstrap(settings: Settings, *, demo: bool, local_key: bool = True) -> str | None:
    """Migrate, sync the zoo, and on first start create the local admin key. Returns the
    local key when one is on file (the embedded single-user case)."""
    from sqlalchemy import func, select

    from zoopick.service import zoo_catalog
    from zoopick.service.db import migrate
    from zoopick.service.db.models import ApiKey, ZooModel
    from zoopick.service.db.session import make_engine, make_sessionmaker, session_scope
    from zoopick.service.security import create_api_key

    settings.ensure_dirs()
    migrate.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    factory = make_sessionmaker(engine)
    key_file = settings.data_dir / KEY_FILE
    try:
        with session_scope(factory) as session:
            if settings.zoo_manifest is not None:
                ids = zoo_catalog.sync_manifest(session, settings.zoo_manifest, settings)
                typer.echo(f"zoo: {len(ids)} models from {settings.zoo_manifest}", err=True)
            elif demo and not session.scalar(select(func.count()).select_from(ZooModel)):
                from zoopick.selection.demo import build_demo

                folder = settings.data_dir / "demo"
                typer.echo(f"zoo is empty: building the demo zoo in {folder} ...", err=True)
                manifest, target = build_demo(folder)
                ids = zoo_catalog.sync_manifest(session, Path(manifest), settings)
                typer.echo(f"zoo: {len(ids)} demo models; a demo dataset: {target}", err=True)
            if local_key and not session.scalar(select(func.count()).select_from(ApiKey)):
                _, token = create_api_key(session, tenant=LOCAL_TENANT, name="local", admin=True)
                key_file.write_text(token + "\n")
                key_file.chmod(0o600)
    finally:
        engine.dispose()
    return key_file.read_text().strip() if key_file.exists() else None


def wants_demo(settings: Settings, asked: bool | None) -> bool:
    """Whether ``serve`` builds the demo zoo into an empty zoo: as asked (``--demo`` or
    ``--no-demo``), else only for the embedded single-user service (SQLite and the file
    broker, ``zoopick serve`` on its defaults). A production deployment's first start (its own
    database) once got the demo's toy models in its zoo, among the models every job of
    ``"models": "all"`` scores."""
    if asked is not None:
        return asked
    return settings.database_url.startswith("sqlite") and settings.embedded_broker


SETTINGS_EPILOG = (
    "Everything else is set by ZOOPICK_* environment variables, the same for the API and its "
    "workers: the settings reference (docs/operations/settings.md) lists each with its default."
)


@service_app.command(epilog=SETTINGS_EPILOG)
def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    worker: Annotated[
        bool, typer.Option("--worker/--no-worker", help="Also run a local worker process.")
    ] = True,
    concurrency: Annotated[int, typer.Option(min=1, help="Local worker processes.")] = 2,
    worker_nice: Annotated[
        int,
        typer.Option(
            "--worker-nice",
            min=0,
            max=19,
            help="How much lower the local worker's CPU priority is than the API's (nice): a "
            "busy worker then leaves the cores to requests; 0 runs it at the API's.",
        ),
    ] = LOCAL_WORKER_NICE,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=1,
            help="API server processes (uvicorn workers); about one per core in production.",
        ),
    ] = 1,
    demo: Annotated[
        bool | None,
        typer.Option(
            "--demo/--no-demo",
            help="Build the demo zoo (toy models and a dataset) if the zoo is empty. Default: "
            "only on the embedded defaults (SQLite and the file broker), never on a "
            "production database.",
            show_default=False,
        ),
    ] = None,
    local_key: Annotated[
        bool,
        typer.Option(
            "--local-key/--no-local-key",
            help="On first start, create an admin key and keep it in the data folder.",
        ),
    ] = True,
) -> None:
    """Run the API and a local worker (migrates the database first).

    On the first start it creates a local admin API key and prints it.
    """
    from zoopick.serving import LocalWorker, run_api

    settings = get_settings()
    key = bootstrap(settings, demo=wants_demo(settings, demo), local_key=local_key)
    _announce(settings, f"http://{host}:{port}", key)
    # the worker's warm shutdown gets at most the API's drain, both from the stop signal
    grace = min(WORKER_STOP_GRACE_SECONDS, settings.shutdown_grace_seconds)
    local = LocalWorker(settings, concurrency, worker_nice, grace) if worker else None
    # uvicorn answers SIGTERM/SIGINT by shutting down, then re-raises the signal to the handler
    # that was installed before it: make that handler an exception, so the ``finally`` below
    # runs and stops the worker (with the default handler the process would die on the spot
    # and leave the worker and its pool running)
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in STOP_SIGNALS}
    try:
        if local is not None:
            local.start()
        run_api(settings, host, port, workers, on_stop=local.begin_stop if local else _nothing)
    except ServerStopped:
        pass
    finally:
        if local is not None:
            local.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _nothing() -> None:
    """What a stop signal starts besides the API's drain when there is no local worker."""


def _announce(settings: Settings, url: str, key: str | None) -> None:
    typer.echo(f"zoopick: serving {url}  (API docs: {url}/docs)", err=True)
    typer.echo(f"database: {settings.database_url}", err=True)
    typer.echo(f"broker:   {settings.broker_url}", err=True)
    if key:
        typer.echo(f"API key:  {key}  (kept in {settings.data_dir / KEY_FILE})", err=True)


@service_app.command("worker", epilog=SETTINGS_EPILOG)
def worker_cmd(
    queues: Annotated[
        str, typer.Option(help="Comma-separated: cpu (with webhooks), gpu, webhooks.")
    ] = "cpu,gpu",
    concurrency: Annotated[int, typer.Option(min=1, help="Processes (1 per GPU).")] = 1,
    pool: Annotated[str, typer.Option(help="Celery pool: prefork, solo, threads.")] = "prefork",
    loglevel: Annotated[str, typer.Option()] = "info",
    hostname: Annotated[
        str | None, typer.Option(help="Celery node name [zoopick-<queues>@<host>].")
    ] = None,
) -> None:
    """Run a Celery worker on the given queues.

    On a GPU machine run one per GPU, concurrency 1, with CUDA_VISIBLE_DEVICES set.
    """
    bad = set(queues.split(",")) - set(QUEUES)
    if bad or not queues:
        raise _fail(f"unknown queue(s) {sorted(bad)}; use cpu, gpu, webhooks or a list")
    get_settings().ensure_dirs()
    os.execv(sys.executable, worker_argv(queues, concurrency, pool, loglevel, hostname))


@service_app.command()
def migrate(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Bring the database schema to ``revision`` (head by default)."""
    from zoopick.service.db import migrate as mig

    settings = get_settings()
    settings.ensure_dirs()
    mig.upgrade(settings.database_url, revision)
    typer.echo(f"database at {', '.join(sorted(mig.current_heads(settings.database_url)))}")


@service_app.command()
def sweep() -> None:
    """Re-queue, fail or cancel lost jobs once (the API also does this every minute).

    A job is lost when its training lease expired or it made no progress for longer than the
    longest hard time limit (ZOOPICK_STALL_SECONDS); see ZOOPICK_RECOVERY_ATTEMPTS.
    """
    from sqlalchemy.exc import DBAPIError

    from zoopick.service.recovery import sweep_once

    settings = get_settings()
    _require_tables(settings.database_url, "jobs")
    try:
        actions = sweep_once(settings)
    except DBAPIError as exc:  # e.g. a schema older than the code: one line, no traceback
        raise _fail(
            f"the sweep failed on the database: {_first_line(exc.orig)} "
            "(if the schema is behind this zoopick, run `zoopick migrate`)"
        ) from None
    for a in actions:
        typer.echo(f"{a.action:9s} {a.job_id}  {a.reason}")
    typer.echo(f"{len(actions)} lost job(s) handled", err=True)


def _first_line(exc: BaseException | None) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _require_tables(url: str, table: str) -> None:
    """Exit with one line, not SQLAlchemy's traceback, when the database at ``url`` cannot be
    reached or has no ``table`` (never migrated)."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import DBAPIError

    from zoopick.service.db.session import make_engine

    engine = make_engine(url)
    try:
        present = inspect(engine).has_table(table)
    except DBAPIError as exc:
        raise _fail(f"cannot read the database: {_first_line(exc.orig)}") from None
    finally:
        engine.dispose()
    if not present:
        raise _fail("the database has no tables yet: run `zoopick migrate` first")


def _factory():
    from zoopick.service.db.session import make_engine, make_sessionmaker

    url = get_settings().database_url
    _require_tables(url, "api_keys")
    engine = make_engine(url)
    return engine, make_sessionmaker(engine)


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Option(help="A label for the key, e.g. ci.")],
    tenant: Annotated[
        str | None, typer.Option(help="Tenant the key acts for (created if new); default: name.")
    ] = None,
    admin: Annotated[bool, typer.Option(help="May register zoo models.")] = False,
) -> None:
    """Create an API key; prints the token (shown once, only its hash is stored)."""
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import create_api_key

    engine, factory = _factory()
    try:
        with session_scope(factory) as session:
            key, token = create_api_key(session, tenant=tenant or name, name=name, admin=admin)
            typer.echo(f"created key {key.prefix}... for tenant {tenant or name!r}", err=True)
    finally:
        engine.dispose()
    typer.echo(token)


@keys_app.command("list")
def keys_list() -> None:
    """List keys (prefix, name, tenant, admin, revoked)."""
    from sqlalchemy import select

    from zoopick.service.db.models import ApiKey, Tenant

    engine, factory = _factory()
    try:
        with factory() as session:
            rows = session.execute(
                select(ApiKey, Tenant.name).join(Tenant).order_by(ApiKey.created_at)
            )
            for key, tenant in rows:
                flags = ("admin " if key.is_admin else "") + ("revoked" if key.revoked_at else "")
                typer.echo(f"{key.prefix}...  {key.name:20s} tenant={tenant:20s} {flags}")
    finally:
        engine.dispose()


@keys_app.command("revoke")
def keys_revoke(prefix: Annotated[str, typer.Argument(help="The key's prefix (zp_...).")]) -> None:
    """Revoke the key(s) whose prefix is given."""
    from sqlalchemy import select

    from zoopick.service.db.models import ApiKey
    from zoopick.service.db.session import session_scope
    from zoopick.service.db.types import utcnow

    engine, factory = _factory()
    try:
        with session_scope(factory) as session:
            keys = list(session.scalars(select(ApiKey).where(ApiKey.prefix == prefix[:11])))
            if not keys:
                raise _fail(f"no key with prefix {prefix!r}")
            for key in keys:
                key.revoked_at = key.revoked_at or utcnow()
    finally:
        engine.dispose()
    typer.echo(f"revoked {len(keys)} key(s)")
