"""A seeded generator of small function-writing tasks with unit tests: the code RL set a CPU model can learn.

Each task asks for one Python function by name and signature ("Write a Python function
`add_seven(x)` that returns x plus 7.") and comes with 4 asserts computed from a reference
implementation on seeded inputs. There are a few dozen *families* (arithmetic on a number, a pair, a
list, a string, with or without a constant k); a task is a family with its constant, its function
name and its argument name drawn from ``random.Random((seed, split, k, attempt))``, so task k of a
split is the same in every run with that seed and after a resume. Held-out tasks are drawn first; a
train task with the same prompt as a held-out one is redrawn, so the splits never overlap (held-out
tasks are new instances of the same families: another constant, another name).

The families are sized to SmolLM2-135M-Instruct: sampled at temperature 0.7-0.8 it passes about 40 %
of them, greedily about two thirds (67 % of 64 held-out tasks). Its failures are what RL has to work
on: a function under another name, an example that calls it wrongly, a wrong idiom for a two-step
family (product of a list, longest word, digit count). The first 36 families alone left too little
room (greedy 77 %), hence the harder 15.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
_WORDS = ["apple", "level", "python", "noon", "banana", "sky", "racecar", "tree", "Hello", "data", "a", ""]
N_TESTS = 4


@dataclass(frozen=True)
class CodeProblem:
    """One programming problem: what the user asks, the tests that judge an answer, and its source.

    ``tests`` are Python statements run after the solution (asserts), or with ``entry_point`` a
    HumanEval-style ``def check(candidate)`` called on the solution's ``entry_point`` function.
    """

    prompt: str
    tests: str
    entry_point: str | None = None
    source: str = "generated"  # generated | humaneval | code_jsonl
    task_id: str = ""
    header: str = ""  # put before every solution (HumanEval's imports)
    prompt_code: str = ""  # a stub the answer may complete with just a body (HumanEval's prompt)


@dataclass(frozen=True)
class _Family:
    name: str  # function name; {k} and {w} (k as a word) are filled in
    args: tuple[str, ...]  # argument kinds: int, nat (0..12), pair, ints (a list), word
    does: str  # what it returns, with {a}/{b} the argument names and {k} the constant
    ref: Callable  # ref(k, *args)
    ks: tuple[int, int] = (0, 0)  # the constant's range (inclusive); (0, 0): none


def _count_vowels(s: str) -> int:
    return sum(c in "aeiouAEIOU" for c in s)


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _fact(n: int) -> int:
    out = 1
    for i in range(2, n + 1):
        out *= i
    return out


_FAMILIES = [
    _Family("add_{w}", ("int",), "returns {a} plus {k}", lambda k, a: a + k, (2, 10)),
    _Family("subtract_{w}", ("int",), "returns {a} minus {k}", lambda k, a: a - k, (2, 10)),
    _Family("times_{w}", ("int",), "returns {a} multiplied by {k}", lambda k, a: a * k, (2, 10)),
    _Family("power_{w}", ("int",), "returns {a} raised to the power {k}", lambda k, a: a**k, (2, 4)),
    _Family(
        "is_divisible_by_{w}",
        ("int",),
        "returns True if {a} is divisible by {k}, else False",
        lambda k, a: a % k == 0,
        (2, 9),
    ),
    _Family(
        "remainder_{w}", ("nat",), "returns the remainder of {a} divided by {k}", lambda k, a: a % k, (2, 9)
    ),
    _Family("is_even", ("int",), "returns True if {a} is even, else False", lambda k, a: a % 2 == 0),
    _Family("is_odd", ("int",), "returns True if {a} is odd, else False", lambda k, a: a % 2 == 1),
    _Family("is_positive", ("int",), "returns True if {a} is greater than 0, else False", lambda k, a: a > 0),
    _Family("absolute", ("int",), "returns the absolute value of {a}", lambda k, a: abs(a)),
    _Family("square", ("int",), "returns {a} squared", lambda k, a: a * a),
    _Family("add", ("int", "int"), "returns the sum of {a} and {b}", lambda k, a, b: a + b),
    _Family("multiply", ("int", "int"), "returns the product of {a} and {b}", lambda k, a, b: a * b),
    _Family("maximum", ("int", "int"), "returns the larger of {a} and {b}", lambda k, a, b: max(a, b)),
    _Family("minimum", ("int", "int"), "returns the smaller of {a} and {b}", lambda k, a, b: min(a, b)),
    _Family("list_sum", ("ints",), "returns the sum of the numbers in the list {a}", lambda k, a: sum(a)),
    _Family(
        "list_max", ("ints",), "returns the largest number in the non-empty list {a}", lambda k, a: max(a)
    ),
    _Family(
        "list_min", ("ints",), "returns the smallest number in the non-empty list {a}", lambda k, a: min(a)
    ),
    _Family("list_length", ("ints",), "returns the number of elements in the list {a}", lambda k, a: len(a)),
    _Family(
        "first_element", ("ints",), "returns the first element of the non-empty list {a}", lambda k, a: a[0]
    ),
    _Family(
        "last_element", ("ints",), "returns the last element of the non-empty list {a}", lambda k, a: a[-1]
    ),
    _Family("reverse_list", ("ints",), "returns the list {a} in reverse order", lambda k, a: a[::-1]),
    _Family(
        "sort_list",
        ("ints",),
        "returns the numbers of {a} sorted in increasing order",
        lambda k, a: sorted(a),
    ),
    _Family(
        "count_{w}s",
        ("ints",),
        "returns how many times the number {k} appears in the list {a}",
        lambda k, a: a.count(k),
        (1, 5),
    ),
    _Family(
        "scale_by_{w}",
        ("ints",),
        "returns a new list with every number of {a} multiplied by {k}",
        lambda k, a: [x * k for x in a],
        (2, 9),
    ),
    _Family(
        "above_{w}",
        ("ints",),
        "returns a list of the numbers in {a} that are greater than {k}, in order",
        lambda k, a: [x for x in a if x > k],
        (1, 6),
    ),
    _Family(
        "even_numbers",
        ("ints",),
        "returns a list of the even numbers in {a}, in order",
        lambda k, a: [x for x in a if x % 2 == 0],
    ),
    _Family("reverse_string", ("word",), "returns the string {a} reversed", lambda k, a: a[::-1]),
    _Family("to_upper", ("word",), "returns the string {a} in upper case", lambda k, a: a.upper()),
    _Family(
        "string_length", ("word",), "returns the number of characters in the string {a}", lambda k, a: len(a)
    ),
    _Family(
        "repeat_{w}_times", ("word",), "returns the string {a} repeated {k} times", lambda k, a: a * k, (2, 5)
    ),
    _Family(
        "count_vowels",
        ("word",),
        "returns the number of vowels (a, e, i, o, u) in the string {a}",
        lambda k, a: _count_vowels(a.lower()),
    ),
    _Family(
        "is_palindrome",
        ("word",),
        "returns True if the string {a} reads the same backwards, else False",
        lambda k, a: a == a[::-1],
    ),
    _Family("factorial", ("nat",), "returns the factorial of {a}", lambda k, a: _fact(a)),
    _Family(
        "fibonacci",
        ("nat",),
        "returns the {a}-th Fibonacci number (fibonacci(0) is 0, fibonacci(1) is 1)",
        lambda k, a: _fib(a),
    ),
    _Family(
        "sum_to", ("nat",), "returns the sum of the integers from 1 to {a}", lambda k, a: a * (a + 1) // 2
    ),
    # Two steps or a less common idiom: most of what a 135M model gets wrong when it answers greedily.
    _Family(
        "sum_of_evens",
        ("sints",),
        "returns the sum of the even numbers in the list {a}",
        lambda k, a: sum(x for x in a if x % 2 == 0),
    ),
    _Family(
        "count_negatives",
        ("sints",),
        "returns how many numbers in the list {a} are below zero",
        lambda k, a: sum(x < 0 for x in a),
    ),
    _Family(
        "remove_duplicates",
        ("ints",),
        "returns the numbers of {a} without repeats, keeping the first of each",
        lambda k, a: list(dict.fromkeys(a)),
    ),
    _Family(
        "max_minus_min",
        ("sints",),
        "returns the largest number in the non-empty list {a} minus the smallest",
        lambda k, a: max(a) - min(a),
    ),
    _Family(
        "product_of_list",
        ("ints",),
        "returns the product of the numbers in the list {a}",
        lambda k, a: _product(a),
    ),
    _Family(
        "is_sorted",
        ("ints",),
        "returns True if the numbers in {a} are in non-decreasing order, else False",
        lambda k, a: a == sorted(a),
    ),
    _Family(
        "index_of_max",
        ("ints",),
        "returns the index of the first largest number in the non-empty list {a}",
        lambda k, a: a.index(max(a)),
    ),
    _Family(
        "first_{w}", ("ints",), "returns a list of the first {k} elements of {a}", lambda k, a: a[:k], (2, 4)
    ),
    _Family(
        "digit_sum",
        ("big",),
        "returns the sum of the decimal digits of the non-negative integer {a}",
        lambda k, a: sum(map(int, str(a))),
    ),
    _Family(
        "count_digits",
        ("big",),
        "returns how many decimal digits the non-negative integer {a} has",
        lambda k, a: len(str(a)),
    ),
    _Family(
        "count_words",
        ("sentence",),
        "returns the number of space-separated words in the string {a}",
        lambda k, a: len(a.split()),
    ),
    _Family(
        "longest_word",
        ("sentence",),
        "returns the first longest space-separated word in the string {a}",
        lambda k, a: max(a.split(), key=len),
    ),
    _Family(
        "join_with_dashes",
        ("words",),
        "returns the strings of the list {a} joined with '-' between them",
        lambda k, a: "-".join(a),
    ),
    _Family(
        "times_{w}_plus_one",
        ("int",),
        "returns {a} multiplied by {k}, plus 1",
        lambda k, a: a * k + 1,
        (2, 9),
    ),
    _Family(
        "at_most_{w}",
        ("int",),
        "returns {a}, or {k} if {a} is greater than {k}",
        lambda k, a: min(a, k),
        (1, 9),
    ),
]
_ARG_NAMES = {
    "int": ["x", "n", "number", "value"],
    "nat": ["n", "number"],
    "ints": ["numbers", "nums", "values", "items"],
    "word": ["s", "text", "word"],
    "sints": ["numbers", "nums", "values"],
    "big": ["n", "number"],
    "sentence": ["sentence", "text", "s"],
    "words": ["words", "parts", "items"],
}


def _inputs(kind: str, rng: random.Random):
    if kind == "int":
        return rng.randint(-20, 20)
    if kind == "nat":
        return rng.randint(0, 12)
    if kind == "ints":
        return [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]
    if kind == "sints":
        return [rng.randint(-9, 9) for _ in range(rng.randint(1, 6))]
    if kind == "big":
        return rng.randint(0, 99999)
    if kind == "words":
        return [rng.choice(_WORDS[:-1]) for _ in range(rng.randint(1, 4))]
    if kind == "sentence":
        return " ".join(rng.choice(_WORDS[:-2]) for _ in range(rng.randint(1, 5)))
    return rng.choice(_WORDS)


def _make(rng: random.Random) -> CodeProblem:
    family = rng.choice(_FAMILIES)
    k = rng.randint(*family.ks) if family.ks != (0, 0) else 0
    name = family.name.format(k=k, w=_NUMBER_WORDS[k] if k < len(_NUMBER_WORDS) else k)
    # Two arguments of one kind get distinct names (a, b), one argument a name of its kind.
    if len(family.args) == 2:
        a, b = rng.choice([("a", "b"), ("x", "y"), ("first", "second")])
        arg_names = [a, b]
    else:
        arg_names = [rng.choice(_ARG_NAMES[family.args[0]])]
    signature = f"{name}({', '.join(arg_names)})"
    does = family.does.format(a=arg_names[0], b=arg_names[-1], k=k)
    prompt = f"Write a Python function `{signature}` that {does}."
    tests, seen = [], set()
    for _ in range(50):  # distinct inputs, and enough of them
        args = tuple(_inputs(kind, rng) for kind in family.args)
        key = repr(args)
        if key in seen:
            continue
        seen.add(key)
        call = f"{name}({', '.join(repr(x) for x in args)})"
        tests.append(f"assert {call} == {family.ref(k, *args)!r}")
        if len(tests) == N_TESTS:
            break
    return CodeProblem(prompt, "\n".join(tests) + "\n", None, "generated", name)


class CodeTasks:
    """Train and held-out tasks of one seed; ``train(k)`` is the k-th train task."""

    def __init__(self, seed: int, eval_size: int):
        self.seed = seed
        self.eval_problems = [self._draw("eval", k) for k in range(eval_size)]
        self._held_out = {p.prompt for p in self.eval_problems}
        self._cache: dict[int, CodeProblem] = {}

    def _draw(self, split: str, k: int, attempt: int = 0) -> CodeProblem:
        return _make(random.Random(f"code/{self.seed}/{split}/{k}/{attempt}"))

    def train(self, k: int) -> CodeProblem:
        if k not in self._cache:
            for attempt in range(1000):
                problem = self._draw("train", k, attempt)
                if problem.prompt not in self._held_out:
                    break
            else:
                raise ValueError("data: the held-out tasks cover every task; lower data.eval_size")
            self._cache[k] = problem
        return self._cache[k]
