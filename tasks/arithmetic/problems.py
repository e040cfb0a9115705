"""A seeded generator of arithmetic word problems: the embedded task every loop can run and score offline.

Problem ``k`` of a split is a pure function of ``(seed, split, k)``, so a step's batch is the same in
every run with that seed (and after a resume). Held-out problems are drawn first; a train problem
that happens to equal a held-out one (same numbers, operation and story) is skipped, so the splits
never overlap. Difficulty knobs (:class:`ArithmeticData`, the ``data=arithmetic`` config and its
defaults): the operand range, the operations, the number of operands and word problems or bare sums.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# One short story per operation; {a} {b} are the operands, the answer is a OP b.
_STORIES = {
    "+": [
        "{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
        "A box holds {a} {thing}. {name} puts in {b} more. How many {thing} are in the box?",
    ],
    "-": [
        "{name} has {a} {thing} and gives away {b}. How many {thing} are left?",
        "A shelf holds {a} {thing}. {name} takes {b} of them. How many {thing} remain on the shelf?",
    ],
    "*": [
        "{name} buys {a} bags with {b} {thing} in each bag. How many {thing} is that in total?",
    ],
}
_NAMES = ["Tom", "Ana", "Li", "Sam", "Maya", "Omar", "Eva", "Raj"]
_THINGS = ["apples", "books", "coins", "pens", "stamps", "cards", "shells", "marbles"]


@dataclass
class ArithmeticData:
    """``data=arithmetic``: the knobs of the generator and of the prompt (``sess run``'s defaults).

    The README's learning figures are measured with these values.
    """

    name: str = "arithmetic"
    eval_size: int = 256  # held-out problems: a standard error of about 3 points on accuracy
    min_value: int = 1
    max_value: int = 20
    ops: list[str] = field(default_factory=lambda: ["+", "-"])  # any of + - *
    operands: int = 2
    word_problems: bool = False  # true: "Ana has 12 shells and gets 7 more. ..." (harder for a 135M model)
    instruction: str = "Reply with just the number."
    format_penalty: float = 0.1  # reward of a reply with no number in it


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the exact final answer, as a number string
    solution: str = ""  # a short worked solution ending in the answer (for SFT chats)


def _make(rng: random.Random, min_value: int, max_value: int, ops: list[str], word_problems: bool) -> Problem:
    op = rng.choice(ops)
    a, b = rng.randint(min_value, max_value), rng.randint(min_value, max_value)
    if op == "-" and b > a:
        a, b = b, a  # keep answers non-negative: the stories take away what is there
    if op == "*":
        b = rng.randint(2, 9)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    if word_problems:
        story = rng.choice(_STORIES[op])
        question = story.format(a=a, b=b, name=rng.choice(_NAMES), thing=rng.choice(_THINGS))
    else:
        question = f"What is {a} {op} {b}?"
    return Problem(question, str(value), f"{a} {op} {b} = {value}.")


class ArithmeticProblems:
    """Train and held-out problems; ``train(k)`` is the k-th train problem of this seed."""

    def __init__(self, seed: int, knobs: ArithmeticData | None = None):
        knobs = knobs or ArithmeticData()
        ops, min_value, max_value = list(knobs.ops), knobs.min_value, knobs.max_value
        unknown = [op for op in ops if op not in _STORIES]
        if unknown or not ops:
            raise ValueError(f"data.ops: expected a non-empty subset of {list(_STORIES)}, got {ops}")
        if min_value > max_value or min_value < 0:
            raise ValueError(f"data.min_value/max_value: need 0 <= min <= max, got {min_value}..{max_value}")
        if knobs.operands != 2:
            raise ValueError("data.operands: only 2 operands are supported")
        self.seed = seed
        self._knobs = (min_value, max_value, ops, knobs.word_problems)
        self.eval_problems = [self._draw("eval", k) for k in range(knobs.eval_size)]
        self._held_out = {p.question for p in self.eval_problems}
        self._cache: dict[int, Problem] = {}

    def _draw(self, split: str, k: int, attempt: int = 0) -> Problem:
        return _make(random.Random(f"{self.seed}/{split}/{k}/{attempt}"), *self._knobs)

    def train(self, k: int) -> Problem:
        if k not in self._cache:
            for attempt in range(1000):
                problem = self._draw("train", k, attempt)
                if problem.question not in self._held_out:
                    break
            else:
                raise ValueError("data: the held-out set covers every problem; widen min_value..max_value")
            self._cache[k] = problem
        return self._cache[k]

    def wrong_answer(self, k: int, problem: Problem) -> str:
        """A plausible wrong answer (off by a small amount) for KTO's undesirable examples."""
        rng = random.Random(f"{self.seed}/wrong/{k}")
        return str(int(problem.answer) + rng.choice([-10, -2, -1, 1, 2, 10]))
