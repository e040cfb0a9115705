"""Shared pieces of the env and code-RL tests: a scripted stand-in for a sampler, the README's env,
and a small code problem with a right and a wrong answer."""

from __future__ import annotations

import re
from pathlib import Path

from sess.engine import SampledSequence, SampleResponse
from sess.tasks.code.tasks import CodeProblem


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class ScriptedSampler:
    """Stands in for a SamplingClient: replies with scripted token lists, records the prompts it got."""

    def __init__(self, replies: list[tuple[list[int], str]]):
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    def sample(self, prompt, num_samples, params):
        self.prompts.append(list(prompt))
        sequences = []
        for _ in range(num_samples):
            tokens, stop_reason = self.replies.pop(0)
            sequences.append(SampledSequence(list(tokens), [-0.5] * len(tokens), stop_reason))
        return _Done(SampleResponse(sequences))


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def readme_env(tmp_path):
    """The environment the README shows, written to a file as a reader would copy it."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (code,) = re.findall(r"```python\n(# guess\.py.*?)```", readme, re.S)
    path = tmp_path / "guess.py"
    path.write_text(code)
    return path


ADD_TWO = CodeProblem(
    "Write a Python function `add_two(x)` that returns x plus 2.",
    "assert add_two(1) == 3\nassert add_two(-5) == -3\n",
    task_id="add_two",
)
RIGHT = "```python\ndef add_two(x):\n    return x + 2\n```"
WRONG = "```python\ndef add_two(x):\n    return x + 3\n```"
