"""A run's spend as it goes: tokens and cost so far, and the projection for the whole run, each step.

After every step the runner reads its session's usage from the engine (tokens and, where the engine
has prices, cost) and projects the total: what is spent, plus the steps left at the rate of the
steps measured, plus the evaluations left at the cost of the last one. A step's spend leaves out
evaluations (measured on their own, before and after each), and once a second step is measured the
first one is left out too: off-policy loops' rollout workers fill their queue of groups sampled ahead
during it, which later steps only keep topped up. The figures go into each train row of
``metrics.jsonl`` (``spend/tokens``, ``spend/projected_tokens``, and ``spend/cost``,
``spend/projected_cost`` with prices), each evaluation's row (``spend/evaluation_tokens``, ...) and
the progress line. A resumed run continues from the spend its kept rows record, so its figures are
those of the uninterrupted run (what the killed session spent past its last save is not in them).
``forecast.json`` keeps the bound and the expected figure the run started with, so ``sess runs
show`` can say how close each came (:func:`forecast_lines`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

from sess.rl.data import Data

from .budget import engine_prices, run_forecast
from .forecast import planned_steps

KINDS = ("prefill_tokens", "sampled_tokens", "training_tokens")


@dataclass(frozen=True)
class Spend:
    """Tokens and cost (None without prices), with the arithmetic a projection needs."""

    tokens: float = 0
    cost: Decimal | None = None

    @classmethod
    def of(cls, usage) -> Spend:
        """A :class:`~sess.engine.sdk.types.Usage` (or its wire dict) as a Spend."""
        wire = usage if isinstance(usage, dict) else usage.to_wire()
        cost = wire.get("cost")
        return cls(sum(int(wire.get(k) or 0) for k in KINDS), None if cost is None else Decimal(cost))

    @classmethod
    def recorded(cls, row: dict, prefix: str) -> Spend:
        """The spend a metrics row records under ``<prefix>tokens`` and ``<prefix>cost``."""
        cost = row.get(f"{prefix}cost")
        return cls(row[f"{prefix}tokens"], None if cost is None else Decimal(cost))

    def _with(self, other: Spend, sign: int) -> Spend:
        cost = None if self.cost is None or other.cost is None else self.cost + sign * other.cost
        return Spend(self.tokens + sign * other.tokens, cost)

    def __add__(self, other: Spend) -> Spend:
        return self._with(other, 1)

    def __sub__(self, other: Spend) -> Spend:
        return self._with(other, -1)

    def times(self, factor: float) -> Spend:
        return Spend(self.tokens * factor, None if self.cost is None else self.cost * Decimal(str(factor)))

    def row(self, prefix: str) -> dict:
        """``{<prefix>tokens, <prefix>cost}`` as a metrics row keeps them (cost only with prices)."""
        found = {f"{prefix}tokens": round(self.tokens)}
        if self.cost is not None:
            found[f"{prefix}cost"] = format(self.cost.quantize(Decimal("1e-12")).normalize(), "f")
        return found


NOTHING = Spend(cost=Decimal(0))  # adds nothing, and keeps a cost a cost (None + anything is None)


class SpendMeter:
    """The projection of one run, fed by the runner: :meth:`measure` around each evaluation,
    :meth:`step_done` after each step. ``history``: the rows a resumed run keeps, whose spend it
    continues from (its new session's usage starts at zero), so its figures are those the run
    would have had uninterrupted."""

    def __init__(
        self,
        read_usage: Callable[[], object],
        steps: int,
        eval_every: int,
        start_step: int = 0,
        history: list[dict] = (),
    ):
        self.steps, self.eval_every, self.start_step = steps, eval_every, start_step
        self.marks: list[tuple[int, Spend]] = []  # (steps done, spend without evaluations) after each step
        self.in_evaluations = NOTHING
        self.last_evaluation: Spend | None = None
        offset = NOTHING
        for row in history:
            if row.get("kind") == "eval" and "spend/evaluation_tokens" in row:
                self.last_evaluation = Spend.recorded(row, "spend/evaluation_")
                self.in_evaluations += self.last_evaluation
                offset += self.last_evaluation
            elif row.get("kind") == "train" and "spend/tokens" in row:
                offset = Spend.recorded(row, "spend/")
                self.marks.append((row["step"], offset - self.in_evaluations))
        self.read = lambda: offset + Spend.of(read_usage())

    @staticmethod
    def measure(meter: SpendMeter | None, evaluate: Callable[[int], dict], done: int) -> dict:
        """``evaluate(done)``'s metrics, with what the evaluation spent where there is a meter."""
        if meter is None:
            return evaluate(done)
        before = meter.read()
        metrics = evaluate(done)
        meter.last_evaluation = meter.read() - before
        meter.in_evaluations += meter.last_evaluation
        return {**metrics, **meter.last_evaluation.row("spend/evaluation_")}

    def evaluations_left(self, done: int) -> int:
        """The runner's evaluations after step ``done``: every ``eval_every`` steps below the last
        (this one too), and at the end."""
        every = self.eval_every
        return 1 + sum(1 for k in range(max(done, 1), self.steps) if every and k % every == 0)

    def projection(self, done: int, spent: Spend) -> Spend:
        """The whole run's spend, projected from ``spent`` after ``done`` steps."""
        self.marks.append((done, spent - self.in_evaluations))
        (first, at_first), (last, at_last) = self.marks[0], self.marks[-1]
        if last > first:  # the first step measured carries what is sampled ahead: leave it out
            per_step = (at_last - at_first).times(1 / (last - first))
        else:
            per_step = at_first.times(1 / max(first - self.start_step, 1))
        evaluations = (self.last_evaluation or NOTHING).times(self.evaluations_left(done))
        return spent + per_step.times(max(self.steps - done, 0)) + evaluations

    def step_done(self, done: int) -> dict:
        """The step's row fields: spend so far and projected, tokens and (with prices) cost."""
        spent = self.read()
        projected = self.projection(done, spent)
        if projected.cost is None:
            spent = Spend(spent.tokens)
        return {**spent.row("spend/"), **projected.row("spend/projected_")}


def start_spend(cfg, svc, tc, data: Data, record, start_step: int) -> SpendMeter | None:
    """A starting run's meter; a fresh run (not a resumed one) first records its ``forecast.json``.
    Neither may stop the run: a forecast that cannot be made is recorded as such, a meter that
    cannot read usage is left out."""
    planned = planned_steps(cfg, data)
    if start_step == 0:
        try:
            found = run_forecast(cfg, tc.get_tokenizer(), data, engine_prices(svc))
        except Exception as exc:  # a record of the run, not a reason to stop it
            found = {"bound": None, "expected": None, "basis": f"no forecast ({type(exc).__name__}: {exc})"}
        record.write_forecast(found)
    try:
        read = functools.partial(svc.get_usage, tc.name)
        read()
    except Exception:
        return None
    history = record.metrics() if start_step else []
    return SpendMeter(read, planned, int(cfg.get("eval_every") or 0), start_step, history)


def _against(actual: float, forecast: float) -> str:
    """How far ``forecast`` is from ``actual``, as a share of ``actual``."""
    if forecast == actual:
        return "exactly the actual"
    return f"{100 * (forecast - actual) / actual:+.1f} % against the actual {actual}" if actual else ""


def forecast_lines(
    forecast: dict, usage: dict, train_rows: list[dict], status: str | None, resumed: bool = False
) -> list[str]:
    """What ``sess runs show`` says of a run's forecast against its actual use (``usage.json``): the
    bound, the expected figure, and the projection after each of the first steps and the last. A
    run cut short, or resumed (its ``usage.json`` counts its last session only), is compared with
    nothing."""
    if not forecast and not any("spend/projected_tokens" in r for r in train_rows):
        return []
    actual = sum(int(usage.get(k) or 0) for k in KINDS) if usage else None
    final = actual if status == "completed" and not resumed else None
    lines = []
    for name in ("bound", "expected"):
        figure = (forecast or {}).get(name)
        if figure:
            held = f" ({_against(final, figure['tokens'])})" if final is not None else ""
            cost = f", cost {figure['cost']}" if figure.get("cost") else ""
            lines.append(f"{name}: {figure['tokens']} tokens{cost}{held}")
        elif name == "expected" and forecast and forecast.get("basis"):
            lines.append(f"expected: {forecast['basis']}")
    if forecast and forecast.get("expected") and forecast.get("basis"):
        lines.append(f"  basis: {forecast['basis']}")
    projected = [r for r in train_rows if "spend/projected_tokens" in r]
    for row in projected[:2] + projected[-1:] * (len(projected) > 2):
        held = f" ({_against(final, row['spend/projected_tokens'])})" if final is not None else ""
        currency = f" {usage.get('currency')}" if usage and usage.get("currency") else ""
        cost = f", cost {row['spend/projected_cost']}{currency}" if row.get("spend/projected_cost") else ""
        lines.append(
            f"projected after step {row['step']}: {row['spend/projected_tokens']} tokens{cost}{held}"
        )
    if final is None and projected:
        why = "resumed: the usage above is its last session's" if resumed else f"{status}: not a whole run"
        lines.append(f"({why}, so nothing is compared with it)")
    return lines
