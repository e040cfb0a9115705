"""What a loop trains on: a :class:`Dataset` of one kind, and a task's :class:`Data` of up to three kinds.

A task gives up to three kinds of data, each a :class:`Dataset` (item k of a seeded training order,
and a fixed held-out list): *envs* (environment factories, for the RL loops and greedy evaluation),
*chats* (``messages`` for SFT) and *feedback* (prompt, completion, desirable? for KTO). The types live
here, below the loops and the tasks, so both sides name them without importing each other.

A task whose prompts are sized to the model (a haystack of ``context_tokens`` of the model's tokens)
gives ``fit``: the runner calls it with a :class:`PromptRoom` (the model's tokenizer and context
window) once the session is open and before any item is drawn; it refuses a size the window cannot hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .env import EnvFactory, Messages

T = TypeVar("T")


@dataclass(frozen=True)
class Feedback:
    """A completion of a prompt and whether it is desirable (KTO's binary feedback)."""

    prompt: Messages
    completion: str
    desirable: bool


@dataclass(frozen=True)
class PromptRoom:
    """What a task sizing its prompts needs to know of the model: its tokenizer, its context window
    (None where the engine does not state one), and how many tokens the answer may take."""

    tokenizer: Any
    model: str  # the base model's name, for messages
    window: int | None
    answer_tokens: int  # the loop's max_tokens


@dataclass
class Dataset(Generic[T]):
    """One kind of data: ``train(k)`` is item k of the seeded training order; ``held_out`` is never trained on."""

    train: Callable[[int], T]
    held_out: list[T]
    size: int | None = None  # training items in one epoch; None: unbounded (generated)


@dataclass
class Data:
    name: str
    envs: Dataset[EnvFactory] | None = None
    chats: Dataset[Messages] | None = None
    feedback: Dataset[Feedback] | None = None
    fit: Callable[[PromptRoom], None] | None = None  # prompts sized to the model: call before drawing items

    def fit_to(self, tokenizer, model: str, window: int | None, answer_tokens: int) -> None:
        """Size prompts sized to the model (``fit``) by ``tokenizer`` within ``window``; nothing for
        data whose prompts are fixed."""
        if self.fit is not None and tokenizer is not None:
            self.fit(PromptRoom(tokenizer, model, window, answer_tokens))

    def need(self, kind: str, loop: str) -> Dataset:
        """The dataset of ``kind`` (envs, chats, feedback), or an error that says which data= gives it."""
        kinds = {"envs": self.envs, "chats": self.chats, "feedback": self.feedback}
        if kinds[kind] is None:
            have = [k for k, found in kinds.items() if found is not None]
            raise ValueError(
                f"loop {loop} needs {_DESCRIBED[kind]} data ({kind}), data={self.name} gives {', '.join(have) or 'none'}; "
                "pick another data= (arithmetic gives all three)"
            )
        return kinds[kind]


_DESCRIBED = {"envs": "problem", "chats": "chat", "feedback": "feedback"}
