"""What a loop reports to whoever runs it: one call after each optimizer step.

A loop calls ``hooks.step_done(step, metrics)`` after step ``step`` (0-based) with that step's numbers.
The runner (``sess run``) implements it to write ``metrics.jsonl``, update the progress line,
evaluate when ``loop.eval_every`` says so and save state when ``loop.save_every`` says so; a bare
script passes :class:`PrintMetrics` (or anything with that method) and gets a line per step.
"""

from __future__ import annotations

from typing import Protocol


class Hooks(Protocol):
    def step_done(self, step: int, metrics: dict[str, float]) -> None: ...


class PrintMetrics:
    """Hooks for a bare script: print each step's metrics, keep them in ``rows``."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append({"step": step + 1, **metrics})
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        print(f"step {step + 1}: {shown}", flush=True)
