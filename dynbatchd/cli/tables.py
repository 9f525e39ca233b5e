"""Tables that fit the terminal: columns dropped by rank until the table fits, `--wide` keeps all.

Every command's human output fits 80 columns. A column is ``(header, rank)``: rank 0 always
stays; when the table is wider than the console, the highest rank goes first (the later
column of a tie first), and a caption says how many are hidden. Cells never wrap or get
cut: a value is shown whole or its column is hidden. With ``wide`` every column stays and
`show` prints the table as wide as it needs, past the terminal's edge if it must.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table

Column = tuple[str, int]   # (header, rank): 0 always kept, the highest dropped first


def natural_width(console: Console, renderable: RenderableType) -> int:
    """How wide `renderable` is when nothing limits it."""
    return Measurement.get(console, console.options.update_width(1 << 16), renderable).maximum


def fit_table(title: str | None, columns: Sequence[Column], rows: Iterable[Sequence[str]], console: Console,
              wide: bool = False, *, left: Iterable[str] = (), width: int | None = None, **table_kw: Any) -> Table:
    """A table of `rows` (one string per column, markup allowed) that fits `width` (default: the
    console's) by hiding the highest-ranked columns; `wide` keeps them all."""
    rows = [list(r) for r in rows]
    left = set(left)
    limit = None if wide else (width or console.width)
    kept = list(range(len(columns)))
    order = sorted((i for i, (_, rank) in enumerate(columns) if rank > 0), key=lambda i: (-columns[i][1], -i))

    def build() -> Table:
        hidden = len(columns) - len(kept)
        table = Table(title=title, caption=f"{hidden} column{'s' * (hidden > 1)} hidden: --wide shows all"
                      if hidden else None, **table_kw)
        for i in kept:
            header = columns[i][0]
            table.add_column(header, justify="left" if header in left else "right", no_wrap=True)
        for r in rows:
            table.add_row(*(r[i] for i in kept))
        return table

    table = build()
    while limit is not None and order and natural_width(console, table) > limit:
        kept.remove(order.pop(0))
        table = build()
    return table


def show(console: Console, renderable: RenderableType, wide: bool = False) -> None:
    """Print `renderable`; with `wide`, on a console as wide as it needs (never cut at the edge)."""
    if not wide:
        console.print(renderable)
        return
    need = natural_width(console, renderable)
    if need <= console.width:
        console.print(renderable)
        return
    Console(file=console.file, width=need, color_system=console.color_system and "auto",
            force_terminal=console.is_terminal).print(renderable)


WIDE_HELP = "Show every column of the tables, however wide (by default they fit the terminal)."
