"""The environment of a programming problem: the model writes a Python solution, a sandbox runs the tests.

The observation is one user message: the problem's prompt and the instruction to answer with the
code in a ```python block. A final answer is graded by running *all* of its code blocks, joined in
order (a definition followed by an example of its use runs as the script it is), then the problem's
tests, in the grader's sandbox: reward 1 when every test passes, 0 otherwise, and
``-format_penalty`` when the reply has no code block at all. A block the token limit cut off counts
up to where it stops when it is the only one, and is dropped after complete ones. Metrics: ``accuracy`` (all tests passed, also ``accuracy/<source>`` so a
held-out set that mixes generated tasks and HumanEval reports each), ``has_code``, ``tool_calls``.

With more than one turn (``loop.max_turns=2``) the env offers the ``check_solution`` tool on every
turn but the last: a reply that calls it (``<tool_call>{"name": "check_solution", "arguments":
{"code": "..."}}</tool_call>``, rendered natively or by the fallback of :mod:`sess.rl.rendering`) gets the
test verdict back as a tool message and another turn; the episode's reward is the final answer's.
A tool call whose arguments are malformed (not JSON, another tool, no ``code`` string) ends the
episode with ``-format_penalty`` and the reason; a solution that outruns the sandbox's limits ends it
with 0 and the grader's reason ("timeout: wall time over 10 s").
"""

from __future__ import annotations

import re
from typing import Protocol

from sess.rl.env import Env, Messages, StepResult, ToolSpec, parse_tool_call

from .tasks import CodeProblem

CHECK_SOLUTION = ToolSpec(
    "check_solution",
    "Run the problem's unit tests on a solution and say whether they pass, and if not, why.",
    {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the complete Python solution"}},
        "required": ["code"],
    },
)
INSTRUCTION = "Reply with the function in a ```python code block."
TOOL_INSTRUCTION = (
    "Before your final answer you may call check_solution once with your code to run the tests on it."
)
# Verdict kinds that are the solution misbehaving rather than merely being wrong (see sess.sandbox).
FAILURE_KINDS = ("timeout", "memory limit", "output limit", "crashed", "exited early", "sandbox error")

_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(```|\Z)", re.S | re.I)


class Grader(Protocol):
    """What the env needs of a grader: ``sess.sandbox.Grader`` or ``SandboxFusionGrader``."""

    def grade(self, job): ...


def code_blocks(text: str) -> str | None:
    """The reply's closed code blocks joined in order; with none, a block the token limit cut off (an
    example cut off after a complete answer is dropped, not run); None when the reply has no block."""
    found = [(code, end) for code, end in _BLOCK.findall(text) if code.strip()]
    closed = [code for code, end in found if end]
    blocks = closed or [code for code, _ in found]
    return "\n".join(blocks) if blocks else None


class CodeEnv(Env):
    def __init__(self, problem: CodeProblem, grader: Grader, format_penalty: float = 0.1):
        self.problem = problem
        self.grader = grader
        self.format_penalty = format_penalty
        self.turn = 0

    @property
    def tools(self):
        return (CHECK_SOLUTION,) if self.max_turns > 1 else ()

    def initial_observation(self) -> Messages:
        instruction = INSTRUCTION + (" " + TOOL_INSTRUCTION if self.tools else "")
        return [{"role": "user", "content": f"{self.problem.prompt}\n\n{instruction}"}]

    def step(self, message: str) -> StepResult:
        self.turn += 1
        if self.turn < self.max_turns and "<tool_call>" in message:
            return self._tool_call(message)
        return self._final(message)

    def _tool_call(self, message: str) -> StepResult:
        call = parse_tool_call(message)
        problem = None
        if call is None:
            problem = "not a JSON object with a name"
        elif call.name != CHECK_SOLUTION.name:
            problem = f"no tool named {call.name!r} (there is check_solution)"
        elif not isinstance(call.arguments.get("code"), str) or not call.arguments["code"].strip():
            problem = "check_solution needs {'code': <the solution as a string>}"
        if problem is not None:
            return StepResult(
                -self.format_penalty,
                done=True,
                metrics={"accuracy": 0.0, "has_code": 0.0, "tool_calls": 1.0},
                failure=f"malformed tool call: {problem}",
            )
        code = code_blocks(call.arguments["code"]) or call.arguments["code"]
        verdict = self.grader.grade(self._job(code))
        shown = "All tests passed." if verdict.passed else f"The tests did not pass: {verdict.reason}"
        result = {"role": "tool", "name": CHECK_SOLUTION.name, "content": shown}
        return StepResult(0.0, done=False, observation=[result], metrics={"tool_calls": 1.0})

    def _final(self, message: str) -> StepResult:
        tag = f"accuracy/{self.problem.source}"
        code = code_blocks(message)
        if code is None:
            return StepResult(
                -self.format_penalty, done=True, metrics={"accuracy": 0.0, tag: 0.0, "has_code": 0.0}
            )
        verdict = self.grader.grade(self._job(code))
        passed = float(verdict.passed)
        return StepResult(
            passed,
            done=True,
            metrics={"accuracy": passed, tag: passed, "has_code": 1.0},
            failure=verdict.reason if verdict.kind in FAILURE_KINDS else "",
        )

    def _job(self, code: str):
        from sess.sandbox import GradeJob  # the sandbox package is only needed once something is graded

        problem = self.problem
        if problem.entry_point and f"def {problem.entry_point}" not in code:
            code = problem.prompt_code + code  # a body completing the prompt's own stub (HumanEval style)
        return GradeJob(problem.header + code, problem.tests, problem.entry_point)
