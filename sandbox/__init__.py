"""Sandboxed code grading for RL on programming problems: reward 1 when a solution passes its tests.

`Grader` runs each job in its own bubblewrap sandbox on this machine (no network, a private tmpfs as
working directory, a read-only view of /usr and the interpreter, CPU/wall/memory/process/output limits;
see `isolation.py`). `SandboxFusionGrader` sends the same jobs to a SandboxFusion server's /run_code
route instead, and `python -m sess.sandbox.server` serves sess's sandbox on that route.

    from sess.sandbox import Grader, GradeJob, Limits
    with Grader(max_workers=4, limits=Limits(cpu_s=5, wall_s=10, memory_mb=512)) as grader:
        result = grader.grade(GradeJob(solution="def add(a, b): return a + b", tests="assert add(1, 2) == 3"))
        result.passed, result.reason  # True, "passed"
"""

from sess.sandbox.fusion import SandboxFusionGrader
from sess.sandbox.grader import Grader
from sess.sandbox.isolation import SandboxUnavailable
from sess.sandbox.jobs import REASON_KINDS, GradeJob, GradeResult, Limits

__all__ = [
    "REASON_KINDS",
    "GradeJob",
    "GradeResult",
    "Grader",
    "Limits",
    "SandboxFusionGrader",
    "SandboxUnavailable",
]
