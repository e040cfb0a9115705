"""``sess run --dry-run``'s token and cost lines: the forecast (:mod:`sess.harness.forecast`) of the
resolved config, priced by the price table of the home's running engine (or ``SESS_PRICES``).

The prompts are tokenized with the model's own tokenizer, from the engine home's model cache (a
tiny random model is built there, which loads no weights into this process); a model not in the
cache gets no forecast, with a line saying why, rather than a guess.
"""

from __future__ import annotations

import os


def _tokenizer(base_model: str):
    from transformers import AutoTokenizer

    from sess.engine.runtime import catalog
    from sess.engine.sdk.home import models_dir

    spec = catalog.resolve(base_model)
    if spec.source == "random":
        path = catalog.prepare(base_model, progress=False)
    elif spec.source == "local":
        path = catalog.prepare(base_model, progress=False)
    else:
        path = models_dir() / spec.name
        if not (path / "tokenizer.json").exists():
            return None
    return AutoTokenizer.from_pretrained(str(path))


def _prices():
    from sess.engine.sdk.local_engine import engine_info
    from sess.engine.sdk.prices import load_prices

    path = os.environ.get("SESS_PRICES") or ((engine_info(None) or {}).get("options") or {}).get("prices")
    return load_prices(path) if path else None


def forecast_lines(cfg) -> dict[str, str]:
    """{label: text} for the dry run's plan."""
    from sess.engine.sdk.prices import KINDS, format_cost
    from sess.harness.forecast import forecast

    try:
        tok = _tokenizer(cfg.model.base_model)
    except Exception as exc:  # an unknown model or a damaged cache: the plan still prints
        return {"tokens": f"no forecast ({type(exc).__name__}: {exc})"}
    if tok is None:
        return {
            "tokens": f"no forecast: the tokenizer of {cfg.model.base_model} is not in the model cache yet"
        }
    try:
        fc = forecast(cfg, tok)
    except ValueError as exc:
        return {"tokens": f"no forecast: {exc}"}
    lines = {
        "tokens": f"at most {fc.tokens} (prefill {fc.prefill}, sampled {fc.sampled}, trained {fc.trained})"
    }
    try:
        table = _prices()
    except ValueError as exc:
        table, lines["cost"] = None, f"not priced ({exc})"
    if table is not None:
        prices = table.prices_for(cfg.model.base_model)
        pico = sum(getattr(fc, kind) * getattr(prices, kind) for kind in KINDS)
        lines["cost"] = f"at most {format_cost(pico)} {table.currency}"
    return lines
