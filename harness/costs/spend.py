"""A run's spend as it goes: tokens and cost so far, and the projection for the whole run, each step.

After every step the runner reads its session's usage from the engine (tokens and, where the engine
has prices, cost) and projects the total: what is spent, plus the steps left, plus the evaluations
left at the cost of the last one. A step's spend leaves out evaluations (measured on their own,
before and after each), and once a second step is measured the first one is left out too:
off-policy loops' rollout workers fill their queue of groups sampled ahead during it, which later
steps only keep topped up. Loops that report the share of their groups that trained
(``groups_with_signal``: the loops on :mod:`sess.rl.rollouts`, grpo and code_rl among them, train
only on groups whose rewards differ) have the steps left projected in two parts: what a step
samples and prefills, at the rate measured, and what it trains, which follows that share as the
policy learns: a full batch's trained tokens (measured: the trained tokens so far over the shares
so far) times the share expected of each step left (:mod:`.share`). Other loops' steps are projected at the rate measured, trained tokens and all.
The figures go into each train row of ``metrics.jsonl`` (``spend/tokens``, ``spend/trained_tokens``,
``spend/projected_tokens``, ``spend/projected_share`` where the share is modelled, and
``spend/cost``, ``spend/projected_cost`` with prices), each evaluation's row
(``spend/evaluation_tokens``, ...) and the progress line. A resumed run continues from the spend
its kept rows record, so its figures are those of the uninterrupted run (what the killed session
spent past its last save is not in them). ``forecast.json`` keeps the bound and the expected figure
the run started with, so ``sess runs show`` can say how close each came (:func:`forecast_lines`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

from sess.rl.data import Data

from .budget import engine_prices, run_forecast
from .forecast import planned_steps
from .share import shares_ahead

KINDS = ("prefill_tokens", "sampled_tokens", "training_tokens")


@dataclass(frozen=True)
class Spend:
    """Tokens and cost (None without prices), with the arithmetic a projection needs."""

    tokens: float = 0
    cost: Decimal | None = None
    trained: float = 0  # of the tokens, those trained

    @classmethod
    def of(cls, usage) -> Spend:
        """A :class:`~sess.engine.protocol.types.Usage` (or its wire dict) as a Spend."""
        wire = usage if isinstance(usage, dict) else usage.to_wire()
        cost = wire.get("cost")
        tokens = sum(int(wire.get(k) or 0) for k in KINDS)
        return cls(tokens, None if cost is None else Decimal(cost), int(wire.get("training_tokens") or 0))

    @classmethod
    def recorded(cls, row: dict, prefix: str) -> Spend:
        """The spend a metrics row records under ``<prefix>tokens``, ``<prefix>cost`` and
        ``<prefix>trained_tokens``."""
        cost = row.get(f"{prefix}cost")
        return cls(
            row[f"{prefix}tokens"],
            None if cost is None else Decimal(cost),
            row.get(f"{prefix}trained_tokens", 0),
        )

    def _with(self, other: Spend, sign: int) -> Spend:
        cost = None if self.cost is None or other.cost is None else self.cost + sign * other.cost
        return Spend(self.tokens + sign * other.tokens, cost, self.trained + sign * other.trained)

    def __add__(self, other: Spend) -> Spend:
        return self._with(other, 1)

    def __sub__(self, other: Spend) -> Spend:
        return self._with(other, -1)

    def times(self, factor: float) -> Spend:
        cost = None if self.cost is None else self.cost * Decimal(str(factor))
        return Spend(self.tokens * factor, cost, self.trained * factor)

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
    would have had uninterrupted. ``trained_price``: what one trained token costs (None: no prices),
    to price the trained part of the steps left."""

    def __init__(
        self,
        read_usage: Callable[[], object],
        steps: int,
        eval_every: int,
        start_step: int = 0,
        history: list[dict] = (),
        trained_price: Decimal | None = None,
    ):
        self.steps, self.eval_every, self.start_step = steps, eval_every, start_step
        self.trained_price = trained_price
        # (steps done, spend without evaluations, the step's share of groups that trained) after each step
        self.marks: list[tuple[int, Spend, float | None]] = []
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
                # a row without its trained tokens (recorded before they were) cannot split its step
                share = row.get("groups_with_signal") if "spend/trained_tokens" in row else None
                self.marks.append((row["step"], offset - self.in_evaluations, share))
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

    def _trained(self, tokens: float) -> Spend:
        """``tokens`` trained tokens as a Spend, priced (cost None without a price)."""
        cost = None if self.trained_price is None else self.trained_price * Decimal(str(tokens))
        return Spend(tokens, cost, tokens)

    def projection(self, done: int, spent: Spend, share: float | None = None) -> tuple[Spend, float | None]:
        """The whole run's spend, projected from ``spent`` after ``done`` steps, the last of which
        trained ``share`` of its groups (None: the loop does not say); and the mean share expected
        of the steps left (None where it is not modelled)."""
        self.marks.append((done, spent - self.in_evaluations, share))
        (first, at_first, _), (last, at_last, _) = self.marks[0], self.marks[-1]
        if last > first:  # the first step measured carries what is sampled ahead: leave it out
            per_step = (at_last - at_first).times(1 / (last - first))
        else:
            per_step = at_first.times(1 / max(first - self.start_step, 1))
        evaluations = (self.last_evaluation or NOTHING).times(self.evaluations_left(done))
        left = max(self.steps - done, 0)
        shares = [s for _, _, s in self.marks]
        if None in shares or not sum(shares) or not at_last.trained or not left:
            return spent + per_step.times(left) + evaluations, None
        # a step left: what it samples and prefills at the rate measured, and what it trains as the
        # share of its groups with signal is expected to be (.share), of a full batch's trained tokens
        full_batch = self._trained(at_last.trained / sum(shares))
        batches = shares_ahead(shares, left)
        untrained = per_step - self._trained(per_step.trained)
        return spent + untrained.times(left) + full_batch.times(batches) + evaluations, batches / left

    def step_done(self, done: int, metrics: dict | None = None) -> dict:
        """The step's row fields: spend so far (and of it trained) and projected, tokens and (with
        prices) cost; ``metrics``: the step's own, whose ``groups_with_signal`` the projection uses."""
        spent = self.read()
        share = (metrics or {}).get("groups_with_signal")
        projected, share_ahead = self.projection(done, spent, None if share is None else float(share))
        if projected.cost is None:
            spent = Spend(spent.tokens, None, spent.trained)
        found = {**spent.row("spend/"), "spend/trained_tokens": round(spent.trained)}
        found.update(projected.row("spend/projected_"))
        if share_ahead is not None:
            found["spend/projected_share"] = round(share_ahead, 4)
        return found


def start_spend(cfg, svc, tc, data: Data, record, start_step: int) -> SpendMeter | None:
    """A starting run's meter; a fresh run (not a resumed one) first records its ``forecast.json``.
    Neither may stop the run: a forecast that cannot be made is recorded as such, a meter that
    cannot read usage is left out."""
    planned = planned_steps(cfg, data)
    prices = None
    try:
        prices = engine_prices(svc)
        found = run_forecast(cfg, tc.get_tokenizer(), data, prices) if start_step == 0 else None
    except Exception as exc:  # a record of the run, not a reason to stop it
        found = {"bound": None, "expected": None, "basis": f"no forecast ({type(exc).__name__}: {exc})"}
    if start_step == 0:
        record.write_forecast(found)
    try:
        read = functools.partial(svc.get_usage, tc.name)
        read()
    except Exception:
        return None
    history = record.metrics() if start_step else []
    trained_price = None
    if prices is not None:  # pico-units per token, as the engine bills
        trained_price = Decimal(prices.prices_for(cfg.model.base_model).trained).scaleb(-12)
    return SpendMeter(read, planned, int(cfg.get("eval_every") or 0), start_step, history, trained_price)


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
        share = row.get("spend/projected_share")
        basis = f", the steps left training {share:.2f} of their groups" if share is not None else ""
        lines.append(
            f"projected after step {row['step']}: {row['spend/projected_tokens']} tokens{cost}{held}{basis}"
        )
    if final is None and projected:
        why = "resumed: the usage above is its last session's" if resumed else f"{status}: not a whole run"
        lines.append(f"({why}, so nothing is compared with it)")
    return lines
