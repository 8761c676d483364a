"""The CLI's consoles, and tables on stdout that never cut a cell.

What the CLI prints comes in part from the server and its users (dataset and class names,
errors): a :class:`PlainConsole` shows it as it is, never as Rich markup (a name like
``[/bold]`` made ``datasets list`` fail) and never as terminal control (an escape sequence in
a name is printed as ``\x1b``, not sent to the terminal).

Rich fits a table to the console's width and cuts what does not fit with an ellipsis; when
stdout is not a terminal (a pipe, a file, a CI log) that width is a guess of 80 columns, and
ids came out as ``723adad9-c5…``, useless to the next command. Off a terminal a table is
printed at its full natural width; on a terminal, cells that do not fit fold onto more lines
instead of being cut.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

UNLIMITED = 1_000_000
"""The width a table may take off a terminal: more than any table needs."""


def visible(text: str) -> str:
    """``text`` with its control characters (but newlines and tabs) written as escapes."""
    if text.isprintable():
        return text
    return "".join(
        ch
        if ch in "\n\t" or unicodedata.category(ch) != "Cc"
        else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )


class PlainConsole(Console):
    """A console that renders strings as plain text (no markup) with control characters
    escaped (:func:`visible`); Rich's own control output (progress bars) is unaffected."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(markup=False, **kwargs)

    def render_str(self, text: str, **kwargs: Any) -> Text:
        kwargs["markup"] = False
        return super().render_str(visible(text), **kwargs)


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
    PlainConsole(file=console.file, width=UNLIMITED, soft_wrap=True, highlight=False).print(table)
