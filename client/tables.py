"""Tables on stdout that never cut a cell.

Rich fits a table to the console's width and cuts what does not fit with an ellipsis; when
stdout is not a terminal (a pipe, a file, a CI log) that width is a guess of 80 columns, and
ids came out as ``723adad9-c5…``, useless to the next command. Off a terminal a table is
printed at its full natural width; on a terminal, cells that do not fit fold onto more lines
instead of being cut.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

UNLIMITED = 1_000_000
"""The width a table may take off a terminal: more than any table needs."""


def table(*headers: str, title: str | None = None) -> Table:
    """A table whose cells fold instead of being cut when the terminal is too narrow."""
    out = Table(title=title)
    for header in headers:
        out.add_column(header, overflow="fold")
    return out


def show(console: Console, table: Table) -> None:
    """Print ``table`` on ``console``: fitted to a terminal, at its full width elsewhere."""
    if console.is_terminal:
        console.print(table)
        return
    # the console caps any width given to print() at its own: print through a wide one
    Console(file=console.file, width=UNLIMITED, soft_wrap=True, highlight=False).print(table)
