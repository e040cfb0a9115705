"""``data=code_tasks`` (the default of ``loop=code_rl``): generated function-writing tasks with unit tests.

The seeded generator of :mod:`.tasks`; ``data.humaneval=N`` adds the first N HumanEval problems
(:mod:`sess.tasks.humaneval`, 164 in all) to the held-out set, where they report
``eval/accuracy/humaneval`` beside ``eval/accuracy/generated``. Every env grades through the run's
grader (:mod:`.grader`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sess.rl.data import Data, Dataset

from ..humaneval.problems import HUMANEVAL_SIZE, humaneval_problems
from .grader_config import GraderConfig, SharedGrader, env_of, envs_of
from .tasks import CodeTasks


@dataclass
class CodeTasksData:
    name: str = "code_tasks"
    eval_size: int = 64
    humaneval: int = 0  # add the first N HumanEval problems to the held-out set (164: all)
    format_penalty: float = 0.1  # reward of a reply with no code block


def load_code_tasks(cfg: CodeTasksData, seed: int, grader_cfg=None):
    if not 0 <= cfg.humaneval <= HUMANEVAL_SIZE:
        raise ValueError(f"data.humaneval: expected 0..{HUMANEVAL_SIZE} problems, got {cfg.humaneval}")
    grader = SharedGrader(grader_cfg or GraderConfig())
    tasks = CodeTasks(seed, cfg.eval_size)
    held = tasks.eval_problems + (humaneval_problems()[: cfg.humaneval] if cfg.humaneval else [])
    envs = Dataset(
        lambda k: env_of(tasks.train(k), grader, cfg.format_penalty),
        envs_of(held, grader, cfg.format_penalty),
    )
    return Data("code_tasks", envs=envs)
