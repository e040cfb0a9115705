"""The environment of one haystack: one turn, reward 1 when the reply holds the secret code.

The observation is the document followed by the question and the instruction ("Reply with just the
code."). The reply scores 1 when the code appears in it as a number of its own (not inside a longer
run of digits), else 0; ``accuracy`` is that score. The episode ends after the one turn.
"""

from __future__ import annotations

import re

from sess.rl.env import Env, Messages, StepResult

from .haystack import Haystack


def found(reply: str, code: str) -> bool:
    """Whether ``reply`` names ``code``: the digits, not flanked by other digits."""
    return re.search(rf"(?<!\d){re.escape(code)}(?!\d)", reply) is not None


class NeedleEnv(Env):
    def __init__(self, haystack: Haystack):
        self.haystack = haystack

    def initial_observation(self) -> Messages:
        return self.haystack.prompt()

    def step(self, message: str) -> StepResult:
        reward = float(found(message, self.haystack.code))
        return StepResult(reward, done=True, metrics={"accuracy": reward})
