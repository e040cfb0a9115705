"""The tasks behind ``data=``: each name's config dataclass and loader, in one explicit dict.

Each task folder holds one source (or two): ``arithmetic``, ``gsm8k``, ``chat_jsonl`` and
``feedback_jsonl`` (:mod:`.chat_files`), ``needle`` (a code hidden in a long document, sized in the
model's tokens), ``code_tasks`` (:mod:`.code`, HumanEval as its optional
held-out set), ``code_jsonl`` and ``env`` (a user's own env by ``module:Class``, :mod:`.user_env`).
A source gives up to three kinds of data (:class:`sess.rl.data.Data`); a new source is a new entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from sess.rl.data import Data

from .arithmetic.problems import ArithmeticData
from .arithmetic.source import load_arithmetic
from .chat_files.source import ChatJsonlData, FeedbackJsonlData, load_chat_jsonl, load_feedback_jsonl
from .code.source import CodeTasksData, load_code_tasks
from .code_jsonl.source import CodeJsonlData, load_code_jsonl
from .gsm8k.source import Gsm8kData, load_gsm8k
from .needle.source import NeedleData, load_needle
from .user_env.source import EnvData, load_env


class DataSource(NamedTuple):
    config: type
    load: Callable[..., Data]
    graded: bool = False  # load(cfg, seed, grader_cfg): its envs run code through the run's grader


DATA_SOURCES: dict[str, DataSource] = {
    "arithmetic": DataSource(ArithmeticData, load_arithmetic),
    "gsm8k": DataSource(Gsm8kData, load_gsm8k),
    "chat_jsonl": DataSource(ChatJsonlData, load_chat_jsonl),
    "feedback_jsonl": DataSource(FeedbackJsonlData, load_feedback_jsonl),
    "needle": DataSource(NeedleData, load_needle),
    "env": DataSource(EnvData, load_env),
    "code_tasks": DataSource(CodeTasksData, load_code_tasks, graded=True),
    "code_jsonl": DataSource(CodeJsonlData, load_code_jsonl, graded=True),
}


def load(cfg, seed: int, grader_cfg=None) -> Data:
    """The :class:`Data` of a validated ``cfg.data`` (code sources grade with ``grader_cfg``)."""
    source = DATA_SOURCES[cfg.name]
    return source.load(cfg, seed, grader_cfg) if source.graded else source.load(cfg, seed)
