"""The rich progress line of a run: step, loss, reward or accuracy, tokens/s and ETA."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, cfg, start_step: int, *, enabled: bool = True):
        self.enabled = enabled
        self.console = Console(stderr=True)
        self.title = f"{cfg.loop.name} {cfg.model.name}"
        self.total = cfg.loop.steps
        self.start_step = start_step
        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not enabled,
        )
        self._task = None
        self._last = time.perf_counter()
        self._eval = ""

    def __enter__(self) -> Progress:
        self._bar.__enter__()
        self._task = self._bar.add_task(self.title, total=self.total, completed=self.start_step, stats="")
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def update(self, done: int, row: dict) -> None:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        parts = []
        for key, label in (
            ("loss", "loss"),
            ("reward/mean", "reward"),
            ("accuracy", "acc"),
            ("margin", "margin"),
        ):
            if key in row:
                parts.append(f"{label} {row[key]:.3f}")
        if row.get("tokens"):
            parts.append(f"{row['tokens'] / max(seconds, 1e-9):.0f} tok/s")
        stats = "  ".join(parts) + self._eval
        self._bar.update(self._task, completed=done, stats=stats)

    def note_eval(self, done: int, metrics: dict) -> None:
        for key in ("eval/accuracy", "eval/loss", "eval/margin"):
            if key in metrics:
                self._eval = f"  [cyan]eval@{done} {key[5:]} {metrics[key]:.3f}[/cyan]"
                break
        if self.enabled:
            shown = {k[5:]: round(v, 4) for k, v in metrics.items() if k != "eval/seconds"}
            self._bar.console.print(f"eval at step {done}: {shown}", highlight=False)
