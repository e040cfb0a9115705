"""Where a code task's solutions run: the ``grader`` config group and the one grader a run's envs share.

``grader=local`` (the default: :class:`sess.sandbox.Grader`, bubblewrap on this machine) or
``grader=sandbox_fusion grader.url=http://host:8080`` (:class:`sess.sandbox.SandboxFusionGrader`).
It is built on the first solution graded, so composing a config or a dry run needs no sandbox.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from sess.rl.env import EnvFactory

from .code_env import CodeEnv
from .tasks import CodeProblem


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


class SharedGrader:
    """The run's grader, built from its config on the first ``grade`` (thread-safe)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._grader = None
        self._lock = threading.Lock()

    @property
    def backend(self):
        """The grader jobs go to (built by the first :meth:`grade`; None before)."""
        return self._grader

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


def envs_of(problems, grader, format_penalty: float) -> list[EnvFactory]:
    return [env_of(p, grader, format_penalty) for p in problems]


def env_of(problem: CodeProblem, grader, format_penalty: float) -> EnvFactory:
    return lambda: CodeEnv(problem, grader, format_penalty)
