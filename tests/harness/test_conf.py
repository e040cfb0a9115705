"""Config composition: every option of every conf group composes; typos fail naming the key."""

from __future__ import annotations

import dataclasses
from importlib import resources

import pytest
import yaml

from sess.harness import config
from sess.harness.config import ConfigError, LoraConfig
from sess.harness.registry import LOOPS
from sess.loops import grpo
from sess.tasks.arithmetic.problems import ArithmeticData


def _options(group: str) -> list[str]:
    """Every option Hydra offers for ``group``: YAML files in conf/ and dataclasses in its ConfigStore."""
    return config.group_options(group)


# Options that need a value only the user can give.
REQUIRED = {
    ("engine", "remote"): ["engine.url=http://127.0.0.1:1"],
    ("data", "gsm8k"): ["data.path=x.jsonl"],
    ("data", "chat_jsonl"): ["data.path=x.jsonl"],
    ("data", "feedback_jsonl"): ["data.path=x.jsonl"],
    ("data", "env"): ["data.env=my_envs.py:MyEnv"],
    ("data", "code_jsonl"): ["data.path=x.jsonl"],
    ("grader", "sandbox_fusion"): ["grader.url=http://127.0.0.1:1"],
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
    [(g, o) for g in config.GROUPS for o in _options(g)],
)
def test_every_option_composes(group, option):
    overrides = [f"{group}={option}", *REQUIRED.get((group, option), [])]
    cfg = config.compose(overrides)
    assert cfg[group].get("name", cfg[group].get("kind")) == option
    # and the resolved config reloads to itself (what --resume and replays rely on)
    assert config.validate(config.OmegaConf.create(config.to_yaml(cfg))) == cfg


def test_all_groups_have_their_options():
    assert set(_options("loop")) == {"sft", "grpo", "ppo", "importance_sampling", "kto", "code_rl"}
    assert {"smollm2-135m", "gpt-oss-20b", "qwen3-0.6b", "tiny-llama", "tiny-qwen3-32k"} <= set(
        _options("model")
    )
    assert set(_options("data")) == {
        "arithmetic",
        "gsm8k",
        "chat_jsonl",
        "feedback_jsonl",
        "needle",
        "env",
        "code_tasks",
        "code_jsonl",
    }
    assert set(_options("engine")) == {"local", "inprocess", "remote"}
    assert set(_options("logger")) == {"local", "wandb", "mlflow"}
    assert set(_options("grader")) == {"local", "sandbox_fusion"}


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["loop.stpes=2"], "loop.stpes"),
        (["loop=sft", "loop.group_size=4"], "loop.group_size"),
        (["data.max_valeu=9"], "data.max_valeu"),
        (["loop.steps=many"], "loop.steps"),
        (["engine=remote"], "engine.url"),
        (["data=env"], "data.env"),
        (["model.lora.rank=0"], "model.lora.rank"),
        (["loop.format_penalty=0.2"], "loop.format_penalty is now data.format_penalty"),
        (["data=gsm8k"], "data.path"),
        (["sed=1"], "sed"),
    ],
)
def test_typos_fail_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as info:
        config.compose(overrides)
    assert named in str(info.value)
    assert "\n" not in str(info.value)


def test_defaults_are_the_ones_sess_run_has_been_running():
    """The loop and data defaults live in their dataclasses only; these are the values the README's
    learning figures were measured with (they were the YAML files' values)."""
    cfg = config.compose([])
    assert (cfg.loop.learning_rate, cfg.loop.max_tokens, cfg.loop.batch_size, cfg.loop.group_size) == (
        1e-4,
        16,
        8,
        8,
    )
    assert (cfg.loop.loss, cfg.loop.steps, cfg.eval_every, cfg.save_every) == ("ppo", 20, 10, 10)
    assert (cfg.data.max_value, cfg.data.word_problems, cfg.data.eval_size, list(cfg.data.ops)) == (
        20,
        False,
        256,
        ["+", "-"],
    )
    assert cfg.data.instruction == "Reply with just the number." and cfg.data.format_penalty == 0.1
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (32, 64)
    assert dataclasses.asdict(grpo.Config()) == config.OmegaConf.to_container(cfg.loop)
    assert dataclasses.asdict(ArithmeticData()) == config.OmegaConf.to_container(cfg.data)
    for name, loop in LOOPS.items():
        composed = config.compose([f"loop={name}"]).loop
        assert dataclasses.asdict(loop.config()) == config.OmegaConf.to_container(composed), name


def test_conf_yaml_holds_no_default_of_a_schema():
    """conf/ has no loop or data files (their dataclasses are the options), and a model file states
    only LoRA settings that differ from LoraConfig's defaults."""
    conf = resources.files("sess.conf")
    assert not any((conf / group).is_dir() for group in ("loop", "data"))
    defaults = dataclasses.asdict(LoraConfig())
    for path in (conf / "model").iterdir():
        lora = yaml.safe_load(path.read_text()).get("lora", {})
        assert all(defaults[key] != value for key, value in lora.items()), (path.name, lora)


def test_records_from_before_the_env_interface_still_load(tmp_path):
    """Older config.yaml files kept format_penalty and shuffle under loop (and a temperature for SFT);
    --resume moves them to data, where they live now, with their recorded values."""
    grpo_old = config.OmegaConf.to_container(config.compose(["loop.steps=3"]))
    grpo_old["loop"]["format_penalty"] = grpo_old["data"].pop("format_penalty") + 0.15
    sft_old = config.OmegaConf.to_container(
        config.compose(["loop=sft", "data=chat_jsonl", "data.path=x.jsonl"])
    )
    sft_old["loop"].update(shuffle=not sft_old["data"].pop("shuffle"), temperature=1.0)
    for name, old in (("grpo", grpo_old), ("sft", sft_old)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(old))
        loaded = config.load(path)
        assert (
            loaded.loop.name == name and "format_penalty" not in loaded.loop and "shuffle" not in loaded.loop
        )
    assert config.load(tmp_path / "grpo.yaml").data.format_penalty == 0.25
    assert config.load(tmp_path / "sft.yaml").data.shuffle is False


def test_yaml_typo_is_caught_by_the_schema():
    bad = config.OmegaConf.merge(config.compose(["model=tiny-llama"]), {})
    bad = config.OmegaConf.to_container(bad)
    bad["loop"]["lerning_rate"] = 1.0
    with pytest.raises(ConfigError, match="loop.lerning_rate"):
        config.validate(config.OmegaConf.create(bad))


def test_model_targets_match_the_engine_selection():
    """The targets --dry-run shows agree with what the engine wraps (checked on the tiny models)."""
    import torch

    from sess.engine.runtime.models.catalog import load_model, lora_targets

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


def test_a_misspelled_key_names_the_nearest_valid_keys_and_never_suggests_plus():
    with pytest.raises(ConfigError) as typo:
        config.compose(["loop.stpes=3"])
    message = str(typo.value)
    assert "did you mean loop.steps" in message and "+" not in message
    with pytest.raises(ConfigError) as group_typo:
        config.compose(["lop=sft"])
    assert "did you mean loop=" in str(group_typo.value) and "+" not in str(group_typo.value)


def test_an_unknown_option_lists_the_groups_options_on_their_own_lines():
    with pytest.raises(ConfigError) as unknown:
        config.compose(["model=nonexistent-model"])
    lines = str(unknown.value).splitlines()
    assert "model=nonexistent-model" in lines[0] and "search path" not in str(unknown.value).lower()
    assert {line.strip() for line in lines[1:]} == set(config.group_options("model"))
    with pytest.raises(ConfigError, match="did you mean loop=sft"):
        config.compose(["loop=sfx"])
    with pytest.raises(ConfigError, match="loop=grop: there is no such loop"):
        config.compose(["loop=grop"])
