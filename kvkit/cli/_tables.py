"""Tables on stdout that never cut a name or a number, at any width, on a terminal or not.

A column made with ``no_wrap=True`` holds names and numbers: each of its cells
(and its header lines) is shown whole, never wrapped or elided. Where the
console (the terminal, or ``COLUMNS``, or 80 off a terminal) is narrower than
those columns need, the table is printed at the width it needs instead: the
lines run longer, nothing is lost. Other columns wrap at spaces, as prose does.
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

__all__ = ["print_table"]

_UNBOUNDED = 1 << 16  # measure the table free of the console's width, then widen the console if needed


def _whole_width(cell: object, console: Console) -> int:
    text = console.render_str(cell) if isinstance(cell, str) else cell
    if not isinstance(text, Text):
        return 0  # another renderable measures itself
    return max((line.cell_len for line in text.split()), default=0)


def print_table(table: Table, console: Console | None = None) -> Console:
    """Print ``table`` with every ``no_wrap`` cell whole; returns the console (on stdout by default)."""
    console = console or Console()
    for column in table.columns:
        if column.no_wrap:
            column.min_width = max([column.min_width or 0, _whole_width(column.header, console),
                                    *(_whole_width(cell, console) for cell in column.cells)])
    need = Measurement.get(console, console.options.update_width(_UNBOUNDED), table).minimum
    if need > console.width:
        console.width = need
    console.print(table)
    return console
