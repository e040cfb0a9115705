"""Run configuration: Hydra composes ``sess.conf``, then every group is checked against a dataclass schema.

Every default is written once. The ``loop`` and ``data`` options are dataclasses (each loop's
``Config``, each data source's config in :mod:`sess.tasks.sources`), registered in Hydra's ConfigStore under
their names, so ``loop=sft`` composes :class:`sess.loops.sft.Config` with its defaults. The
``model``, ``engine`` and ``logger`` options are YAML files in ``conf/`` that hold what differs per
option; the schemas below hold what they share (a model's LoRA defaults, a logger's project, ...).
Hydra's compose API builds the config from ``config.yaml`` plus the command line's overrides; the
result is merged into the schema of each group, so an unknown key or a value of the wrong type is a
:class:`ConfigError` that names the key (``loop.stpes``), whether the typo is on the command line or
in a YAML file. ``sess run``, ``sess start`` and ``python -m sess.harness`` all compose here.
The runner's schedule (``eval_every``, ``save_every``, ``eval_samples``) is top-level keys, not a loop's.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sess.engine.protocol.checkpoint_paths import check_name
from sess.tasks.code.grader_config import GRADERS, GraderConfig
from sess.tasks.sources import DATA_SOURCES

from .registry import LOOPS


class ConfigError(Exception):
    """A config that does not compose or does not fit its schema; the message names the key."""


@dataclass
class EngineConfig:
    kind: str = MISSING  # local | inprocess | remote (conf/engine/<kind>.yaml)
    url: str | None = None
    api_key: str | None = None
    # local: leave an engine this run had to start running afterwards (the next run reuses it);
    # false stops it at the end. An engine that was already running is never stopped by a run.
    keep: bool = True
    # a run that outlives its engine (sess.harness.recovery): a local engine that dies is started
    # again, a remote one waited for (up to wait_s seconds), and the run resumes from its last saved
    # state, at most `restarts` times (0: the run stops and names the command that continues it)
    restarts: int = 3
    wait_s: float = 600.0


@dataclass
class LoraConfig:
    rank: int = 32
    alpha: float = 64
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass
class ModelConfig:
    name: str = MISSING  # conf/model/<name>.yaml
    base_model: str = MISSING
    arch: str = MISSING
    lora: LoraConfig = field(default_factory=LoraConfig)
    targets: list[str] = field(default_factory=list)  # what LoRA wraps (informational, for --dry-run)


@dataclass
class LoggerConfig:
    name: str = MISSING  # local | wandb | mlflow (conf/logger/<name>.yaml)
    project: str = "sess"  # wandb's project, MLflow's experiment
    entity: str | None = None
    mode: str = "online"
    tags: list[str] = field(default_factory=list)


ENGINE_KINDS = ("local", "inprocess", "remote")
LOGGERS = ("local", "wandb", "mlflow")


GROUPS = ("engine", "model", "loop", "data", "logger", "grader")
# Keys that moved (the reward is the env's, the visiting order the data's, the schedule the runner's).
MOVED = {
    "loop.format_penalty": "data.format_penalty",
    "loop.shuffle": "data.shuffle",
    "loop.eval_every": "eval_every",
    "loop.save_every": "save_every",
    "loop.eval_samples": "eval_samples",
}
SCHEDULE = ("eval_every", "save_every", "eval_samples")  # the runner's keys, at the top level
RUN_KEYS = ("seed", "runs_dir", "session", "keep_session", *SCHEDULE)


def register_options() -> None:
    """Put every loop's and data source's config dataclass into Hydra's ConfigStore as an option, and
    the engine, model and logger schemas where their YAML options extend them (``/schema/<group>``)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, schema in (("engine", EngineConfig), ("model", ModelConfig), ("logger", LoggerConfig)):
        store.store(group="schema", name=group, node=schema)
    for name, loop in LOOPS.items():
        store.store(group="loop", name=name, node=loop.config)
    for name, source in DATA_SOURCES.items():
        store.store(group="data", name=name, node=source.config)
    for name in GRADERS:
        store.store(group="grader", name=name, node=GraderConfig(name=name))


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose ``sess.conf/config.yaml`` with ``overrides`` (Hydra syntax: ``loop=sft loop.steps=2``)."""
    from hydra import compose as hydra_compose
    from hydra.errors import HydraException

    try:
        with _hydra():
            # a recipe's presets first (loop=code_rl trains on code_tasks unless told otherwise)
            cfg = hydra_compose("config", overrides=[*_loop_presets(overrides), *overrides])
            for group in GROUPS:  # a group removed with ~group fails here, where _explain names it
                cfg[group]
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain(exc, list(overrides))) from exc
    return validate(cfg)


def _loop_presets(overrides) -> list[str]:
    """The presets of the loop the overrides choose that they do not set themselves (a key or a group)."""
    chosen = [o.partition("=")[2] for o in overrides if o.lstrip("+").startswith("loop=")]
    loop = LOOPS.get(chosen[-1]) if chosen else None
    if loop is None:
        return []
    given = {o.lstrip("+~").partition("=")[0] for o in overrides}
    return [p for p in loop.presets if p.partition("=")[0] not in given]


def _explain(exc: BaseException, overrides: list[str]) -> str:
    """Hydra's error as the fix a user needs: the nearest valid keys for a misspelled key (never
    Hydra's '+key' advice, which would add the typo), a group's options one per line for an unknown
    option, and none of Hydra's search-path text."""
    message = _one_line(exc)
    bad_key = re.search(r"Could not override '([^']+)'", message)
    if bad_key:
        key = bad_key.group(1)
        if key in MOVED:
            return f"{key} is now {MOVED[key]}: use {MOVED[key]}=..."
        return _unknown_key(key, [o for o in overrides if not o.lstrip("+~").startswith(f"{key}=")])
    missing = re.search(r"Could not (?:find|load) '([\w-]+)/([^']+)'", message)
    if missing and missing.group(1) in GROUPS:
        return unknown_option(missing.group(1), missing.group(2))
    if "override_grammar" in message:  # Hydra could not parse an override
        return _unparsable(overrides) or message.split("; See https://hydra.cc")[0]
    deleted = next((o for o in overrides if o.startswith("~")), None)
    if deleted and ("not in struct" in message or "does not support deletion" in message):
        return f"{deleted}: keys and groups cannot be removed; set a key with KEY=VALUE, a group with group=option"
    merging = re.match(r"Error merging override (\S+); (.*)", message)
    if merging:
        override, problem = merging.groups()
        expected = next((kind for pattern, kind in EXPECTED if re.search(pattern, problem)), None)
        return f"override {override}: expected {expected}" if expected else f"override {override}: {problem}"
    return message.split("; Config search path")[0]


# What a value that OmegaConf could not convert should have been, by its message.
EXPECTED = (
    ("converted to Integer", "an integer"),
    ("converted to Float", "a number"),
    ("not a valid bool", "true or false"),
    ("not a ListConfig", "a list, such as [a,b]"),
)


def _unparsable(overrides: list[str]) -> str | None:
    """The first override Hydra's grammar refuses, as a line naming it (Hydra's own message names
    it only for some errors, and always adds a link to its grammar)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except HydraException as exc:
            if "=" not in override.lstrip("~"):
                return f"{override}: expected KEY=VALUE or group=option (see sess run --help)"
            gist = _one_line(exc).split("; See https://hydra.cc")[0]
            return f"override {override}: Hydra cannot parse it ({gist})"
    return None


def _unknown_key(key: str, other_overrides: list[str]) -> str:
    parent, _, leaf = key.rpartition(".")
    try:
        with _hydra():
            from hydra import compose as hydra_compose

            cfg = hydra_compose("config", overrides=other_overrides)
    except Exception:  # another override is broken too: suggest from the defaults
        with _hydra():
            from hydra import compose as hydra_compose

            cfg = hydra_compose("config")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return f"unknown config key '{key}': {parent} has no keys"
    keys = [f"{parent}.{k}" if parent else str(k) for k in node.keys()]
    if not parent:  # a misspelled group is most likely meant as a choice: loop=sft
        keys = [k for k in keys if k not in GROUPS] + [f"{group}=" for group in GROUPS]
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    where = f"{parent} ({node.get('name', node.get('kind', ''))})" if parent else "the top level"
    return f"unknown config key '{key}'{hint} (keys of {where}: {', '.join(sorted(keys))})"


def unknown_option(group: str, option: str) -> str:
    """``group=option`` names no option: say so and list the group's options, one per line."""
    options = group_options(group)
    close = difflib.get_close_matches(option, options, n=1, cutoff=0.6)
    hint = f" (did you mean {group}={close[0]}?)" if close else ""
    return f"{group}={option}: there is no such {group}{hint}; the options are:\n" + "\n".join(
        f"  {name}" for name in options
    )


def group_options(group: str) -> list[str]:
    """The options of a config group (``loop`` -> grpo, importance_sampling, ...), YAML or dataclass."""
    from hydra.core.global_hydra import GlobalHydra

    with _hydra():
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


def _hydra():
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_options()
    GlobalHydra.instance().clear()
    return initialize_config_module(config_module="sess.conf", version_base="1.3")


def validate(cfg: DictConfig) -> DictConfig:
    """Merge each group into its schema; returns a resolved, read-only config."""
    checked = {}
    try:
        top = dict(cfg)
        known = {*GROUPS, *RUN_KEYS}
        for key in top:
            if key not in known:
                raise ConfigError(f"unknown config key {key!r}; known: {', '.join(sorted(known))}")
        loop_name = cfg.loop.get("name")
        data_name = cfg.data.get("name")
        if loop_name not in LOOPS:
            raise ConfigError(f"loop.name: unknown loop {loop_name!r}; choose one of {', '.join(LOOPS)}")
        if data_name not in DATA_SOURCES:
            raise ConfigError(
                f"data.name: unknown data {data_name!r}; choose one of {', '.join(DATA_SOURCES)}"
            )
        schemas = {
            "engine": EngineConfig,
            "model": ModelConfig,
            "logger": LoggerConfig,
            "loop": LOOPS[loop_name].config,
            "data": DATA_SOURCES[data_name].config,
            "grader": GraderConfig,
        }
        for group, schema in schemas.items():
            checked[group] = _merge(group, schema, cfg[group])
        for key in RUN_KEYS:
            checked[key] = cfg.get(key)
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from exc
    out = OmegaConf.create(checked)
    _check_values(out)
    OmegaConf.set_readonly(out, True)
    return out


def _merge(group: str, schema: type, node: Any) -> DictConfig:
    base = OmegaConf.structured(schema)
    known = set(base.keys())
    for key in node:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(f'{group}.{k}' for k in close)}?" if close else ""
            raise ConfigError(
                f"unknown config key '{group}.{key}' for {group} {node.get('name', '')!s}".rstrip()
                + f"{hint} (keys of {group}: {', '.join(sorted(known))})"
            )
        if OmegaConf.is_missing(node, key):  # merge() would silently keep the schema default
            raise ConfigError(f"{group}.{key}: missing mandatory value; set it with {group}.{key}=...")
    try:
        merged = OmegaConf.merge(base, node)
        OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        raise ConfigError(
            f"{group}.{key}: {_one_line(exc)}" if key else f"{group}: {_one_line(exc)}"
        ) from exc
    return merged


def _check_values(cfg: DictConfig) -> None:
    if not isinstance(cfg.seed, int) or cfg.seed < 0:
        raise ConfigError(f"seed: expected a non-negative integer, got {cfg.seed!r}")
    if cfg.engine.kind not in ENGINE_KINDS:
        raise ConfigError(f"engine.kind: expected one of {', '.join(ENGINE_KINDS)}, got {cfg.engine.kind!r}")
    if not isinstance(cfg.engine.restarts, int) or cfg.engine.restarts < 0:
        raise ConfigError(f"engine.restarts: expected an integer >= 0, got {cfg.engine.restarts!r}")
    if cfg.engine.wait_s < 0:
        raise ConfigError(f"engine.wait_s: expected seconds >= 0, got {cfg.engine.wait_s!r}")
    if cfg.engine.kind == "remote" and not cfg.engine.url:
        raise ConfigError("engine.url: a remote engine needs its address; set engine.url=http://host:port")
    if cfg.engine.url is not None and (problem := engine_url_problem(cfg.engine.url)):
        raise ConfigError(f"engine.url: {problem}")
    if cfg.session is not None:
        try:
            check_name(cfg.session, "session")
        except Exception as exc:  # a name the engine would refuse only after the run directory exists
            raise ConfigError(str(exc)) from None
    if cfg.grader.name not in GRADERS:
        raise ConfigError(f"grader.name: expected one of {', '.join(GRADERS)}, got {cfg.grader.name!r}")
    if cfg.grader.name == "sandbox_fusion" and not cfg.grader.url:
        raise ConfigError(
            "grader.url: grader=sandbox_fusion needs its server; set grader.url=http://host:port"
        )
    if cfg.logger.name not in LOGGERS:
        raise ConfigError(f"logger.name: expected one of {', '.join(LOGGERS)}, got {cfg.logger.name!r}")
    loop = cfg.loop
    for key in ("steps", "batch_size", "max_tokens"):
        if loop[key] < 1:
            raise ConfigError(f"loop.{key}: expected a positive integer, got {loop[key]}")
    for key in SCHEDULE:
        if not isinstance(cfg[key], int) or cfg[key] < 0:
            raise ConfigError(f"{key}: expected 0 (off) or a positive integer, got {cfg[key]!r}")
    if cfg.eval_samples and LOOPS[loop.name].data != "envs":
        raise ConfigError(
            f"eval_samples: loop {loop.name} trains on no envs; sampled evaluation needs an RL loop "
            "(grpo, ppo, importance_sampling, code_rl)"
        )
    if loop.learning_rate <= 0:
        raise ConfigError(f"loop.learning_rate: expected a positive number, got {loop.learning_rate}")
    if cfg.model.lora.rank < 1:
        raise ConfigError(f"model.lora.rank: expected a positive integer, got {cfg.model.lora.rank}")


def engine_url_problem(url: str) -> str | None:
    """Why ``url`` cannot address an engine (None when it can): it needs http(s), a host, a valid port."""
    parts = urlsplit(str(url))
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # not a number, or over 65535
        port_ok = False
    if not port_ok:
        return f"{url!r} has no valid port; expected http://host:port"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"expected http://host:port or https://host, got {url!r}"
    return None


def _one_line(exc: BaseException) -> str:
    """Hydra and OmegaConf spread a message over lines with 'full_key: ...' trailers; keep the gist."""
    parts = []
    while exc is not None:
        for line in str(exc).splitlines():
            line = line.strip()
            if line and not line.startswith(("full_key:", "object_type=", "reference_type=")):
                if line not in parts:
                    parts.append(line)
        exc = exc.__cause__
    return "; ".join(parts)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def load(path) -> DictConfig:
    """A recorded ``config.yaml`` re-checked against today's schemas (older records upgraded first)."""
    return validate(_upgrade(OmegaConf.load(path)))


def _upgrade(recorded: DictConfig) -> DictConfig:
    """Older records kept two data settings under ``loop``; they moved to ``data`` (the reward
    belongs to the env, the visiting order to the data), SFT and KTO dropped an unused
    ``temperature``, and the schedule (``eval_every``, ``save_every``, ``eval_samples``) moved to the
    top level, the runner's. Moving them keeps such runs resumable with the same behaviour."""
    plain = OmegaConf.to_container(recorded)
    plain.setdefault("grader", {"name": "local"})  # runs from before the grader group graded nothing
    loop, data = plain.get("loop", {}), plain.get("data", {})
    moved = {"format_penalty": ("arithmetic", "gsm8k"), "shuffle": ("gsm8k", "chat_jsonl", "feedback_jsonl")}
    for key, sources in moved.items():
        if key in loop:
            value = loop.pop(key)
            if data.get("name") in sources:
                data.setdefault(key, value)
    if loop.get("name") in ("sft", "kto"):
        loop.pop("temperature", None)
    for key, default in zip(SCHEDULE, (10, 10, 0)):  # the runner's schedule was a loop's keys once
        plain.setdefault(key, loop.pop(key, default))
    return OmegaConf.create(plain)
