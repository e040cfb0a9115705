"""``sess run --dry-run``'s token and cost lines: the bound and expected figure
(:mod:`sess.harness.costs.dry_run`) of the resolved config, priced by the price table of the engine (the
home's running one, or ``SESS_PRICES``).

The prompts are tokenized with the model's own tokenizer, from the engine home's model cache (a
tiny random model is built there, which loads no weights into this process); a model not in the
cache gets no forecast, with a line saying why, rather than a guess.
"""

from __future__ import annotations


def _tokenizer(base_model: str):
    from transformers import AutoTokenizer

    from sess.engine.protocol.home import models_dir
    from sess.engine.runtime.models import catalog

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


def forecast_lines(cfg, pilot: int = 0, notify=None) -> dict[str, str]:
    """{label: text} for the dry run's plan: the bound, the expected figure and its basis, their
    cost; with ``pilot`` N, measured by a pilot of N prompts (``notify`` hears, before it runs, what
    it will load and cost)."""
    from sess.harness.costs.dry_run import forecast_run

    try:
        tok = _tokenizer(cfg.model.base_model)
    except Exception as exc:  # an unknown model or a damaged cache: the plan still prints
        return {"tokens": f"no forecast ({type(exc).__name__}: {exc})"}
    if tok is None and not pilot:
        return {
            "tokens": f"no forecast: the tokenizer of {cfg.model.base_model} is not in the model cache yet "
            "(--pilot N uses the engine, which fetches it)"
        }
    try:
        found = forecast_run(cfg=cfg, pilot=pilot, tok=tok, notify=notify or print)
    except ValueError as exc:
        return {"tokens": f"no forecast: {exc}"}
    return found.lines()
