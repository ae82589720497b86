"""Tables that fit the terminal: columns packed into as many Rich tables as the width needs.

Rich shrinks a table wider than the console by cutting cells with an ellipsis ("319.…"), which
loses the numbers a table exists to show. Here every column keeps its natural width: the key
columns (e.g. the strategy) start each table, and the other columns, in priority order, fill a
table until the next one would pass the width; the rest go to a second table under it. With
``width=None`` everything goes into one table (``--wide``). Cells fold rather than cut, so even
a console narrower than one column never prints an ellipsis.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

from rich import box
from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Column:
    """One column: its header (may hold a line break to stay narrow), cells, and alignment."""

    header: str
    cells: list[str] = field(default_factory=list)
    justify: str = "right"


def _table(title: str | None, columns: list[Column], nrows: int, width: int | None = None) -> Table:
    # min_width: a table narrower than its title would wrap the title; widen it (never past width)
    min_width = min(len(title), width or len(title)) if title else None
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
              min_width=min_width)
    for col in columns:
        t.add_column(col.header, justify=col.justify, no_wrap=True, overflow="fold")  # type: ignore[arg-type]
    for i in range(nrows):
        t.add_row(*(col.cells[i] for col in columns))
    return t


def table_width(table: Table) -> int:
    """Columns ``table`` needs to print without wrapping or cutting any cell (title excluded)."""
    probe = Console(width=10_000, file=io.StringIO())
    return probe.measure(table).maximum


def fit_tables(title: str | None, key: list[Column], columns: list[Column], width: int | None) -> list[Table]:
    """Tables holding ``key`` + ``columns`` (in this order), each at most ``width`` columns wide.

    Args:
        title: printed above the first table (a later one gets "(continued)").
        key: columns repeated at the left of every table (row labels).
        columns: the other columns, most important first; all have as many cells as ``key[0]``.
        width: console columns; None puts everything in one table.

    Returns:
        one table when all fit, else two or more; a column wider than ``width`` on its own still
        gets a table (its cells fold, they are never cut).
    """
    nrows = len(key[0].cells) if key else len(columns[0].cells)
    groups: list[list[Column]] = [[]]
    for col in columns:
        trial = groups[-1] + [col]
        if width is not None and groups[-1] and table_width(_table(None, key + trial, nrows)) > width:
            groups.append([col])
        else:
            groups[-1] = trial
    out = []
    for i, group in enumerate(groups):
        head = title if i == 0 or title is None else f"{title} (cont.)"
        out.append(_table(head, key + group, nrows, width))
    return out
