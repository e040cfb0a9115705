"""A line chart in plain text, for terminals: series of (x, y) points on one grid with a y axis."""

from __future__ import annotations

MARKERS = "*o+x#@"


def line_chart(series: dict[str, list[tuple[float, float]]], *, width: int = 60, height: int = 12) -> str:
    """``series`` (name -> points) drawn on a ``width`` x ``height`` grid, each with its own marker,
    the y range labelled on the left and a legend below; empty series are left out."""
    series = {name: points for name, points in series.items() if points}
    if not series:
        return "(nothing to chart yet)"
    xs = [x for points in series.values() for x, _ in points]
    ys = [y for points in series.values() for _, y in points]
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    grid = [[" "] * width for _ in range(height)]
    for points, marker in zip(series.values(), MARKERS):
        for x, y in points:
            col = 0 if x_hi == x_lo else round((x - x_lo) / (x_hi - x_lo) * (width - 1))
            row = height - 1 - round((y - y_lo) / (y_hi - y_lo) * (height - 1))
            grid[row][col] = marker
    labels = [f"{y_hi:8.3f} |", *([" " * 8 + " |"] * (height - 2)), f"{y_lo:8.3f} |"]
    lines = [label + "".join(row) for label, row in zip(labels, grid)]
    lines.append(" " * 9 + "+" + "-" * width)
    lines.append(" " * 10 + f"step {x_lo:g}".ljust(width - 10) + f"step {x_hi:g}")
    legend = "   ".join(f"{marker} {name}" for name, marker in zip(series, MARKERS))
    return "\n".join([*lines, " " * 10 + legend])
