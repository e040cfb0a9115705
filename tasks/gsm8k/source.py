"""``data=gsm8k``: a GSM8K-style JSONL file (question, answer ending ``#### <n>``) as envs and chats."""

from __future__ import annotations

import re
from dataclasses import dataclass

from omegaconf import MISSING

from sess.rl.data import Data, Dataset

from .. import files
from ..arithmetic.problems import Problem
from ..arithmetic.source import problem_chat, problem_env


@dataclass
class Gsm8kData:
    name: str = "gsm8k"
    path: str = MISSING  # train jsonl with question / answer ("... #### 42")
    eval_path: str | None = None  # held-out jsonl; None: the last eval_size lines of path
    eval_size: int = 64
    instruction: str = "Give the final answer as 'Answer: <number>'."
    format_penalty: float = 0.1  # reward of a reply with no number in it
    shuffle: bool = True  # false: walk the file in its own order


_HASH_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def read_gsm8k(line: dict, where: str) -> Problem:
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


def load_gsm8k(cfg: Gsm8kData, seed: int) -> Data:
    train, held = files.train_and_held_out(cfg, read_gsm8k)
    problem = files.seeded_order(train, seed, cfg.shuffle)
    return Data(
        "gsm8k",
        envs=Dataset(lambda k: problem_env(problem(k), cfg), [problem_env(p, cfg) for p in held], len(train)),
        chats=Dataset(
            lambda k: problem_chat(problem(k), cfg.instruction),
            [problem_chat(p, cfg.instruction) for p in held],
            len(train),
        ),
    )
