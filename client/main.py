"""The ``zoopick-client`` command: the client's commands alone (``datasets``, ``jobs``,
``model``, ``zoo``), for the light ``zoopick-client`` distribution (client/pyproject.toml),
which has neither the service nor the libraries. With the full distribution, the same
commands are part of ``zoopick``."""

from __future__ import annotations

import typer

from .cli import add_version_option, guard_stdout, register

app = typer.Typer(
    name="zoopick-client",
    help="Talk to a zoopick server: upload datasets, submit and follow jobs, download models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
register(app)
# the light distribution installs this package as zoopick_client; the full one ships the same
# file as zoopick.client.main
add_version_option(
    app, "zoopick-client", "zoopick-client" if __package__ == "zoopick_client" else "zoopick"
)


def main() -> None:
    guard_stdout()
    app()
