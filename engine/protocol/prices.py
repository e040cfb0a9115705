"""Per-token prices: the table an engine bills by, and exact money arithmetic.

A price table is YAML: ``currency:``, then under ``models:`` each base model (and ``default:`` for
every model not named) with ``prefill``, ``sampled`` and ``trained``, each the price of one million
tokens, and optionally ``cached_prefill`` (prompt tokens served from a prefix cache; without it they
cost the prefill price). Which op's tokens count as which: ``forward_backward`` trains its tokens;
``forward`` and ``compute_logprobs`` prefill theirs; a ``sample`` prefills its prompt once (however
many samples it asks for; the part a cache served is cached prefill) and samples its new tokens.
Other ops (optim_step, saves, loads) cost nothing.

Money is exact: a price has at most six decimals, so one token costs a whole number of *pico-units*
(10^-12 of the currency), and every cost is an integer of them, summed once per op; it is shown as a
decimal string (never a float), so a total is exactly the sum of its rows. Loading a table refuses a
malformed file, a negative or non-finite price, a missing field or model entry, naming the entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

PICO = 10**12  # pico-units per unit of the currency
PER_TOKENS = 10**6  # prices are per million tokens
KINDS = ("prefill", "sampled", "trained")  # the prices every table entry gives
BILLED_KINDS = ("prefill", "cached_prefill", "sampled", "trained")  # what a token can be billed as
MAX_DECIMALS = 6


class PriceError(ValueError):
    """A price table that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class Prices:
    """One model's prices per million tokens, as pico-units per token (exact integers)."""

    prefill: int
    sampled: int
    trained: int
    cached_prefill: int


def billed_tokens(op: str, usage: dict) -> dict[str, int]:
    """The tokens of one op (or one usage row of op ``op``) by what they are billed as; ``prefill``
    the prompt tokens computed, ``cached_prefill`` those a prefix cache served (a part of
    ``prefill_tokens``, counted once, in one kind or the other)."""
    prefill, cached, sampled, training = (
        int(usage.get(k) or 0)
        for k in ("prefill_tokens", "cached_prefill_tokens", "sampled_tokens", "training_tokens")
    )
    if op == "forward":  # a forward pass without a backward one is billed as reading its tokens
        prefill, training = prefill + training, 0
    cached = min(cached, prefill)
    return {"prefill": prefill - cached, "cached_prefill": cached, "sampled": sampled, "trained": training}


def format_cost(pico: int | None) -> str | None:
    """A cost in pico-units as an exact decimal string, e.g. ``0.0000325`` (None stays None)."""
    if pico is None:
        return None
    return format((Decimal(int(pico)).scaleb(-12)).normalize(), "f")


def parse_amount(text: Any, what: str) -> Decimal:
    """A non-negative finite amount of money (a budget, a price), or PriceError naming ``what``."""
    if isinstance(text, bool) or not isinstance(text, int | float | str | Decimal):
        raise PriceError(f"{what}: expected a number, got {type(text).__name__}")
    try:
        value = Decimal(str(text).strip())
    except InvalidOperation:
        raise PriceError(f"{what}: expected a number, got {text!r}") from None
    if not value.is_finite():
        raise PriceError(f"{what}: expected a finite number, got {text!r}")
    if value < 0:
        raise PriceError(f"{what}: expected zero or more, got {text!r}")
    return value


def to_pico(amount: Decimal) -> int:
    """An amount of money as whole pico-units (rounded down below a pico-unit)."""
    return int(amount * PICO)


class PriceTable:
    """The prices of one engine: ``cost(model, op, usage)`` in pico-units."""

    def __init__(self, currency: str, models: dict[str, Prices], source: str = ""):
        self.currency, self.models, self.source = currency, models, source

    def prices_for(self, model: str | None) -> Prices:
        return self.models.get(model or "", self.models["default"])

    def cost(self, model: str | None, op: str, usage: dict) -> int:
        prices = self.prices_for(model)
        tokens = billed_tokens(op, usage)
        return sum(tokens[kind] * getattr(prices, kind) for kind in BILLED_KINDS)

    def to_wire(self) -> dict:
        per_million = {
            name: {k: str(Decimal(getattr(p, k)) / (PICO // PER_TOKENS)) for k in BILLED_KINDS}
            for name, p in self.models.items()
        }
        return {"currency": self.currency, "models": per_million}

    @classmethod
    def from_wire(cls, wire: dict) -> PriceTable:
        return _table(wire, "prices", None)


def _price(value: Any, where: str) -> int:
    amount = parse_amount(value, where)
    exponent = amount.normalize().as_tuple().exponent
    if isinstance(exponent, int) and -exponent > MAX_DECIMALS:
        raise PriceError(f"{where}: at most {MAX_DECIMALS} decimals, got {value!r}")
    return int(amount * (PICO // PER_TOKENS))  # pico-units per token


def _table(data: Any, source: str, known_model: Callable[[str], str | None] | None) -> PriceTable:
    if not isinstance(data, dict):
        raise PriceError(
            f"{source}: expected a mapping with currency: and models:, got {type(data).__name__}"
        )
    unknown = set(data) - {"currency", "models"}
    if unknown:
        raise PriceError(f"{source}: unknown entry {sorted(unknown)[0]!r} (expected currency: and models:)")
    currency = data.get("currency")
    if not isinstance(currency, str) or not currency.strip():
        raise PriceError(f"{source}: currency: expected a currency name such as USD, got {currency!r}")
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise PriceError(f"{source}: models: expected a mapping of base model -> prices, got {models!r}")
    if "default" not in models:
        raise PriceError(
            f"{source}: models.default: missing; give the prices of every model the table does not name"
        )
    table = {}
    for name, entry in models.items():
        where = f"{source}: models.{name}"
        if not isinstance(name, str):
            raise PriceError(f"{where}: a model name must be a string")
        if name != "default" and known_model is not None:
            problem = known_model(name)
            if problem:
                raise PriceError(f"{where}: {problem}")
        if not isinstance(entry, dict):
            raise PriceError(f"{where}: expected prefill, sampled and trained, got {entry!r}")
        extra = set(entry) - set(BILLED_KINDS)
        if extra:
            expected = ", ".join(BILLED_KINDS)
            raise PriceError(f"{where}.{sorted(extra)[0]}: unknown price (expected {expected})")
        for kind in KINDS:
            if kind not in entry:
                raise PriceError(f"{where}.{kind}: missing (price per million tokens)")
        entry = {"cached_prefill": entry["prefill"]} | entry  # unpriced cached prefill costs prefill
        table[name] = Prices(**{k: _price(entry[k], f"{where}.{k}") for k in BILLED_KINDS})
    return PriceTable(currency.strip(), table, source)


def load_prices(path: str | Path, known_model: Callable[[str], str | None] | None = None) -> PriceTable:
    """Read and check a price table; ``known_model(name)`` says what is wrong with a model name
    (None: nothing). Raises PriceError naming the file and the entry."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PriceError(f"--prices {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PriceError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return _table(data, str(path), known_model)
