"""A run's forecast from Python, as ``sess run --dry-run [--pilot N]`` prints it:

    from sess.harness.costs.dry_run import forecast_run
    found = forecast_run(["loop.steps=5"], pilot=1)   # the overrides `sess run` takes
    found.bound.tokens, found.expected.figure.tokens, found.expected.basis, found.cost(found.expected.figure)

Without a pilot nothing is started: the prompts are tokenized with the tokenizer from the engine
home's model cache (or ``tok``). With one, the engine the config names is used (the local one is
started if need be) and, before any of it, ``notify`` is told what will be loaded and what the pilot
may cost (:func:`pilot_notice`); its forecast is then kept for the next run of the same config
(:func:`sess.harness.costs.budget.save_for_run`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import httpx
from omegaconf import DictConfig

from sess.engine.protocol.home import models_dir
from sess.engine.protocol.prices import PriceError, format_cost
from sess.engine.sdk.local_engine import engine_info
from sess.tasks import sources

from .. import config as config_mod
from . import budget
from .forecast import ENV_LOOPS
from .pilot import pilot_bound, run_pilot


def _cached_tokenizer(base_model: str):
    from sess.engine.sdk.service_client import load_tokenizer

    path = models_dir() / base_model
    return load_tokenizer(path) if (path / "tokenizer.json").exists() else None


def _loaded_models(cfg) -> tuple[str | None, list[str] | None]:
    """(the engine a run of ``cfg`` uses, as words; the base models it has in memory), None for
    what is not known: an engine not running yet has none."""
    kind, url = cfg.engine.kind, cfg.engine.url or os.environ.get("SESS_ENGINE_URL")
    if kind == "inprocess":
        return "an engine in this process", []
    if kind == "remote" or os.environ.get("SESS_ENGINE_URL"):
        try:
            health = httpx.get(f"{url.rstrip('/')}/healthz", timeout=5.0).json()
        except (httpx.HTTPError, ValueError, OSError):
            return f"the engine at {url}", None
        return f"the engine at {url}", health.get("models")
    info = engine_info()
    if info is None:
        return "the local engine (not running: the pilot starts it)", []
    return f"the local engine {info['url']}", info.get("models")


def pilot_notice(cfg, tok, data, prompts: int, prices) -> str:
    """What a pilot of ``prompts`` problems will load and cost, said before it runs."""
    model = cfg.model.base_model
    engine, loaded = _loaded_models(cfg)
    if loaded is not None and model in loaded:
        load = f"{engine} has {model} loaded"
    elif engine.startswith("the engine at"):  # a remote engine: its own model cache
        maybe = "" if loaded is not None else " unless it has it in memory"
        load = (
            f"{engine} loads {model}{maybe} (from its model cache, or fetched first), and keeps it in memory"
        )
    else:
        cached = models_dir() / model
        weights = sum(p.stat().st_size for p in cached.glob("*.safetensors")) if cached.is_dir() else 0
        source = (
            f"from the model cache, {weights / 1e6:.1f} MB of weights"
            if weights
            else "not in the model cache: fetched and converted first, a minute or more"
        )
        load = f"{engine} loads {model} ({source}), and keeps it in memory"
    asked = f"greedy answers to {prompts} held-out prompt(s)"
    if cfg.loop.name in ENV_LOOPS:
        if samples := int(cfg.get("eval_samples") or 0):
            asked += f" (and {samples} sampled answers each)"
        asked = f"{prompts} prompt(s) x {cfg.loop.group_size} replies as the first step does, and {asked}"
    if tok is None:
        return f"pilot: {load}; then samples {asked}, each reply at most {cfg.loop.max_tokens} tokens"
    most = pilot_bound(cfg, tok, data, prompts)
    cost = ""
    if prices is not None:  # replies priced as sampled: the dearer kind of a pilot's two
        per_token = max(prices.prices_for(model).prefill, prices.prices_for(model).sampled)
        cost = f", cost at most {format_cost(most * per_token)} {prices.currency}"
    return f"pilot: {load}; then samples {asked}: at most {most} tokens{cost}"


def forecast_run(
    overrides: list[str] | tuple[str, ...] = (),
    *,
    cfg=None,
    pilot: int = 0,
    tok=None,
    notify: Callable[[str], None] = print,
    svc=None,
) -> budget.RunForecast:
    """The forecast of ``sess run [overrides]``: its bound and, measured by a pilot of ``pilot``
    prompts (0: none, and env loops then have no expected figure), its expected figure; priced by
    the engine's table where it has one. ``cfg``: the resolved config instead of ``overrides``;
    ``svc``: a ServiceClient to pilot on (default: the engine the config names)."""
    cfg = cfg if cfg is not None else config_mod.compose(list(overrides))
    data = sources.load(cfg.data, int(cfg.seed), cfg.grader)
    model = cfg.model.base_model
    tok = tok or _cached_tokenizer(model) or (svc.get_tokenizer(model) if svc is not None else None)
    if not pilot:
        if tok is None:
            raise ValueError(
                f"the tokenizer of {model} is not in the model cache yet: give tok=, or pilot=N to use the engine"
            )
        return budget.plan(cfg, tok, data, *_prices(svc))
    prices, note = _prices(svc)
    data.fit_to(tok, cfg.model.base_model, None, int(cfg.loop.max_tokens))
    notify(pilot_notice(cfg, tok, data, pilot, prices))
    if svc is None:
        from ..runner import service_client

        svc = service_client(cfg.engine)
    tok = svc.get_tokenizer(model)
    data.fit_to(tok, cfg.model.base_model, None, int(cfg.loop.max_tokens))
    measured = run_pilot(cfg, svc.create_sampling_client(base_model=model), tok, data, pilot)
    found = budget.plan(cfg, tok, data, *_prices(svc), pilot=measured)
    found.saved = budget.save_for_run(cfg, found)
    return found


def _prices(svc) -> tuple:
    """(the engine's price table or None, why there is none when it cannot be read)."""
    try:
        return budget.engine_prices(svc), ""
    except PriceError as exc:
        return None, f"not priced ({exc})"


def plan(cfg: DictConfig) -> dict:
    """What a run would do, without touching an engine or weights (``--dry-run``)."""
    lora = cfg.model.lora
    return {
        "model": cfg.model.base_model,
        "arch": cfg.model.arch,
        "lora": f"rank {lora.rank}, alpha {lora.alpha}; targets {', '.join(cfg.model.targets)}",
        "engine": cfg.engine.kind + (f" {cfg.engine.url}" if cfg.engine.url else ""),
        "loop": f"{cfg.loop.name}: {cfg.loop.steps} steps, batch {cfg.loop.batch_size}, lr {cfg.loop.learning_rate}",
        "data": cfg.data.name,
        "eval": f"every {cfg.eval_every or '-'} steps and at start/end",
        "save": f"state every {cfg.save_every or '-'} steps and at the end",
        "logger": cfg.logger.name,
        "seed": cfg.seed,
    }
