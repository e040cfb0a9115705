"""``data=code_jsonl data.path=problems.jsonl``: a user's own programming problems with unit tests.

One JSON object a line with ``prompt`` and ``tests`` (asserts, or a HumanEval-style
``check(candidate)`` with ``entry_point``), and optionally ``entry_point`` and ``id``; a malformed line
is named by its number. Solutions run in the run's grader (:mod:`sess.tasks.code.grader_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from sess.rl.data import Data, Dataset

from .. import files
from ..code.grader_config import GraderConfig, SharedGrader, env_of, envs_of
from ..code.tasks import CodeProblem


@dataclass
class CodeJsonlData:
    name: str = "code_jsonl"
    path: str = MISSING  # jsonl: {"prompt": ..., "tests": ..., "entry_point": optional} per line
    eval_path: str | None = None
    eval_size: int = 8
    shuffle: bool = True
    format_penalty: float = 0.1


def load_code_jsonl(cfg: CodeJsonlData, seed: int, grader_cfg=None):
    grader = SharedGrader(grader_cfg or GraderConfig())
    train, held = files.train_and_held_out(cfg, read_code)
    order = files.seeded_order(train, seed, cfg.shuffle)
    envs = Dataset(
        lambda k: env_of(order(k), grader, cfg.format_penalty),
        envs_of(held, grader, cfg.format_penalty),
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
