"""data=needle: haystacks a pure function of (seed, split, k) and the tokenizer, prompts within
``context_tokens`` of the model's tokens, the reward, refusals over the window, and `sess run` on it."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from sess.cli.main import app
from sess.engine.runtime.models.tiny_models import build_tiny_tokenizer
from sess.harness import config as config_mod
from sess.harness.records import read_jsonl
from sess.rl import rendering
from sess.rl.data import PromptRoom
from sess.tasks import sources
from sess.tasks.needle.haystack import FILLER, NEEDLE
from sess.tasks.needle.needle_env import found
from sess.tasks.needle.source import NeedleData

from run_helpers import cli, run


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _data(tok, seed=0, window=4096, answer=16, **knobs):
    cfg = OmegaConf.structured(NeedleData(**knobs))
    data = sources.load(cfg, seed)
    data.fit(PromptRoom(tok, "tiny-llama", window, answer))
    return data


def _prompt(make_env) -> str:
    return make_env().initial_observation()[0]["content"]


def _length(tok, make_env) -> int:
    return len(rendering.prompt_tokens(tok, make_env().initial_observation()))


def test_haystacks_are_a_function_of_the_seed(tok):
    a, b, other = (
        _data(tok, 3, context_tokens=512),
        _data(tok, 3, context_tokens=512),
        _data(tok, 4, context_tokens=512),
    )
    for k in range(4):
        assert _prompt(a.envs.train(k)) == _prompt(b.envs.train(k))
        assert a.chats.train(k) == b.chats.train(k)
    assert [_prompt(e) for e in a.envs.held_out] == [_prompt(e) for e in b.envs.held_out]
    assert _prompt(a.envs.train(0)) != _prompt(other.envs.train(0))
    assert _prompt(a.envs.train(0)) != _prompt(a.envs.train(1))


@pytest.mark.parametrize("context_tokens", [256, 1024, 4000])
def test_prompts_fill_the_budget_without_passing_it(tok, context_tokens):
    data = _data(tok, context_tokens=context_tokens, eval_size=5)
    longest_sentence = max(len(rendering.encode(tok, " " + s)) for s in FILLER)
    for make_env in [*data.envs.held_out, *(data.envs.train(k) for k in range(3))]:
        assert context_tokens - 2 * longest_sentence <= _length(tok, make_env) <= context_tokens
        env = make_env()
        text = env.initial_observation()[0]["content"]
        assert text.count("secret code") == 2  # the needle, and the question at the end
        assert NEEDLE.format(code=env.haystack.code) in text and text.endswith("Reply with just the code.")


def test_held_out_needles_span_the_document_and_train_never_asks_a_held_out_code(tok):
    data = _data(tok, context_tokens=512, eval_size=5)
    envs = [make() for make in data.envs.held_out]
    assert [e.haystack.depth for e in envs] == [0.0, 0.25, 0.5, 0.75, 1.0]
    first, last = envs[0].initial_observation()[0]["content"], envs[-1].initial_observation()[0]["content"]
    assert first.startswith("The secret code is") and not last.startswith("The secret code is")
    held = {e.haystack.code for e in envs}
    assert all(len(code) == 4 for code in held)
    assert not held & {data.envs.train(k)().haystack.code for k in range(200)}


def test_reward_is_one_only_for_the_code(tok):
    env = _data(tok, context_tokens=256).envs.train(0)()
    code = env.haystack.code
    assert env.step(f"The secret code is {code}.").reward == 1.0
    assert env.step(code).metrics["accuracy"] == 1.0
    assert env.step(str(int(code) + 1)).reward == 0.0
    assert env.step(f"{code}7").reward == 0.0 and env.step("I do not know.").reward == 0.0
    assert found(f"code: {code}", code) and not found(f"9{code}", code)


def test_sft_chats_end_with_the_code(tok):
    data = _data(tok, context_tokens=256, eval_size=2)
    chat = data.chats.train(0)
    assert chat[-1] == {"role": "assistant", "content": data.envs.train(0)().haystack.code}
    assert chat[0] == data.envs.train(0)().initial_observation()[0]
    assert [c[-1]["content"] for c in data.chats.held_out] == [e().haystack.code for e in data.envs.held_out]


def test_a_prompt_over_the_window_is_refused_before_any_is_drawn(tok):
    cfg = OmegaConf.structured(NeedleData(context_tokens=4096))
    data = sources.load(cfg, 0)
    with pytest.raises(RuntimeError, match="fit"):
        data.envs.train(0)
    with pytest.raises(ValueError) as err:
        data.fit(PromptRoom(tok, "tiny-llama", 4096, 64))
    message = str(err.value)
    assert "context window of 4096" in message and "data.context_tokens <= 4032" in message
    data.fit(PromptRoom(tok, "tiny-llama", 32768, 64))  # a longer window holds it
    assert _length(tok, data.envs.train(0)) <= 4096
    with pytest.raises(ValueError, match="data.context_tokens >= "):
        _data(tok, context_tokens=20)


def test_config_composes_with_its_knobs():
    cfg = config_mod.compose(["data=needle", "data.context_tokens=2048", "loop=sft"])
    assert cfg.data.name == "needle" and cfg.data.context_tokens == 2048 and cfg.data.eval_size == 32
    with pytest.raises(config_mod.ConfigError, match="data.context_tokenz"):
        config_mod.compose(["data=needle", "data.context_tokenz=2048"])


# about 15 s (grpo) and 10 s (sft) with the machine to themselves
@pytest.mark.parametrize("loop", ["grpo", pytest.param("sft", marks=pytest.mark.slow)])
def test_sess_run_trains_on_haystacks(sess_home, tmp_path, loop):
    group = ["loop.group_size=2"] if loop == "grpo" else []
    run_dir = run(tmp_path, f"loop={loop}", "data=needle", "data.context_tokens=384", "loop.steps=1", *group)
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "completed"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0), ("train", 1), ("eval", 1)]
    assert 0 <= rows[0]["eval/accuracy"] <= 1
    usage = json.loads((run_dir / "usage.json").read_text())
    # every prompt the engine saw is a haystack of 384 tokens at most, not much less: 4 held-out
    # prompts at each of the two evaluations, and (grpo) the 2 training prompts
    prompts = 8 + (2 if loop == "grpo" else 0)
    assert prompts * 300 <= usage["prefill_tokens"] <= prompts * 384
    if loop == "sft":
        assert 2 * 300 <= usage["training_tokens"] <= 2 * 400


def test_sess_run_refuses_a_haystack_longer_than_the_window(sess_home, tmp_path):
    args = ["run", "model=tiny-llama", "engine=inprocess", f"runs_dir={tmp_path}", "data=needle"]
    result = cli.invoke(app, [*args, "data.context_tokens=8192", "loop.max_tokens=8"])
    assert result.exit_code == 1
    assert "data.context_tokens=8192" in result.output and "context window of 4096" in result.output
    assert "data.context_tokens <= 4088" in result.output, result.output
