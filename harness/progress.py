"""A run's progress on stderr: step, loss, reward or accuracy, tokens/s, spend and time left.

In a terminal it is a rich progress bar with a status spinner for the slow phases (starting the
session, which the first time fetches and converts the model, and each evaluation). When stderr is
not a terminal (a log file, CI, a pipe) every step, phase and evaluation is one plain line, written
as it happens, so a log shows progress while the run goes on rather than at its end.

Time left is the mean time of a training step times the steps left, plus the last evaluation's time
times the evaluations left. A step's time leaves out the slow phases around it (starting the
session, evaluating), and once a second step is measured the first one, which carries the warm-up,
is left out too. Spend is what the run's session has used so far and the projection for the whole
run (tokens, and cost where the engine has prices; :mod:`.spend`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.progress import Progress as RichProgress

SHOWN = (("loss", "loss"), ("reward/mean", "reward"), ("accuracy", "acc"), ("margin", "margin"))
EVAL_SHOWN = ("eval/accuracy", "eval/loss", "eval/margin", "eval/reward")


class Progress:
    def __init__(
        self, cfg, steps: int, start_step: int, *, enabled: bool = True, console: Console | None = None
    ):
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self.plain = not self.console.is_terminal
        self.title = f"{cfg.loop.name} {cfg.model.name}"
        self.total = steps
        self.start_step = start_step
        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TextColumn("[progress.remaining]{task.fields[left]}"),
            console=self.console,
            disable=not enabled or self.plain,
        )
        self._task = None
        self._last = time.perf_counter()
        self._eval = ""
        self.eval_every = cfg.loop.get("eval_every") or 0
        self._phases_s = 0.0  # seconds spent in slow phases since the last step ended
        self._steps_s: list[float] = []  # each measured training step's own seconds
        self._eval_s: float | None = None  # the last evaluation's seconds

    def __enter__(self) -> Progress:
        self._bar.__enter__()
        self._task = self._bar.add_task(
            self.title, total=self.total, completed=self.start_step, stats="", left=""
        )
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def _line(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stderr if self.console.stderr else sys.stdout, flush=True)

    @contextlib.contextmanager
    def status(self, message: str) -> Iterator[None]:
        """A slow phase: a spinner in a terminal, a line before and after otherwise."""
        started = time.perf_counter()
        try:
            if not self.enabled:
                yield
            elif self.plain:
                self._line(f"{self.title}: {message} ...")
                yield
                self._line(f"{self.title}: {message}: done in {time.perf_counter() - started:.1f} s")
            else:
                with self.console.status(message):
                    yield
        finally:
            self._phases_s += time.perf_counter() - started  # not a step's time

    def note(self, text: str) -> None:
        """A line for the user (shown even with the bar off: it answers something they did)."""
        if self.plain or not self.enabled:
            print(text, file=sys.stderr, flush=True)
        else:
            self.console.print(text, highlight=False, markup=False)

    def update(self, done: int, row: dict) -> None:
        now = time.perf_counter()
        seconds = max(now - self._last - self._phases_s, 1e-9)
        self._last, self._phases_s = now, 0.0
        self._steps_s.append(seconds)
        parts = [f"{label} {row[key]:.3f}" for key, label in SHOWN if key in row]
        if row.get("tokens"):
            parts.append(f"{row['tokens'] / seconds:.0f} tok/s")
        if "spend/projected_tokens" in row:  # the runner's spend meter (:mod:`.spend`)
            parts.append(spend_text(row))
        left = self.seconds_left(done)
        if self.plain:
            self._line(f"{self.title} step {done}/{self.total}  {'  '.join(parts)}  ({left:.0f} s left)")
            return
        self._bar.update(
            self._task, completed=done, stats="  ".join(parts) + self._eval, left=f"{left:.0f} s left"
        )

    def seconds_left(self, done: int) -> float:
        """The run's remaining seconds after ``done`` steps: steps and evaluations to come."""
        measured = self._steps_s[1:] or self._steps_s  # the first step carries the warm-up
        per_step = sum(measured) / len(measured) if measured else 0.0
        # the runner evaluates after each multiple of eval_every below total (this one too), and at the end
        evals = 1 + sum(1 for k in range(done, self.total) if self.eval_every and k % self.eval_every == 0)
        return per_step * max(self.total - done, 0) + (self._eval_s or 0.0) * evals

    def note_eval(self, done: int, metrics: dict) -> None:
        self._eval_s = metrics.get("eval/seconds", self._eval_s)
        key = next((k for k in EVAL_SHOWN if k in metrics), None)
        if key is not None:
            se = f" ± {metrics[key + '_se']:.3f}" if key + "_se" in metrics else ""
            self._eval = f"  [cyan]eval@{done} {key[5:]} {metrics[key]:.3f}{se}[/cyan]"
        shown = {
            k[5:]: round(v, 4) for k, v in metrics.items() if k.startswith("eval/") and k != "eval/seconds"
        }
        if self.plain:
            self._line(f"{self.title} eval at step {done}: {shown}")
        elif self.enabled:
            self._bar.console.print(f"eval at step {done}: {shown}", highlight=False)


def spend_text(row: dict) -> str:
    """A step's spend so far and the run's projected total: tokens, and cost where priced."""
    text = f"spent {row['spend/tokens']} of ~{row['spend/projected_tokens']} tok"
    if row.get("spend/projected_cost") is not None:
        text += f" ({row['spend/cost']} of ~{row['spend/projected_cost']})"
    return text
