"""The environment interface: one-turn problems, multi-turn token masks, tools, and a user's env via data=env."""

from __future__ import annotations

import numpy as np
import pytest

from sess.engine import AdamParams, SamplingParams, ServiceClient
from sess.harness.records import read_jsonl
from sess.rl import rendering, rollouts
from sess.rl.env import Env, StepResult, ToolSpec, parse_tool_call
from sess.tasks.arithmetic.problem_env import ProblemEnv
from sess.tasks.arithmetic.problems import Problem

from env_helpers import ScriptedSampler, encode, readme_env
from run_helpers import TINY, run


@pytest.fixture(scope="module")
def svc(sess_home):
    client = ServiceClient("inproc", home=sess_home)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tok(svc):
    return svc.get_tokenizer("tiny-llama")


class Scripted(Env):
    """Two turns: any first reply earns 0.5 and a follow-up question; the second earns 1 and ends."""

    def __init__(self):
        self.turn = 0

    def initial_observation(self):
        return [{"role": "user", "content": "Add 1 and 2."}]

    def step(self, message):
        self.turn += 1
        if self.turn == 1:
            follow_up = [{"role": "user", "content": "Now add 4."}]
            return StepResult(0.5, done=False, observation=follow_up, metrics={"first": 1.0})
        return StepResult(1.0, done=True, metrics={"second": 1.0})


def test_problem_env_is_one_turn_with_the_exact_answer_reward():
    env = ProblemEnv(Problem("What is 2 + 3?", "5"), "Reply with just the number.", format_penalty=0.1)
    assert env.initial_observation() == [
        {"role": "user", "content": "What is 2 + 3? Reply with just the number."}
    ]
    assert not env.tools
    right, wrong, unparsed = env.step("Answer: 5"), env.step("6"), env.step("no idea")
    assert (right.reward, wrong.reward, unparsed.reward) == (1.0, 0.0, -0.1)
    assert right.done and wrong.done and unparsed.done
    assert right.metrics == {"accuracy": 1.0, "parsed": 1.0} and unparsed.metrics == {
        "accuracy": 0.0,
        "parsed": 0.0,
    }


def test_multi_turn_episode_trains_on_sampled_tokens_and_masks_observations(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    first, second = encode(tok, "It is 3.") + [end], encode(tok, "Then 7.") + [end]
    sampler = ScriptedSampler([(first, "stop"), (second, "stop")])
    (group,) = rollouts.rollout_groups(sampler, tok, [[Scripted()]], SamplingParams(max_tokens=8), [11])
    (episode,) = group.episodes_G

    prompt_T = rendering.prompt_tokens(tok, Scripted().initial_observation())
    observation_T = episode.tokens_T[len(prompt_T) + len(first) : -len(second)]
    assert episode.tokens_T == prompt_T + first + observation_T + second
    assert tok.decode(observation_T) == "\n<|im_start|>user\nNow add 4.<|im_end|>\n<|im_start|>assistant\n"
    # The second turn was sampled from exactly the tokens the episode holds before it.
    assert sampler.prompts == [prompt_T, prompt_T + first + observation_T]
    # Weights: 1 on the two replies, 0 on the prompt and the observation; logprobs only where sampled.
    mask = [False] * len(prompt_T) + [True] * len(first) + [False] * len(observation_T) + [True] * len(second)
    assert episode.sampled_T == mask
    assert episode.logprobs_T == [-0.5 if m else 0.0 for m in mask]
    # Sampled + rendered is the chat template's own rendering of the conversation, end of turn aside.
    whole = tok.apply_chat_template(episode.messages, tokenize=False)
    assert tok.decode(episode.tokens_T) + "\n" == whole
    assert [m["content"] for m in episode.messages if m["role"] == "assistant"] == ["It is 3.", "Then 7."]
    assert (episode.reward, episode.metrics, episode.turns) == (1.5, {"first": 1.0, "second": 1.0}, 2)

    datum = rollouts.policy_datum(episode, 2.0)
    advantages = datum.loss_fn_inputs["advantages"].to_numpy()
    assert datum.loss_fn_inputs["target_tokens"].to_numpy().tolist() == episode.tokens_T[1:]
    assert advantages.tolist() == [2.0 if m else 0.0 for m in mask[1:]]


def test_a_reply_cut_at_max_tokens_is_closed_by_the_observation(tok):
    cut, second = encode(tok, "It is"), encode(tok, "7")
    sampler = ScriptedSampler([(cut, "length"), (second, "length")])
    (group,) = rollouts.rollout_groups(sampler, tok, [[Scripted()]], SamplingParams(max_tokens=2), [0])
    (episode,) = group.episodes_G
    n_prompt = len(rendering.prompt_tokens(tok, Scripted().initial_observation()))
    observation_T = episode.tokens_T[n_prompt + len(cut) : -len(second)]
    assert tok.decode(observation_T).startswith("<|im_end|>\n<|im_start|>user\nNow add 4.")
    assert not any(episode.sampled_T[n_prompt + len(cut) : -len(second)])


def test_a_group_samples_its_shared_prompt_once_and_continues_each_member(tok):
    replies = [(encode(tok, f"r{g}"), "stop") for g in range(3)] + [(encode(tok, "x"), "stop")] * 3
    sampler = ScriptedSampler(replies)
    (group,) = rollouts.rollout_groups(sampler, tok, [[Scripted() for _ in range(3)]], SamplingParams(), [5])
    assert len(sampler.prompts) == 1 + 3 and group.rewards_G == [1.5, 1.5, 1.5]
    assert len({tuple(p) for p in sampler.prompts[1:]}) == 3  # each member continues its own conversation


def test_multi_turn_on_a_live_session_trains_on_the_sampled_logprobs(svc):
    """On the engine: the episode's datum gets from forward the logprobs the sampler reported."""
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0)
    try:
        tok = tc.get_tokenizer()
        tc.forward_backward([encode(tok, "warm the adapter up a little")]).result()
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
        sc = tc.save_weights_and_get_sampling_client()
        params = SamplingParams(max_tokens=6, temperature=1.0)
        groups = rollouts.rollout_groups(sc, tok, [[Scripted(), Scripted()]], params, [3])
        for episode in groups[0].episodes_G:
            assert episode.turns == 2 and episode.reward == 1.5
            datum = rollouts.policy_datum(episode, 1.0)
            forward = (
                tc.forward([datum], "importance_sampling").result().loss_fn_outputs[0]["logprobs"].to_numpy()
            )
            sampled = np.asarray(episode.sampled_T[1:])
            assert np.abs(forward[sampled] - np.asarray(episode.logprobs_T[1:])[sampled]).max() < 1e-4
    finally:
        tc.stop()


def test_tools_are_specs_and_calls_parse_from_the_reply(tok):
    spec = ToolSpec("check_solution", "Run the tests on a solution.", {"type": "object", "properties": {}})
    assert spec.to_json()["function"]["name"] == "check_solution"
    call = parse_tool_call(
        'ok <tool_call>\n{"name": "check_solution", "arguments": {"code": "x"}}\n</tool_call>'
    )
    assert call is not None and (call.name, call.arguments) == ("check_solution", {"code": "x"})
    assert parse_tool_call("<tool_call>{not json}</tool_call>") is None and parse_tool_call("none") is None
    messages = [{"role": "user", "content": "hi"}]
    assert (
        rendering.prompt_tokens(tok, messages, [spec.to_json()])[:2]
        == rendering.prompt_tokens(tok, messages)[:2]
    )


def test_the_readme_environment_runs_with_sess_run(sess_home, tmp_path):
    path = readme_env(tmp_path)
    run_dir = run(
        tmp_path / "runs", "data=env", f"data.env={path}:GuessNumber", "loop.steps=1", "loop.group_size=2"
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["kind"] for r in rows] == ["eval", "train", "eval"]
    assert "eval/reward" in rows[0] and "reward/mean" in rows[1]
    assert TINY  # the same tiny overrides as every run test


def test_the_readme_environment_talks_over_several_turns(tmp_path, tok):
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("guess_readme", readme_env(tmp_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    secret = module.GuessNumber(random.Random(0)).secret
    wrong = 1 if secret != 1 else 2
    sampler = ScriptedSampler([(encode(tok, str(wrong)), "length"), (encode(tok, str(secret)), "length")])
    envs = [[module.GuessNumber(random.Random(0))]]
    (group,) = rollouts.rollout_groups(sampler, tok, envs, SamplingParams(max_tokens=4), [0])
    (episode,) = group.episodes_G
    assert episode.turns == 2 and episode.reward == 1.0 and episode.metrics["solved"] == 1.0
    assert "higher" in episode.messages[2]["content"] or "lower" in episode.messages[2]["content"]


class Verbose(Scripted):
    """Scripted, with a follow-up question of ``words`` words."""

    def __init__(self, words: int):
        super().__init__()
        self.words = words

    def step(self, message):
        result = super().step(message)
        if not result.done:
            text = "Now add 4. " + "And then some more. " * self.words
            result = StepResult(result.reward, done=False, observation=[{"role": "user", "content": text}])
        return result


def test_an_observation_past_the_cap_ends_the_episode_before_it(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    first = encode(tok, "It is 3.") + [end]
    params, prompt_T = (
        SamplingParams(max_tokens=8),
        rendering.prompt_tokens(tok, Scripted().initial_observation()),
    )
    sampler = ScriptedSampler([(first, "stop"), (encode(tok, "7"), "stop")])
    (group,) = rollouts.rollout_groups(sampler, tok, [[Verbose(2)]], params, [3], max_observation_tokens=64)
    (short,) = group.episodes_G
    assert short.turns == 2 and not short.failure  # under the cap: the episode goes on
    sampler = ScriptedSampler([(first, "stop")])
    (group,) = rollouts.rollout_groups(sampler, tok, [[Verbose(200)]], params, [3], max_observation_tokens=64)
    (long,) = group.episodes_G
    assert long.tokens_T == prompt_T + first and len(sampler.prompts) == 1  # no observation, no turn 2
    assert (long.turns, long.reward) == (1, 0.5)  # its reward so far stands
    assert "max_observation_tokens=64" in long.failure and group.reasons == [long.failure]
    assert long.messages[-1] == {"role": "assistant", "content": "It is 3."}
    # The default cap applies where a loop sets none.
    sampler = ScriptedSampler([(first, "stop")])
    (group,) = rollouts.rollout_groups(sampler, tok, [[Verbose(400)]], params, [3])
    assert f"={rollouts.MAX_OBSERVATION_TOKENS}:" in group.episodes_G[0].failure


@pytest.mark.parametrize("bad", [0, -1, True, "64", 1.5])
def test_a_bad_observation_cap_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="loop.max_observation_tokens"):
        rollouts.check_observation_cap(bad)
