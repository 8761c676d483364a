"""``zoopick storage init|copy``: the object store's setup commands (``service.store_setup``).

``init`` makes the configured store ready (its bucket created if missing: compose runs it
once before the API and workers start); ``copy FOLDER`` moves an existing deployment's local
store folder into the configured store (``ZOOPICK_STORAGE_URL``, e.g. ``s3://bucket/prefix``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zoopick.service.settings import get_settings

storage_app = typer.Typer(help="Set up the object store and move files into it.",
                          no_args_is_help=True)  # fmt: skip


@storage_app.command("init")
def init(
    wait: Annotated[
        float, typer.Option(min=0, help="Seconds to wait for a store that is still starting.")
    ] = 60.0,
) -> None:
    """Make the store of ZOOPICK_STORAGE_URL ready: its S3 bucket created if missing (the
    AWS_* variables give the endpoint and credentials), or its folder made."""
    from zoopick.service import store_setup
    from zoopick.service.storage import StoreUnavailable, open_store

    settings = get_settings()
    try:
        typer.echo(store_setup.prepare(open_store(settings.storage_url), wait_seconds=wait))
    except StoreUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


@storage_app.command("copy")
def copy(
    folder: Annotated[
        Path,
        typer.Argument(
            exists=True,
            file_okay=False,
            help="The local store folder to copy from (the old <data_dir>/storage).",
        ),
    ],
) -> None:
    """Copy a local store folder's objects into the store of ZOOPICK_STORAGE_URL, under the
    same keys. Objects already there at the same size are left alone: run it again after a
    failure, and once more after stopping the old deployment."""
    from zoopick.service import store_setup
    from zoopick.service.storage import LocalStore, StoreError, open_store

    settings = get_settings()
    dest = open_store(settings.storage_url)
    source = LocalStore(folder.resolve())
    if isinstance(dest, LocalStore) and dest.root.resolve() == source.root:
        typer.echo(f"error: {folder} is already the store of ZOOPICK_STORAGE_URL", err=True)
        raise typer.Exit(2)
    try:
        done = store_setup.copy(source, dest, progress=lambda key: typer.echo(f"copied {key}"))
    except StoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"{done.copied} objects copied ({done.bytes} bytes), {done.skipped} already in {dest.name}"
    )


__all__ = ["storage_app"]
