"""The environment of a question with a numeric answer (arithmetic, GSM8K): one turn, exact-answer reward.

The observation is one user message, the question followed by the data source's instruction
("Reply with just the number."). The reply is scored by its final answer (:mod:`.rewards`): 1 when it
equals the problem's answer, 0 when it is another number, ``-format_penalty`` when it holds no number
at all, so a policy is pushed first to answer, then to answer right. The episode ends after that turn.
"""

from __future__ import annotations

from sess.rl.env import Env, Messages, StepResult

from . import rewards
from .problems import Problem


def problem_prompt(problem: Problem, instruction: str) -> Messages:
    """The user turn that asks ``problem`` (also the prompt of its SFT chat and KTO feedback)."""
    return [{"role": "user", "content": f"{problem.question} {instruction}".strip()}]


class ProblemEnv(Env):
    def __init__(self, problem: Problem, instruction: str, format_penalty: float):
        self.problem = problem
        self.instruction = instruction
        self.format_penalty = format_penalty

    def initial_observation(self) -> Messages:
        return problem_prompt(self.problem, self.instruction)

    def step(self, message: str) -> StepResult:
        reward = rewards.reward(message, self.problem.answer, self.format_penalty)
        correct, parsed = (
            rewards.correct(message, self.problem.answer),
            rewards.parse_answer(message) is not None,
        )
        return StepResult(reward, done=True, metrics={"accuracy": float(correct), "parsed": float(parsed)})
