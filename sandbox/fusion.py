"""`SandboxFusionGrader`: the same jobs and verdicts as `Grader`, run by a SandboxFusion server instead.

Each job becomes the same harness script and nonce as for the local sandbox (`protocol.py`); the script
goes to the server's `POST /run_code` as `code`, the nonce as `stdin`, so the verdict rules are the
same ones, and a solution cannot pass by exiting early on the server either.

The wire, as this relies on it (SandboxFusion's client package `sandbox-fusion` 0.3.7,
`sandbox_fusion/models.py`: RunCodeRequest, RunCodeResponse, CommandRunResult, RunStatus,
CommandRunStatus; `memory_limit_MB` is accepted by newer servers, and ignored where unknown):
    request:  {"code": str, "language": "python", "run_timeout": float, "compile_timeout": float,
               "stdin": str | null, "files": {}, "fetch_files": [], "memory_limit_MB": int}
    response: {"status": "Success" | "Failed" | "SandboxError", "message": str,
               "compile_result": null | {...}, "run_result": null | {"status": "Finished" | "Error" |
               "TimeLimitExceeded", "execution_time": float | null, "return_code": int | null,
               "stdout": str | null, "stderr": str | null}, "executor_pod_name": str | null, "files": {}}
A server error (HTTP status other than 200, or "SandboxError") raises `SandboxUnavailable`: reward 0
for an outage would teach the model something false. Uses only the standard library (urllib).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from sess.sandbox.isolation import SandboxUnavailable
from sess.sandbox.jobs import GradeJob, GradeResult, Limits
from sess.sandbox.process import RunOutcome
from sess.sandbox.protocol import build_script, check_job, read_verdict

_HTTP_SLACK_S = 30.0  # the server's own start-up and queueing, on top of the run's wall time


class SandboxFusionGrader:
    """Grades jobs through a SandboxFusion-compatible server at `url` (e.g. "http://localhost:8080")."""

    def __init__(self, url: str, max_workers: int = 4, limits: Limits | None = None):
        self.url = url.rstrip("/")
        self.limits = limits or Limits()
        self.max_workers = max_workers
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="sess-fusion")

    def grade(self, job: GradeJob) -> GradeResult:
        """Grade one job on the server (in the calling thread)."""
        refused = check_job(job, self.limits)
        if refused is not None:
            return GradeResult(passed=False, reason=refused)
        script, nonce_line = build_script(job)
        request = {
            "code": script,
            "language": "python",
            "run_timeout": self.limits.wall_s,
            "compile_timeout": self.limits.wall_s,
            "memory_limit_MB": self.limits.memory_mb,
            "stdin": nonce_line.decode("ascii"),
            "files": {},
            "fetch_files": [],
        }
        response = self._post("/run_code", request)
        status = response.get("status")
        if status == "SandboxError" or status not in ("Success", "Failed"):
            raise SandboxUnavailable(f"SandboxFusion server {self.url} failed: {response.get('message')!r}")
        run = response.get("run_result") or {}
        killed_for = None
        if run.get("status") == "TimeLimitExceeded":
            killed_for = "wall"  # SandboxFusion says no more than this: wall or CPU, it is a timeout
        elif str(response.get("message", "")).startswith("output limit"):
            killed_for = "output"  # sess's server says so; SandboxFusion itself has no output limit
        outcome = RunOutcome(
            exit_code=run.get("return_code"),
            stdout=(run.get("stdout") or "").encode("utf-8", "surrogateescape"),
            stderr=(run.get("stderr") or "").encode("utf-8", "surrogateescape"),
            seconds=float(run.get("execution_time") or 0.0),
            killed_for=killed_for,
        )
        return read_verdict(outcome, nonce_line, self.limits)

    def grade_many(self, jobs: Iterable[GradeJob]) -> list[GradeResult]:
        """Grade jobs concurrently, at most `max_workers` requests at a time, in the jobs' order."""
        return list(self._pool.map(self.grade, jobs))

    def _post(self, route: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.url + route,
            data=json.dumps(body).encode("utf-8"),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.limits.wall_s + _HTTP_SLACK_S) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode("utf-8", "replace")
            raise SandboxUnavailable(
                f"SandboxFusion server {self.url}{route} answered {exc.code}: {detail}"
            ) from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise SandboxUnavailable(
                f"Cannot reach a SandboxFusion server at {self.url}{route}: {exc}"
            ) from exc

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> SandboxFusionGrader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
