"""A run's budget before it runs: the bound (:mod:`.forecast`) and the expected figure
(:mod:`.expected`) side by side, priced by the engine's table, and kept for the run they describe.

A pilot's expected figure (``sess run --dry-run --pilot N``) is saved under
``<runs_dir>/.forecasts/<key>.json``, where the key is a hash of what decides a run's tokens (loop,
model, data, grader, seed, evaluation schedule); a later run of the same config records it in its
``forecast.json`` beside the bound, so ``sess runs show`` compares both with what the run used.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from sess.engine.protocol.prices import KINDS, PriceTable, format_cost, load_prices
from sess.rl.data import Data

from .expected import Expected, expected
from .forecast import Forecast, forecast
from .pilot import Pilot

DECIDES_TOKENS = ("loop", "model", "data", "grader", "seed", "eval_every", "eval_samples")


@dataclass
class RunForecast:
    """What a run will use: ``bound`` (None where the loop has none), ``expected`` with its basis,
    priced by ``prices`` (None: the engine has none) for ``model``; ``pilot`` when one ran."""

    bound: Forecast | None
    expected: Expected
    prices: PriceTable | None = None
    model: str = ""
    pilot: Pilot | None = None
    saved: Path | None = None  # where a pilot's forecast is kept for the next run of its config
    price_note: str = ""  # why there are no prices, when the table could not be read

    def cost(self, fc: Forecast | None) -> str | None:
        """``fc``'s cost as an exact decimal string, None without prices."""
        if fc is None or self.prices is None:
            return None
        prices = self.prices.prices_for(self.model)
        return format_cost(sum(getattr(fc, kind) * getattr(prices, kind) for kind in KINDS))

    def figure(self, fc: Forecast | None) -> dict | None:
        """``fc`` as forecast.json keeps it: tokens by kind, their total and cost."""
        if fc is None:
            return None
        found = {"tokens": fc.tokens, "prefill": fc.prefill, "sampled": fc.sampled, "trained": fc.trained}
        if (cost := self.cost(fc)) is not None:
            found["cost"] = f"{cost} {self.prices.currency}"
        return found

    def to_json(self) -> dict:
        return {
            "bound": self.figure(self.bound),
            "expected": self.figure(self.expected.figure),
            "basis": self.expected.basis,
        }

    def lines(self) -> dict[str, str]:
        """{label: text}: the bound, the expected figure and its basis, and their cost."""
        lines = {}
        if self.bound is not None:
            b = self.bound
            lines["tokens"] = (
                f"at most {b.tokens} (prefill {b.prefill}, sampled {b.sampled}, trained {b.trained})"
            )
        e = self.expected.figure
        if e is not None:
            lines["expect"] = (
                f"{e.tokens} tokens (prefill {e.prefill}, sampled {e.sampled}, trained {e.trained})"
            )
        else:
            lines["expect"] = self.expected.basis
        if self.price_note:
            lines["cost"] = self.price_note
        if self.prices is not None and self.bound is not None:
            lines["cost"] = f"at most {self.cost(self.bound)} {self.prices.currency}"
            if e is not None:
                lines["cost"] += f"; expected {self.cost(e)} {self.prices.currency}"
        if e is not None:
            lines["basis"] = self.expected.basis
        if self.pilot is not None:
            used = self.pilot.tokens
            lines["pilot"] = (
                f"used {sum(used.values())} tokens (prefill {used['prefill']}, sampled {used['sampled']})"
            )
            if self.prices is not None:
                lines["pilot"] += (
                    f", cost {self.cost(Forecast(used['prefill'], used['sampled']))} {self.prices.currency}"
                )
        if self.saved is not None:
            lines["kept"] = f"{self.saved}: the next run of this config records it beside what it uses"
        return lines


def engine_prices(svc=None) -> PriceTable | None:
    """The price table runs are billed by: ``SESS_PRICES``, else that of the engine ``svc`` talks to
    (or, without one, of the home's running local engine); None where there is none."""
    from sess.engine.sdk.local_engine import engine_info

    if os.environ.get("SESS_PRICES"):
        return load_prices(os.environ["SESS_PRICES"])
    if svc is not None:  # an engine over HTTP says its own table; one in this process has none
        request = getattr(svc.transport, "request", None)
        wire = request("GET", "/api/prices", idempotent=True).json().get("prices") if request else None
        return PriceTable.from_wire(wire) if wire else None
    path = ((engine_info(None) or {}).get("options") or {}).get("prices")
    return load_prices(path) if path else None


def plan(
    cfg,
    tok,
    data: Data,
    prices: PriceTable | None = None,
    price_note: str = "",
    *,
    pilot: Pilot | None = None,
) -> RunForecast:
    """The bound and expected figure of the run ``cfg``, its prompts tokenized by ``tok``, priced by
    ``prices`` (``price_note``: why there are none)."""
    try:
        bound = forecast(cfg, tok, data)
    except ValueError:  # a loop the bound does not cover: expected() says so too
        bound = None
    found = RunForecast(bound, expected(cfg, tok, data, pilot), prices, cfg.model.base_model, pilot)
    found.price_note = price_note
    return found


def _saved_path(cfg) -> Path:
    deciding = {key: OmegaConf.to_container(cfg, resolve=True).get(key) for key in DECIDES_TOKENS}
    key = hashlib.sha256(json.dumps(deciding, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cfg.runs_dir) / ".forecasts" / f"{key}.json"


def save_for_run(cfg, found: RunForecast) -> Path:
    """Keep a pilot's forecast for the next run of ``cfg``; returns where."""
    from sess.engine.protocol.home import atomic_write_bytes

    path = _saved_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = {**found.to_json(), "pilot": found.pilot.to_json() if found.pilot else None}
    atomic_write_bytes(path, (json.dumps(saved, indent=1) + "\n").encode())
    return path


def run_forecast(cfg, tok, data: Data, prices: PriceTable | None) -> dict:
    """What a starting run records in ``forecast.json``: its bound, and the expected figure of the
    pilot saved for its config (re-priced, the pilot's basis kept), else the one it has without."""
    found = plan(cfg, tok, data, prices=prices)
    path = _saved_path(cfg)
    if path.is_file():
        try:
            pilot = Pilot.from_json(json.loads(path.read_text())["pilot"])
        except (OSError, ValueError, KeyError, TypeError):  # a damaged saved pilot: as if none
            pilot = None
        if pilot is not None:
            found.expected = expected(cfg, tok, data, pilot)
            found.expected.basis += f" ({path})"
    return found.to_json()
