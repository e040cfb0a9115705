"""Data sources behind ``data=``: what each one is configured by and what it gives the loops.

A source gives up to three kinds of data, each a :class:`Dataset` (item k of a seeded training order,
and a fixed held-out list): *envs* (environment factories, for the RL loops and greedy evaluation),
*chats* (``messages`` for SFT) and *feedback* (prompt, completion, desirable? for KTO).

- ``arithmetic``: generated problems (:mod:`.arithmetic`) as one-turn :class:`~.problem_env.ProblemEnv`
  envs, as chats with a worked answer, and as feedback (the worked answer, or a wrong one).
- ``gsm8k``: a GSM8K-style JSONL file, as envs and chats.
- ``chat_jsonl``, ``feedback_jsonl``: JSONL files of chats, of feedback (:mod:`.data_files`).
- ``code_tasks``, ``code_jsonl``: programming problems graded in a sandbox (:mod:`.code_data`).
- ``env``: any :class:`~.env.Env` of your own, named ``path/to/file.py:Name`` or ``package.module:Name``:
  ``Name(rng)`` builds one episode of a problem drawn from ``rng`` (a ``random.Random`` seeded by
  (seed, split, k), so a group's envs share their problem and item k is the same in every run).

Each source's config dataclass holds its defaults; :data:`DATA_SOURCES` maps ``data.name`` to it and
to its loader (an explicit dict: a new source is a new entry).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

from omegaconf import MISSING

from . import code_data, data_files
from .arithmetic import ArithmeticData, ArithmeticProblems, Problem
from .data_files import Feedback, Messages
from .env import EnvFactory
from .problem_env import ProblemEnv, problem_prompt

T = TypeVar("T")


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


@dataclass
class Gsm8kData:
    name: str = "gsm8k"
    path: str = MISSING  # train jsonl with question / answer ("... #### 42")
    eval_path: str | None = None  # held-out jsonl; None: the last eval_size lines of path
    eval_size: int = 64
    instruction: str = "Give the final answer as 'Answer: <number>'."
    format_penalty: float = 0.1  # reward of a reply with no number in it
    shuffle: bool = True  # false: walk the file in its own order


@dataclass
class ChatJsonlData:
    name: str = "chat_jsonl"
    path: str = MISSING  # jsonl, one {"messages": [{"role": ..., "content": ...}, ...]} per line
    eval_path: str | None = None
    eval_size: int = 8
    shuffle: bool = True


@dataclass
class FeedbackJsonlData:
    name: str = "feedback_jsonl"
    path: str = MISSING  # jsonl, one {"prompt": ..., "completion": ..., "label": true|false} per line
    eval_path: str | None = None
    eval_size: int = 8
    shuffle: bool = True


@dataclass
class EnvData:
    name: str = "env"
    env: str = MISSING  # path/to/file.py:Name or package.module:Name; Name(rng) -> an Env
    eval_size: int = 16


def answer_text(problem: Problem) -> str:
    return f"{problem.solution} Answer: {problem.answer}".strip()


def _problem_chat(problem: Problem, instruction: str) -> Messages:
    return [*problem_prompt(problem, instruction), {"role": "assistant", "content": answer_text(problem)}]


def _problem_env(problem: Problem, cfg) -> EnvFactory:
    return lambda: ProblemEnv(problem, cfg.instruction, cfg.format_penalty)


def load_arithmetic(cfg: ArithmeticData, seed: int) -> Data:
    gen = ArithmeticProblems(seed, cfg)

    def feedback(k: int, problem: Problem) -> Feedback:
        # Even k: the correct worked answer (desirable); odd k: the same story with a wrong answer.
        prompt = problem_prompt(problem, cfg.instruction)
        if k % 2 == 0:
            return Feedback(prompt, answer_text(problem), True)
        wrong = gen.wrong_answer(k, problem)
        return Feedback(prompt, f"{problem.solution.rsplit('=', 1)[0]}= {wrong}. Answer: {wrong}", False)

    held = gen.eval_problems
    return Data(
        "arithmetic",
        envs=Dataset(lambda k: _problem_env(gen.train(k), cfg), [_problem_env(p, cfg) for p in held]),
        chats=Dataset(
            lambda k: _problem_chat(gen.train(k), cfg.instruction),
            [_problem_chat(p, cfg.instruction) for p in held],
        ),
        feedback=Dataset(
            lambda k: feedback(k, gen.train(k // 2 * 2)), [feedback(k, p) for k, p in enumerate(held)]
        ),
    )


def load_gsm8k(cfg: Gsm8kData, seed: int) -> Data:
    train, held = data_files.train_and_held_out(cfg, data_files.read_gsm8k)
    problem = data_files.seeded_order(train, seed, cfg.shuffle)
    return Data(
        "gsm8k",
        envs=Dataset(
            lambda k: _problem_env(problem(k), cfg), [_problem_env(p, cfg) for p in held], len(train)
        ),
        chats=Dataset(
            lambda k: _problem_chat(problem(k), cfg.instruction),
            [_problem_chat(p, cfg.instruction) for p in held],
            len(train),
        ),
    )


def load_chat_jsonl(cfg: ChatJsonlData, seed: int) -> Data:
    train, held = data_files.train_and_held_out(cfg, data_files.read_chat)
    return Data(
        "chat_jsonl", chats=Dataset(data_files.seeded_order(train, seed, cfg.shuffle), held, len(train))
    )


def load_feedback_jsonl(cfg: FeedbackJsonlData, seed: int) -> Data:
    train, held = data_files.train_and_held_out(cfg, data_files.read_feedback)
    order = data_files.seeded_order(train, seed, cfg.shuffle)
    return Data("feedback_jsonl", feedback=Dataset(order, held, len(train)))


def load_env(cfg: EnvData, seed: int) -> Data:
    make = import_named(cfg.env, "data.env")

    def factory(split: str, k: int) -> EnvFactory:
        return lambda: make(random.Random(f"{seed}/{split}/{k}"))

    held = [factory("eval", k) for k in range(cfg.eval_size)]
    return Data("env", envs=Dataset(lambda k: factory("train", k), held))


def import_named(spec: str, key: str):
    """``file.py:Name`` or ``package.module:Name`` (importable from the working directory) -> the object."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{key}: expected path/to/file.py:Name or package.module:Name, got {spec!r}")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ValueError(f"{key}: no such file {where!r}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module  # dataclasses in the file look their module up there
        module_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:  # `sess run` is a console script: its sys.path lacks the cwd
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"{key}: {where} has no {name!r}")
    return getattr(module, name)


class DataSource(NamedTuple):
    config: type
    load: Callable[..., Data]
    graded: bool = False  # load(cfg, seed, grader_cfg): its envs run code through the run's grader


DATA_SOURCES: dict[str, DataSource] = {
    "arithmetic": DataSource(ArithmeticData, load_arithmetic),
    "gsm8k": DataSource(Gsm8kData, load_gsm8k),
    "chat_jsonl": DataSource(ChatJsonlData, load_chat_jsonl),
    "feedback_jsonl": DataSource(FeedbackJsonlData, load_feedback_jsonl),
    "env": DataSource(EnvData, load_env),
    "code_tasks": DataSource(code_data.CodeTasksData, code_data.load_code_tasks, graded=True),
    "code_jsonl": DataSource(code_data.CodeJsonlData, code_data.load_code_jsonl, graded=True),
}


def load(cfg, seed: int, grader_cfg=None) -> Data:
    """The :class:`Data` of a validated ``cfg.data`` (code sources grade with ``grader_cfg``)."""
    source = DATA_SOURCES[cfg.name]
    return source.load(cfg, seed, grader_cfg) if source.graded else source.load(cfg, seed)
