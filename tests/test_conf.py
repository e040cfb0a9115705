"""Config composition: every option of every conf group composes; typos fail naming the key."""

from __future__ import annotations

from importlib import resources

import pytest

from sess.loops import config
from sess.loops.config import ConfigError


def _options(group: str) -> list[str]:
    folder = resources.files("sess.conf") / group
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


# Options that need a value only the user can give.
REQUIRED = {
    ("engine", "remote"): ["engine.url=http://127.0.0.1:1"],
    ("data", "gsm8k"): ["data.path=x.jsonl"],
    ("data", "chat_jsonl"): ["data.path=x.jsonl"],
    ("data", "feedback_jsonl"): ["data.path=x.jsonl"],
}


def test_default_is_grpo_on_smollm2_arithmetic_local():
    cfg = config.compose([])
    assert (cfg.loop.name, cfg.model.base_model, cfg.data.name, cfg.engine.kind, cfg.logger.name) == (
        "grpo",
        "smollm2-135m",
        "arithmetic",
        "local",
        "local",
    )


@pytest.mark.parametrize(
    "group,option",
    [(g, o) for g in ("engine", "model", "loop", "data", "logger") for o in _options(g)],
)
def test_every_option_composes(group, option):
    overrides = [f"{group}={option}", *REQUIRED.get((group, option), [])]
    cfg = config.compose(overrides)
    assert cfg[group].get("name", cfg[group].get("kind")) == option
    # and the resolved config reloads to itself (what --resume and replays rely on)
    assert config.validate(config.OmegaConf.create(config.to_yaml(cfg))) == cfg


def test_all_groups_have_their_options():
    assert set(_options("loop")) == {"sft", "grpo", "ppo", "importance_sampling", "kto"}
    assert {"smollm2-135m", "gpt-oss-20b", "qwen3-0.6b", "tiny-llama"} <= set(_options("model"))
    assert set(_options("data")) == {"arithmetic", "gsm8k", "chat_jsonl", "feedback_jsonl"}
    assert set(_options("engine")) == {"local", "inprocess", "remote"}
    assert set(_options("logger")) == {"local", "wandb"}


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["loop.stpes=2"], "loop.stpes"),
        (["loop=sft", "loop.group_size=4"], "loop.group_size"),
        (["data.max_valeu=9"], "data.max_valeu"),
        (["loop=grop"], "loop/grop"),
        (["loop.steps=many"], "loop.steps"),
        (["engine=remote"], "engine.url"),
        (["data=gsm8k"], "data.path"),
        (["sed=1"], "sed"),
    ],
)
def test_typos_fail_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as info:
        config.compose(overrides)
    assert named in str(info.value)
    assert "\n" not in str(info.value)


def test_yaml_typo_is_caught_by_the_schema():
    bad = config.OmegaConf.merge(config.compose(["model=tiny-llama"]), {})
    bad = config.OmegaConf.to_container(bad)
    bad["loop"]["lerning_rate"] = 1.0
    with pytest.raises(ConfigError, match="loop.lerning_rate"):
        config.validate(config.OmegaConf.create(bad))


def test_model_targets_match_the_engine_selection():
    """The targets --dry-run shows agree with what the engine wraps (checked on the tiny models)."""
    import torch

    from sess.engine.runtime.catalog import load_model, lora_targets

    for name, arch in [("tiny-llama", "llama"), ("tiny-gpt-oss", "gpt_oss")]:
        cfg = config.compose([f"model={name}"])
        model, _, _ = load_model(name)
        targets = lora_targets(model, train_attn=True, train_mlp=True, train_unembed=True)
        assert set(cfg.model.targets) == set(targets["target_modules"]) | set(
            targets.get("target_parameters", [])
        )
        big = config.compose([f"model={'gpt-oss-20b' if arch == 'gpt_oss' else 'smollm2-135m'}"])
        assert set(big.model.targets) == set(cfg.model.targets)
        del model
        torch.set_grad_enabled(True)
