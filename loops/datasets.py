"""Data sources behind ``data=``: arithmetic (generated), gsm8k, chat_jsonl and feedback_jsonl files.

Each source becomes a :class:`TaskData` that gives the k-th training item of a seeded order and a fixed
held-out list, in up to three shapes: *problems* (question + numeric answer, for RL loops and greedy
eval), *chats* (``messages`` for SFT) and *feedback* (prompt, completion, desirable? for KTO). The
arithmetic generator yields all three; files yield what they hold (GSM8K: problems and chats).
File items are visited in a fresh seeded permutation each epoch, so item k is a pure function of
(seed, k) and a resumed run sees the same order.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .arithmetic import ArithmeticProblems, Problem

INSTRUCTION = "Give the final answer as 'Answer: <number>'."


@dataclass
class ArithmeticData:
    name: str = "arithmetic"
    eval_size: int = 64
    min_value: int = 1
    max_value: int = 50
    ops: list[str] = field(default_factory=lambda: ["+", "-"])
    operands: int = 2
    word_problems: bool = True
    instruction: str = INSTRUCTION


@dataclass
class Gsm8kData:
    name: str = "gsm8k"
    path: str = "???"  # train jsonl with question / answer ("... #### 42")
    eval_path: str | None = None  # held-out jsonl; None: the last eval_size lines of path
    eval_size: int = 64
    instruction: str = INSTRUCTION


@dataclass
class ChatJsonlData:
    name: str = "chat_jsonl"
    path: str = "???"  # jsonl, one {"messages": [{"role": ..., "content": ...}, ...]} per line
    eval_path: str | None = None
    eval_size: int = 8


@dataclass
class FeedbackJsonlData:
    name: str = "feedback_jsonl"
    path: str = "???"  # jsonl, one {"prompt": ..., "completion": ..., "label": true|false} per line
    eval_path: str | None = None
    eval_size: int = 8


DATA_CONFIGS: dict[str, type] = {
    "arithmetic": ArithmeticData,
    "gsm8k": Gsm8kData,
    "chat_jsonl": ChatJsonlData,
    "feedback_jsonl": FeedbackJsonlData,
}

Messages = list[dict]


@dataclass(frozen=True)
class Feedback:
    prompt: Messages
    completion: str
    desirable: bool


@dataclass
class TaskData:
    """What a loop draws from: ``train_*(k)`` is item k of the seeded order; ``eval_*`` is held out."""

    name: str
    train_problem: Callable[[int], Problem] | None = None
    eval_problems: list[Problem] = field(default_factory=list)
    train_chat: Callable[[int], Messages] | None = None
    eval_chats: list[Messages] = field(default_factory=list)
    train_feedback: Callable[[int], Feedback] | None = None
    eval_feedback: list[Feedback] = field(default_factory=list)
    train_size: int | None = None  # None: unbounded (generated)
    instruction: str = INSTRUCTION

    def prompt(self, problem: Problem) -> Messages:
        text = f"{problem.question} {self.instruction}".strip()
        return [{"role": "user", "content": text}]

    def need(self, shape: str, loop: str) -> None:
        if getattr(self, f"train_{shape}") is None:
            have = [s for s in ("problem", "chat", "feedback") if getattr(self, f"train_{s}") is not None]
            raise ValueError(
                f"loop {loop} needs {shape} data, data={self.name} gives {', '.join(have) or 'none'}; "
                "pick another data= (arithmetic gives all three)"
            )


def answer_text(problem: Problem) -> str:
    return f"{problem.solution} Answer: {problem.answer}".strip()


def load(cfg, seed: int, *, shuffle: bool = True) -> TaskData:
    """The TaskData for a validated ``cfg.data``; ``shuffle=False`` walks files in their own order."""
    if cfg.name == "arithmetic":
        return _arithmetic(cfg, seed)
    if cfg.name == "gsm8k":
        return _gsm8k(cfg, seed, shuffle)
    if cfg.name == "chat_jsonl":
        train, held = _split(cfg, seed, _read_chat)
        return TaskData(
            "chat_jsonl", train_chat=_order(train, seed, shuffle), eval_chats=held, train_size=len(train)
        )
    if cfg.name == "feedback_jsonl":
        train, held = _split(cfg, seed, _read_feedback)
        return TaskData(
            "feedback_jsonl",
            train_feedback=_order(train, seed, shuffle),
            eval_feedback=held,
            train_size=len(train),
        )
    raise ValueError(f"data.name: unknown data {cfg.name!r}")


def _arithmetic(cfg, seed: int) -> TaskData:
    gen = ArithmeticProblems(
        seed,
        eval_size=cfg.eval_size,
        min_value=cfg.min_value,
        max_value=cfg.max_value,
        ops=list(cfg.ops),
        operands=cfg.operands,
        word_problems=cfg.word_problems,
    )
    data = TaskData("arithmetic", instruction=cfg.instruction)

    def chat(problem: Problem) -> Messages:
        return [*data.prompt(problem), {"role": "assistant", "content": answer_text(problem)}]

    def feedback(k: int, problem: Problem) -> Feedback:
        # Even k: the correct worked answer (desirable); odd k: the same story with a wrong answer.
        if k % 2 == 0:
            return Feedback(data.prompt(problem), answer_text(problem), True)
        wrong = gen.wrong_answer(k, problem)
        text = f"{problem.solution.rsplit('=', 1)[0]}= {wrong}. Answer: {wrong}"
        return Feedback(data.prompt(problem), text, False)

    data.train_problem = gen.train
    data.eval_problems = gen.eval_problems
    data.train_chat = lambda k: chat(gen.train(k))
    data.eval_chats = [chat(p) for p in gen.eval_problems]
    data.train_feedback = lambda k: feedback(k, gen.train(k // 2 * 2))
    data.eval_feedback = [feedback(k, p) for k, p in enumerate(gen.eval_problems)]
    return data


_HASH_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def _read_gsm8k(line: dict, where: str) -> Problem:
    try:
        question, answer = line["question"], line["answer"]
    except KeyError as exc:
        raise ValueError(
            f"{where}: missing key {exc.args[0]!r} (gsm8k lines have question and answer)"
        ) from None
    match = _HASH_ANSWER.search(answer)
    if not match:
        raise ValueError(f"{where}: answer has no '#### <number>' final answer")
    final = match.group(1).replace(",", "").strip()
    reasoning = answer[: match.start()].strip()
    reasoning = re.sub(r"<<[^>]*>>", "", reasoning)  # GSM8K's calculator annotations
    return Problem(question.strip(), final, reasoning)


def _gsm8k(cfg, seed: int, shuffle: bool) -> TaskData:
    train, held = _split(cfg, seed, _read_gsm8k)
    data = TaskData("gsm8k", instruction=cfg.instruction, train_size=len(train))

    def chat(problem: Problem) -> Messages:
        return [*data.prompt(problem), {"role": "assistant", "content": answer_text(problem)}]

    data.train_problem = _order(train, seed, shuffle)
    data.eval_problems = held
    data.train_chat = lambda k: chat(data.train_problem(k))
    data.eval_chats = [chat(p) for p in held]
    return data


def _read_chat(line: dict, where: str) -> Messages:
    messages = line.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages
    ):
        raise ValueError(f"{where}: expected 'messages': a list of {{role, content}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message to learn from")
    return messages


def _read_feedback(line: dict, where: str) -> Feedback:
    try:
        prompt, completion, label = line["prompt"], line["completion"], line["label"]
    except KeyError as exc:
        raise ValueError(f"{where}: missing key {exc.args[0]!r} (need prompt, completion, label)") from None
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(label, bool):
        raise ValueError(f"{where}: label must be true or false, got {label!r}")
    return Feedback(prompt, completion, label)


def read_jsonl(path: str | Path, parse: Callable) -> list:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"data.path: no such file {str(path)!r}")
    items = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
                items.append(parse(record, f"{path}:{n}"))
    if not items:
        raise ValueError(f"data.path: {path} holds no examples")
    return items


def _split(cfg, seed: int, parse: Callable) -> tuple[list, list]:
    items = read_jsonl(cfg.path, parse)
    if cfg.eval_path:
        return items, read_jsonl(cfg.eval_path, parse)[: cfg.eval_size]
    if len(items) <= cfg.eval_size:
        raise ValueError(
            f"data.eval_size: {cfg.path} has {len(items)} examples, not enough to hold out {cfg.eval_size}; "
            "lower data.eval_size or give data.eval_path"
        )
    return items[: -cfg.eval_size], items[-cfg.eval_size :]


def _order(items: list, seed: int, shuffle: bool = True) -> Callable[[int], object]:
    """Item k of an endless walk over ``items``: a fresh seeded shuffle per epoch (or file order)."""
    perms: dict[int, list[int]] = {}

    def get(k: int):
        epoch, i = divmod(k, len(items))
        if epoch not in perms:
            perm = list(range(len(items)))
            if shuffle:
                random.Random(f"{seed}/epoch/{epoch}").shuffle(perm)
            perms[epoch] = perm
        return items[perms[epoch][i]]

    return get
