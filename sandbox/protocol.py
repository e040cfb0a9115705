"""The host's side of the harness protocol: a job becomes (script, stdin), a finished run becomes a verdict.

The script is `job_runner.py`'s text with the job appended; stdin carries a fresh random nonce, which only
the harness ever reads (see `job_runner.py`). The same pair goes to the local sandbox and to a
SandboxFusion server, and `read_verdict` reads either one's outcome, so both grade alike.
"""

from __future__ import annotations

import json
import secrets
import signal
from pathlib import Path

from sess.sandbox.jobs import GradeJob, GradeResult, Limits
from sess.sandbox.process import RunOutcome

HARNESS_SOURCE = (Path(__file__).parent / "job_runner.py").read_text(encoding="utf-8")
REPORT_BYTES = 8192  # room for the harness's report line on top of Limits.output_bytes
SHOWN_BYTES = 16384  # how much of stdout (its start) and stderr (its end) a result keeps


def check_job(job: GradeJob, limits: Limits) -> str | None:
    """Why a job is refused without running, or None. A job without tests would pass vacuously."""
    if not isinstance(job.solution, str) or not isinstance(job.tests, str):
        return "invalid job: solution and tests must be strings"
    if not job.tests.strip():
        return "invalid job: no tests (a job without tests would pass whatever the solution does)"
    if job.entry_point is not None and not (
        isinstance(job.entry_point, str) and job.entry_point.isidentifier()
    ):
        return f"invalid job: entry_point {job.entry_point!r} is not a Python name"
    size = len(job.solution.encode("utf-8", "surrogatepass")) + len(
        job.tests.encode("utf-8", "surrogatepass")
    )
    if size > limits.code_bytes:
        return f"invalid job: {size} bytes of code, over the {limits.code_bytes}-byte limit"
    return None


def build_script(job: GradeJob) -> tuple[str, bytes]:
    """The script to run and the stdin to feed it: (harness + job, nonce line)."""
    # ensure_ascii keeps the script ASCII whatever the code holds (lone surrogates, NULs, non-UTF-8).
    payload = json.dumps({"solution": job.solution, "tests": job.tests, "entry_point": job.entry_point})
    script = f"{HARNESS_SOURCE}\n\n_run({payload!r})\n"
    return script, secrets.token_hex(16).encode("ascii") + b"\n"


def read_verdict(outcome: RunOutcome, nonce_line: bytes, limits: Limits) -> GradeResult:
    """Turn a finished run into a result. Only a report carrying the nonce can say "passed"."""
    stdout, report = _split_report(outcome.stdout, nonce_line.strip())
    if report is not None:
        passed, reason = report
    elif outcome.killed_for == "output":
        passed, reason = False, f"output limit: more than {limits.output_bytes} bytes of stdout + stderr"
    elif outcome.killed_for == "wall":
        passed, reason = False, f"timeout: wall time over {limits.wall_s:g} s"
    else:
        passed, reason = False, _reason_without_report(outcome, limits)
    return GradeResult(
        passed=passed,
        reason=reason,
        stdout=_head(stdout),
        stderr=_tail(outcome.stderr),
        seconds=round(outcome.seconds, 4),
    )


def _split_report(stdout: bytes, nonce: bytes) -> tuple[bytes, tuple[bool, str] | None]:
    """The output without the report line, and the report (passed, reason) if a valid one is there."""
    at = stdout.rfind(b"\n" + nonce + b" ") if nonce else -1
    if at < 0:
        return stdout, None
    end = stdout.find(b"\n", at + 1)
    if end < 0:
        return stdout, None  # cut off: the harness always ends its report with a newline
    fields = stdout[at + 1 : end].split(b" ")
    if len(fields) != 3 or fields[1] not in (b"0", b"1"):
        return stdout, None
    try:
        reason = bytes.fromhex(fields[2].decode("ascii")).decode("utf-8", "replace")
    except ValueError:
        return stdout, None
    passed = fields[1] == b"1"
    if passed != (reason == "passed"):
        return stdout, None  # the harness writes these two together; a mismatch is not its report
    return stdout[:at] + stdout[end + 1 :], (passed, reason)


def _reason_without_report(outcome: RunOutcome, limits: Limits) -> str:
    code = outcome.exit_code
    if cpu_limit_hit(outcome, limits):
        return f"timeout: CPU time over {limits.cpu_s:g} s"
    killed_by = code - 128 if code is not None and code > 128 else None
    if killed_by is not None:
        try:
            name = signal.Signals(killed_by).name
        except ValueError:
            name = f"signal {killed_by}"
        return f"crashed: killed by {name} before the tests finished"
    if code == 1 and outcome.stderr.startswith(b"bwrap:"):
        return "sandbox error: " + outcome.stderr.decode("utf-8", "replace").strip()[:500]
    return f"exited early: status {code} before the tests finished (no report from the harness)"


def cpu_limit_hit(outcome: RunOutcome, limits: Limits) -> bool:
    """SIGXCPU is the CPU limit's own signal; SIGKILL after that long is its hard limit a second later
    (bwrap's outer process cannot report the sandbox's CPU time: it does not reap the sandbox's init)."""
    killed_by = outcome.exit_code - 128 if outcome.exit_code is not None else None
    return killed_by == signal.SIGXCPU or (killed_by == signal.SIGKILL and outcome.seconds >= limits.cpu_s)


def _head(data: bytes) -> str:
    text = data[:SHOWN_BYTES].decode("utf-8", "replace")
    return text + (f"\n...[{len(data) - SHOWN_BYTES} more bytes]" if len(data) > SHOWN_BYTES else "")


def _tail(data: bytes) -> str:
    text = data[-SHOWN_BYTES:].decode("utf-8", "replace")
    return (f"[{len(data) - SHOWN_BYTES} bytes before]...\n" if len(data) > SHOWN_BYTES else "") + text
