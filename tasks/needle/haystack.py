"""A seeded needle in a haystack: one "The secret code is NNNN." among filler, sized in the model's tokens.

Problem ``k`` of a split is a pure function of ``(seed, split, k)`` and the model's tokenizer: a code
of ``code_digits`` digits, a depth (where the needle sits: 0 at the start of the document, 1 at its
end; drawn for training problems, evenly spread over the held-out ones, so held-out accuracy covers
every depth), and filler sentences drawn from a fixed pool until the rendered prompt (chat template,
document, question) holds as many tokens as ``context_tokens`` allows, never more. Held-out codes are
drawn first and no training problem asks one of them.

Prompts are measured with the tokenizer of the model they are for, so the data is sized before use:
:meth:`Haystacks.fit` takes a :class:`~sess.rl.data.PromptRoom` (the run's tokenizer, context window
and answer length) and refuses a ``context_tokens`` that, with the answer, is over the window.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sess.rl import rendering
from sess.rl.data import PromptRoom
from sess.rl.env import Messages

T = TypeVar("T")

# Bland sentences with no number in them, so the code is the only number in the document.
FILLER = [
    "The grass is green and the sky is blue.",
    "A light wind moved through the trees by the river.",
    "The market opened early and closed before the evening rain.",
    "Most of the houses on the hill have red roofs.",
    "The old bridge was rebuilt with stone from the quarry.",
    "In the morning the baker sells bread to the neighbours.",
    "The library keeps its maps in a room on the top floor.",
    "Clouds gathered over the valley and then drifted east.",
    "The children walked to school along the canal.",
    "A small boat was tied to the post at the end of the pier.",
    "The museum shows paintings of ships and harbours.",
    "Every spring the orchard is white with blossom.",
    "The road to the village winds between low stone walls.",
    "At night the lighthouse turns its lamp over the water.",
    "The farmer keeps sheep in the field behind the barn.",
    "Tea was served in the garden while the bees hummed.",
    "The train left the station and crossed the plain.",
    "Snow covered the mountains long before it reached the town.",
    "The square fills with music on market days.",
    "A cat slept on the warm step in front of the shop.",
    "The fishermen mended their nets on the beach.",
    "The clock in the tower is wound by hand each week.",
    "Wild flowers grow along the edge of the forest path.",
    "The river is wide and slow where it meets the sea.",
    "The teacher read a story about a fox and a crow.",
    "Lanterns hung from the branches during the festival.",
    "The painter mixed blue and yellow to make green.",
    "Travellers rested at the inn before crossing the pass.",
    "The well in the courtyard has not been used for years.",
    "Gulls circled above the harbour looking for scraps.",
]
NEEDLE = "The secret code is {code}."
QUESTION = "What is the secret code?"


@dataclass(frozen=True)
class Haystack:
    document: str  # filler with the needle sentence at ``depth``
    code: str  # the answer: the digits of the needle
    depth: float  # the needle's place in the document, 0 (start) to 1 (end)
    instruction: str

    def prompt(self) -> Messages:
        """The user turn: the document, then the question and the instruction."""
        return [{"role": "user", "content": f"{self.document}\n\n{QUESTION} {self.instruction}".strip()}]


class LazyList(Sequence[T]):
    """A fixed-length list whose items are made on first access (and kept): held-out data that is
    sized to the model can be listed before the model's tokenizer is known."""

    def __init__(self, size: int, make: Callable[[int], T]):
        self._size, self._make, self._items = size, make, {}

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._size))]
        if not -self._size <= index < self._size:
            raise IndexError(index)
        index %= self._size
        if index not in self._items:
            self._items[index] = self._make(index)
        return self._items[index]


class Haystacks:
    """Train and held-out haystacks of ``seed``; ``train(k)`` is the k-th train problem (after :meth:`fit`)."""

    def __init__(self, seed: int, context_tokens: int, eval_size: int, code_digits: int, instruction: str):
        if not 1 <= code_digits <= 12:
            raise ValueError(f"data.code_digits: expected 1 to 12, got {code_digits}")
        if eval_size < 0:
            raise ValueError(f"data.eval_size: expected an integer >= 0, got {eval_size}")
        if context_tokens < 1:
            raise ValueError(f"data.context_tokens: expected a positive integer, got {context_tokens}")
        self.seed, self.context_tokens, self.eval_size = seed, context_tokens, eval_size
        self.digits, self.instruction = code_digits, instruction
        # held-out codes first: a training problem never asks one of them
        self._held_codes = [self._code(random.Random(f"{seed}/eval/{k}")) for k in range(eval_size)]
        self._held_set = set(self._held_codes)
        if len(self._held_set) >= 10**code_digits - 10 ** (code_digits - 1):
            raise ValueError(
                f"data.eval_size: {eval_size} held-out codes leave no {code_digits}-digit code to train on"
            )
        self._tok: Any = None
        self._costs: list[int] = []

    def _code(self, rng: random.Random) -> str:
        return str(rng.randrange(10 ** (self.digits - 1), 10**self.digits))

    def fit(self, room: PromptRoom) -> None:
        """Size the prompts for ``room``'s model; refuses a ``context_tokens`` its window cannot hold."""
        n, answer = self.context_tokens, room.answer_tokens
        if room.window is not None and n + answer > room.window:
            raise ValueError(
                f"data.context_tokens={n}: a prompt of {n} tokens and an answer of up to {answer} "
                f"(loop.max_tokens) need {n + answer} tokens, over {room.model}'s context window of "
                f"{room.window}; set data.context_tokens <= {room.window - answer}"
            )
        tok = room.tokenizer
        costs = [len(rendering.encode(tok, " " + sentence)) for sentence in FILLER]
        bare = self._haystack([], "9" * self.digits, 0.0).prompt()
        least = len(rendering.prompt_tokens(tok, bare)) + max(costs)
        if least > n:
            raise ValueError(
                f"data.context_tokens={n}: the question, the needle and one filler sentence take up to "
                f"{least} tokens of {room.model}; give data.context_tokens >= {least}"
            )
        self._tok, self._costs = tok, costs

    def held_out(self, k: int) -> Haystack:
        depth = k / (self.eval_size - 1) if self.eval_size > 1 else 0.5
        return self._draw("eval", k, self._held_codes[k], depth)

    def train(self, k: int) -> Haystack:
        rng = random.Random(f"{self.seed}/train/{k}/code")
        code = self._code(rng)
        while code in self._held_set:
            code = self._code(rng)
        return self._draw("train", k, code, rng.random())

    def _draw(self, split: str, k: int, code: str, depth: float) -> Haystack:
        if self._tok is None:
            raise RuntimeError(
                "data=needle: its prompts are sized to the model; call fit(PromptRoom(...)) first"
            )
        return self._fill(random.Random(f"{self.seed}/{split}/{k}/filler"), code, depth)

    def _haystack(self, filler: list[str], code: str, depth: float) -> Haystack:
        at = round(depth * len(filler))
        sentences = [*filler[:at], NEEDLE.format(code=code), *filler[at:]]
        return Haystack(" ".join(sentences), code, depth, self.instruction)

    def _length(self, haystack: Haystack) -> int:
        return len(rendering.prompt_tokens(self._tok, haystack.prompt()))

    def _fill(self, rng: random.Random, code: str, depth: float) -> Haystack:
        room = self.context_tokens - self._length(self._haystack([], code, depth))
        filler: list[str] = []
        while True:  # sentence by sentence, while the next one fits by its own count
            pick = rng.randrange(len(FILLER))
            if self._costs[pick] > room:
                break
            filler.append(FILLER[pick])
            room -= self._costs[pick]
        haystack = self._haystack(filler, code, depth)
        while self._length(haystack) > self.context_tokens:  # tokens merge across sentences: trim to fit
            filler.pop()
            haystack = self._haystack(filler, code, depth)
        return haystack
