"""How the CLI prints: messages that never wrap mid-sentence, tables whose names and numbers stay whole.

Consoles here soft-wrap: a message is one line however narrow the terminal (the terminal folds it,
rich never inserts a newline), so a log or a pipe gets the sentence whole. A table in a terminal is
rich's, with its name and path columns folded, never cut with an ellipsis; without a terminal (a
pipe, a log, CI) it is tab-separated plain text, every cell whole, so names copy and ``cut -f`` works.
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
    whole: Sequence[int] = (0,),
    title: str | None = None,
    bold_last: bool = False,
    console: Console | None = None,
) -> None:
    """``rows`` under ``headers``: rich's table in a terminal (columns ``whole`` folded, never cut),
    tab-separated lines otherwise (a ``title`` as a ``# title`` line above them)."""
    console = console or out
    cells = [[str(c) for c in row] for row in rows]
    if not console.is_terminal:
        if title:
            print(f"# {title}", file=console.file)
        for row in [list(headers), *cells]:
            print("\t".join(row), file=console.file)
        return
    table = Table(title=title)
    for i, header in enumerate(headers):
        if i in whole:
            longest = max((len(row[i]) for row in cells), default=len(header))
            table.add_column(header, overflow="fold", min_width=max(len(header), longest))
        else:
            table.add_column(header)
    for k, row in enumerate(cells):
        table.add_row(*row, style="bold" if bold_last and k == len(cells) - 1 else None)
    console.print(table)
