"""The grader's wire types: the limits a sandboxed run gets, a job (solution + tests), and its result.

A result's `reason` starts with one of `REASON_KINDS` (the text before the first colon), so code can
branch on `result.kind` while people read the rest: "tests failed: AssertionError at <tests> line 2:
assert add(1, 2) == 4", "timeout: wall time over 10 s", "memory limit: MemoryError in the solution".
"""

from __future__ import annotations

from dataclasses import dataclass

# Every reason starts with one of these; `passed` is the only one with `GradeResult.passed == True`.
REASON_KINDS = (
    "passed",
    "tests failed",  # an exception (an assert, or anything else) while the tests ran
    "solution error",  # the solution raised before the tests started
    "syntax error",  # the solution or the tests do not compile
    "timeout",  # wall time or CPU time ran out
    "memory limit",  # MemoryError under the address-space limit
    "output limit",  # stdout + stderr went past Limits.output_bytes; the run was killed
    "exited early",  # sys.exit / os._exit / a crash before the harness could report the tests' outcome
    "crashed",  # killed by a signal (SIGSEGV, SIGABRT, ...)
    "invalid job",  # refused before running: no tests, or code over Limits.code_bytes
    "sandbox error",  # the isolation tool itself failed (the run never reached Python)
)


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use. Memory and CPU are per process (rlimits), so a run that forks
    can use up to `processes` times `memory_mb`; wall time and output cover the whole run."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512  # RLIMIT_AS: address space, which Python's own start-up needs ~30 MB of
    processes: int = 32  # RLIMIT_NPROC, threads included
    output_bytes: int = 1 << 20  # stdout + stderr together
    disk_mb: int = 64  # size of the private tmpfs the run works in
    code_bytes: int = 1 << 20  # solution + tests; bigger jobs are refused without running

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "output_bytes", "disk_mb", "code_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive number, got {value!r}")
        if self.memory_mb < 64:
            raise ValueError(f"Limits.memory_mb={self.memory_mb} is too small for Python to start; use >= 64")


@dataclass(frozen=True)
class GradeJob:
    """A solution and the tests that judge it.

    `tests` are Python statements run after the solution in the same namespace (MBPP-style asserts),
    or, with `entry_point`, a HumanEval-style `def check(candidate): ...` that the harness calls as
    `check(<the solution's entry_point>)`.
    """

    solution: str
    tests: str
    entry_point: str | None = None


@dataclass(frozen=True)
class GradeResult:
    """The verdict on one job: `passed` is the reward (1 when True), `reason` says why."""

    passed: bool
    reason: str
    stdout: str = ""  # the run's output with the harness's own report line removed, truncated
    stderr: str = ""
    seconds: float = 0.0  # wall time of the sandboxed run (0 for jobs refused before running)

    @property
    def kind(self) -> str:
        """The reason's leading keyword, one of `REASON_KINDS`."""
        return self.reason.split(":", 1)[0]
