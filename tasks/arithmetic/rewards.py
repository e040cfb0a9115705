"""Scoring a completion against a numeric answer: exact match of the final answer.

The final answer is the number after the last ``Answer:``; without one, the last number in the text.
Correct scores 1, a wrong number 0, and a completion with no number at all ``-format_penalty``, so a
policy is pushed first to answer at all, then to answer right.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\$?\s*(-?[\d,]*\.?\d+)", re.I)
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def parse_answer(text: str) -> str | None:
    """The final answer in ``text`` as a normalised number string, or None when there is none."""
    found = _ANSWER.findall(text) or _NUMBER.findall(text)
    if not found:
        return None
    return normalise(found[-1])


def normalise(number: str) -> str | None:
    number = number.replace(",", "").strip().rstrip(".")
    try:
        value = float(number)
    except ValueError:
        return None
    return str(int(value)) if value == int(value) else repr(value)


def reward(text: str, truth: str, format_penalty: float) -> float:
    answer = parse_answer(text)
    if answer is None:
        return -format_penalty
    return 1.0 if answer == normalise(truth) else 0.0


def correct(text: str, truth: str) -> bool:
    answer = parse_answer(text)
    return answer is not None and answer == normalise(truth)
