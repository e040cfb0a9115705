"""How the CLI prints: messages that never wrap mid-sentence, tables whose names and numbers stay whole.

Consoles here soft-wrap: a message is one line however narrow the terminal (the terminal folds it,
rich never inserts a newline), so a log or a pipe gets the sentence whole. A table in a terminal is
rich's, its cells folded onto further lines where they do not fit, never cut with an ellipsis;
without a terminal (a pipe, a log, CI) it is tab-separated plain text, every cell whole, so names
copy and ``cut -f`` works.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

out = Console(soft_wrap=True)


def print_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    title: str | None = None,
    bold_last: bool = False,
    console: Console | None = None,
) -> None:
    """``rows`` under ``headers``: rich's table in a terminal, every column folding what does not
    fit onto the next line (never cut, never cropped); tab-separated lines otherwise (a ``title``
    as a ``# title`` line above them)."""
    console = console or out
    cells = [[str(c) for c in row] for row in rows]
    if not console.is_terminal:
        if title:
            print(f"# {title}", file=console.file)
        for row in [list(headers), *cells]:
            print("\t".join(row), file=console.file)
        return
    table = Table(title=title)
    for header in headers:
        table.add_column(header, overflow="fold")
    for k, row in enumerate(cells):
        table.add_row(*row, style="bold" if bold_last and k == len(cells) - 1 else None)
    console.print(table)
