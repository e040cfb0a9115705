"""The local grader: each job's solution and tests run in a bwrap sandbox, many jobs at once.

    with Grader(max_workers=4, limits=Limits(cpu_s=5, wall_s=10)) as grader:
        result = grader.grade(GradeJob(solution="def add(a, b): return a + b", tests="assert add(1, 2) == 3"))
        results = grader.grade_many(jobs)  # concurrent, at most max_workers sandboxes, in the jobs' order

A job never raises: a solution or test that misbehaves becomes a result with passed=False and a reason.
Only a missing or broken isolation tool raises (`SandboxUnavailable`, at construction).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from sess.sandbox.isolation import Sandbox
from sess.sandbox.jobs import GradeJob, GradeResult, Limits
from sess.sandbox.protocol import REPORT_BYTES, build_script, check_job, read_verdict


class Grader:
    """Grades jobs in local sandboxes; `bwrap` and `python` override the tool and the interpreter."""

    def __init__(
        self,
        max_workers: int = 4,
        limits: Limits | None = None,
        *,
        bwrap: str | None = None,
        python: str | None = None,
    ):
        self.limits = limits or Limits()
        self.max_workers = max_workers
        self.sandbox = Sandbox(max_workers, bwrap=bwrap, python=python)
        # Threads only wait on their sandbox's pipes, so a thread per slot costs nothing while it runs.
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="sess-grader")

    def grade(self, job: GradeJob) -> GradeResult:
        """Grade one job in the calling thread (it takes one of the `max_workers` sandbox slots)."""
        refused = check_job(job, self.limits)
        if refused is not None:
            return GradeResult(passed=False, reason=refused)
        script, nonce_line = build_script(job)
        # The harness's report line comes on top of what the solution may print.
        run_limits = replace(self.limits, output_bytes=self.limits.output_bytes + REPORT_BYTES)
        outcome = self.sandbox.run_python(script, nonce_line, run_limits)
        return read_verdict(outcome, nonce_line, self.limits)

    def grade_many(self, jobs: Iterable[GradeJob]) -> list[GradeResult]:
        """Grade jobs concurrently, at most `max_workers` at a time; results come in the jobs' order."""
        return list(self._pool.map(self.grade, jobs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
