"""``sess runs seeds RUN...``: held-out accuracy before and after each run, with the mean and spread.

The seed sweep's table: run the same job with several seeds (``for s in 0 1 2; do sess run seed=$s
[overrides]; done``), then ``sess runs seeds`` over those runs prints, per run, its seed, the
held-out accuracy of its first and last evaluation with the standard error ``sqrt(p(1-p)/n)`` and
``n``, and the gain; then the mean and the spread (sample standard deviation over runs) of each
column. A gain smaller than about twice its standard error is within noise.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import typer

from sess.cli.output import out, print_table
from sess.cli.runs_cmds import RUNS_DIR, find_run, run_summary, runs_app

HEADLINE = "eval/accuracy"


def accuracy_text(row: dict | None, key: str = HEADLINE) -> str:
    """``0.625 ± 0.061 (n=64)`` for an eval row; its standard error from the row or from ``n``."""
    if not row or key not in row:
        return ""
    p, n = row[key], row.get("eval/n")
    se = row.get(f"{key}_se")
    if se is None and n:
        se = math.sqrt(p * (1 - p) / n)
    return f"{p:.3f}" + (f" ± {se:.3f}" if se is not None else "") + (f" (n={n})" if n else "")


def before_after(path: Path) -> tuple[dict | None, dict | None]:
    """The run's first and last eval rows that carry held-out accuracy."""
    evals = [r for r in run_summary(path)["eval"] if HEADLINE in r]
    return (evals[0], evals[-1]) if evals else (None, None)


def summary_line(path: Path) -> str:
    """The line a finished run ends with: held-out accuracy before → after, ± standard error."""
    before, after = before_after(path)
    if before is None or after is None:
        return ""
    return f"held-out accuracy {accuracy_text(before)} → {accuracy_text(after)}"


@runs_app.command("seeds")
def seeds(
    runs: list[str] = typer.Argument(..., help="Run directories or names, e.g. one run per seed."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Held-out accuracy before and after each run (± standard error, n), then the mean and the
    spread (sample standard deviation) over the runs: the table of a seed sweep."""
    rows, columns = [], ([], [], [])
    for run in runs:
        path = find_run(run, runs_dir)
        found = run_summary(path)
        before, after = before_after(path)
        seed = found["config"].get("seed", found["meta"].get("seed"))
        if before is None or after is None:
            rows.append((path.name, str(seed), "", "", "", "no held-out accuracy"))
            continue
        gain = after[HEADLINE] - before[HEADLINE]
        for column, value in zip(columns, (before[HEADLINE], after[HEADLINE], gain)):
            column.append(value)
        steps = found["train"][-1]["step"] if found["train"] else 0
        rows.append(
            (path.name, str(seed), accuracy_text(before), accuracy_text(after), f"{gain:+.3f}", str(steps))
        )
    if columns[0]:
        cells = [_mean_spread(c, signed=i == 2) for i, c in enumerate(columns)]
        rows.append((f"mean ± spread ({len(columns[0])} runs)", "", *cells, ""))
    print_table(("run", "seed", "before", "after", "gain", "steps"), rows, title="held-out accuracy")
    if len(columns[0]) < 2:
        out.print("the spread needs at least two runs with held-out accuracy", highlight=False)


def _mean_spread(values: list[float], signed: bool = False) -> str:
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:+.3f} ± {spread:.3f}" if signed else f"{mean:.3f} ± {spread:.3f}"
