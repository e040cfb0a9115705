"""The environment interface RL loops train against: one episode of a conversation with a reward.

An :class:`Env` is single-use: it is one episode. It opens with an observation (chat messages, usually
one user turn) and offers tools (``tools``: name, description, JSON-schema parameters; rendered into
the prompt by the tokenizer's chat template). Each turn the policy's reply (the assistant message as
text) goes to :meth:`Env.step`, which answers with a :class:`StepResult`: a reward, whether the episode
is over, and otherwise the next observation messages (a tool result, the next user turn) that are
appended to the conversation before the policy speaks again. ``metrics`` are numbers worth averaging
(``accuracy``, ``parsed``); the loops log their batch means and evaluation their held-out means.
``failure`` says why an episode ended badly rather than just wrongly (a malformed tool call, a solution
that hung); the loops record it with the step. An env that raises, or answers a reward that is not a
finite number, ends only its own episode: :mod:`.rollouts` records the reason and the run goes on.

``max_turns`` is set by the rollout before the first turn: the most replies this episode will get. An
env whose offer depends on it reads it (a tool is worth offering only with a turn left to use its
result); the episode is cut after that many replies whatever the env says.

An env that offers tools parses the call from the reply text itself; :func:`parse_tool_call` reads
the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` form that Hermes-style templates
(Qwen, SmolLM3) teach their models. A *group* is several envs built from one factory: the same
problem attempted G times, which is what group-relative advantages compare.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Messages = list[dict]


@dataclass(frozen=True)
class ToolSpec:
    """A tool the env offers; ``parameters`` is a JSON schema of the arguments object."""

    name: str
    description: str
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_json(self) -> dict:
        """The OpenAI-style function entry chat templates take as ``tools=[...]``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class StepResult:
    reward: float
    done: bool
    observation: Messages = field(default_factory=list)  # what the env says next, when not done
    metrics: dict[str, float] = field(default_factory=dict)
    failure: str = ""  # why the episode ended badly ("malformed tool call: ..."), recorded by the loops


class Env(ABC):
    """One episode. Subclasses write :meth:`initial_observation` and :meth:`step`; ``tools`` is optional."""

    tools: Sequence[ToolSpec] = ()
    max_turns: int = 1  # set by the rollout before the first turn (see the module docstring)

    @abstractmethod
    def initial_observation(self) -> Messages:
        """The conversation the policy first replies to, e.g. ``[{"role": "user", "content": ...}]``."""

    @abstractmethod
    def step(self, message: str) -> StepResult:
        """Score the policy's reply ``message`` and say what happens next."""


EnvFactory = Callable[[], Env]  # a fresh env for one problem; called once per member of a group


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_tool_call(text: str) -> ToolCall | None:
    """The first ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``, if well formed."""
    match = _TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return ToolCall(call["name"], arguments if isinstance(arguments, dict) else {})
