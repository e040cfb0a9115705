"""Warnings that a policy is collapsing, from the metrics a run already records.

Two signs, each a line in the run's progress output and a ``warning`` in the step's or the
evaluation's metrics row (and in ``meta.json``'s ``warnings``):

- the sampled-token entropy (``entropy/sampled_mc``, the Monte-Carlo estimate from the sampler's
  logprobs) falls below :data:`ENTROPY_FLOOR` nats per token: the policy answers nearly
  deterministically and stops exploring, so groups stop disagreeing and the gradient vanishes;
- held-out accuracy (``eval/accuracy``) falls below the best so far by more than twice the standard
  error of the difference, ``2 * sqrt(se_best^2 + se_now^2)`` with ``se = sqrt(p(1-p)/n)``: a drop that
  noise on ``eval/n`` problems does not explain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ENTROPY_FLOOR = 0.01  # nats per sampled token; the default run (short answers) goes down to about 0.017


@dataclass
class CollapseWatch:
    best: tuple[int, float, float] | None = None  # (step, accuracy, its standard error)

    def after_step(self, step: int, metrics: dict) -> str | None:
        entropy = metrics.get("entropy/sampled_mc")
        if entropy is None or entropy >= ENTROPY_FLOOR:
            return None
        return (
            f"policy collapse? sampled-token entropy {entropy:.4f} nats at step {step} is below "
            f"the floor {ENTROPY_FLOOR}: the policy barely explores"
        )

    def after_eval(self, step: int, metrics: dict) -> str | None:
        accuracy, n = metrics.get("eval/accuracy"), metrics.get("eval/n")
        if accuracy is None or not n:
            return None
        se = math.sqrt(accuracy * (1 - accuracy) / n)
        warning = None
        if self.best is not None:
            best_step, best, best_se = self.best
            noise = 2 * math.sqrt(best_se**2 + se**2)
            if best - accuracy > noise:
                warning = (
                    f"policy collapse? held-out accuracy {accuracy:.3f} ± {se:.3f} at step {step} is "
                    f"{best - accuracy:.3f} below the best, {best:.3f} at step {best_step} "
                    f"(more than twice the noise, {noise:.3f})"
                )
        if self.best is None or accuracy > self.best[1]:
            self.best = (step, accuracy, se)
        return warning


def record_warning(record, progress, row: dict, warning: str | None) -> None:
    """Put ``warning`` (if any) in ``row`` before it is logged, on the progress output, and in
    ``meta.json``'s ``warnings``."""
    if not warning:
        return
    row["warning"] = warning
    progress.note(f"warning: {warning}")
    record.update_meta(warnings=[*record.meta.get("warnings", []), warning])
