"""The ``zoopick-client`` command: the client's commands alone (``datasets``, ``jobs``,
``model``, ``zoo``), for the light ``zoopick-client`` distribution (client/pyproject.toml),
which has neither the service nor the libraries. With the full distribution, the same
commands are part of ``zoopick``."""

from __future__ import annotations

import typer

from .cli import guard_stdout, register

app = typer.Typer(
    name="zoopick-client",
    help="Talk to a zoopick server: upload datasets, submit and follow jobs, download models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
register(app)


def main() -> None:
    guard_stdout()
    app()
