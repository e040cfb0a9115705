"""sess's sandbox served on SandboxFusion's `POST /run_code` route, for tools that expect SandboxFusion.

    python -m sess.sandbox.server --port 8080 [--host 127.0.0.1] [--workers 4] [--python PATH]

Runs `language: "python"` code in the same bwrap sandbox as `Grader` (see `isolation.py`), feeding it
`stdin`, as a script in a fresh working directory that holds the request's `files` (base64) and is on
its `sys.path`; the `fetch_files` found there afterwards come back base64 in the response's `files`
(see `workdir.py`: which names are taken, and the caps on their count and size). tinker-cookbook's
code grader (`SANDBOX_URL=http://host:port/run_code`) sends its tests that way. The code imports what
the sandbox's interpreter has installed (`--python`; the cookbook's tests need numpy). The request's
`run_timeout` and `memory_limit_MB` are honoured up to the server's own limits (`--wall-s`,
`--memory-mb`); CPU time is capped at the wall time. Other languages, and files refused by their
name, contents or size, get status "SandboxError" with a message naming the file. Wire fields: see
`fusion.py`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from sess.sandbox import workdir
from sess.sandbox.isolation import Sandbox, SandboxUnavailable
from sess.sandbox.jobs import Limits
from sess.sandbox.protocol import cpu_limit_hit


class RunCodeRequest(BaseModel):
    code: str
    language: str
    run_timeout: float = 10.0
    compile_timeout: float = 10.0  # accepted for compatibility; Python has no compile step here
    memory_limit_MB: int | None = None  # SandboxFusion's field name
    stdin: str | None = None
    files: dict = {}  # name -> base64 contents; checked by workdir.decode_files, which names a bad file
    fetch_files: list = []


class CommandRunResult(BaseModel):
    status: str  # "Finished" | "Error" | "TimeLimitExceeded"
    execution_time: float | None = None
    cpu_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: str  # "Success" | "Failed" | "SandboxError"
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


def create_app(
    limits: Limits | None = None,
    max_concurrent: int = 4,
    *,
    bwrap: str | None = None,
    python: str | None = None,
) -> FastAPI:
    """The app; `limits` are the server's ceilings. Raises `SandboxUnavailable` without a working bwrap."""
    ceiling = limits or Limits()
    sandbox = Sandbox(max_concurrent, bwrap=bwrap, python=python)
    app = FastAPI(title="sess sandbox (SandboxFusion-compatible)")

    max_body = 8 * ceiling.code_bytes + 2 * files_bytes(ceiling)

    @app.middleware("http")
    async def cap_body(request: Request, call_next):
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body:
            message = f"request body of {length} bytes is over the server's {max_body}-byte limit"
            return JSONResponse({"status": "SandboxError", "message": message}, status_code=413)
        return await call_next(request)

    @app.get("/ping")
    def ping() -> str:
        return "pong"

    @app.post("/run_code", response_model=RunCodeResponse)
    def run_code(request: RunCodeRequest) -> RunCodeResponse:  # sync: FastAPI runs it on a worker thread
        refused = _refusal(request, ceiling)
        if refused:
            return RunCodeResponse(status="SandboxError", message=refused)
        try:
            files = workdir.decode_files(request.files, files_bytes(ceiling))
            fetch = workdir.check_fetch(request.fetch_files)
        except workdir.FilesRefused as exc:
            return RunCodeResponse(status="SandboxError", message=str(exc))
        wall = min(max(request.run_timeout, 0.1), ceiling.wall_s)
        memory = min(request.memory_limit_MB or ceiling.memory_mb, ceiling.memory_mb)
        run_limits = replace(ceiling, wall_s=wall, cpu_s=min(ceiling.cpu_s, wall), memory_mb=max(memory, 64))
        stdin = (request.stdin or "").encode("utf-8", "surrogateescape")
        run = workdir.run_code(sandbox, request.code, stdin, run_limits, files, fetch)
        outcome = run.outcome
        stdout = outcome.stdout.decode("utf-8", "replace")
        stderr = outcome.stderr.decode("utf-8", "replace")
        if outcome.exit_code == 1 and outcome.stderr.startswith(b"bwrap:"):
            return RunCodeResponse(status="SandboxError", message=stderr.strip()[:500])
        over_output = len(outcome.stdout) + len(outcome.stderr) > run_limits.output_bytes
        if outcome.killed_for == "wall" or cpu_limit_hit(outcome, run_limits):
            status, message = (
                "TimeLimitExceeded",
                f"timeout: over {wall:g} s wall or {run_limits.cpu_s:g} s CPU",
            )
        elif outcome.killed_for == "output" or over_output:
            status, message = "Error", f"output limit: more than {run_limits.output_bytes} bytes"
        else:
            status, message = "Finished", ""
        if run.notes:
            message = "; ".join(
                [message] * bool(message) + ["fetch_files not returned: " + "; ".join(run.notes)]
            )
        result = CommandRunResult(
            status=status,
            execution_time=round(outcome.seconds, 4),
            return_code=outcome.exit_code,
            stdout=stdout,
            stderr=stderr,
        )
        ok = status == "Finished" and outcome.exit_code == 0
        return RunCodeResponse(
            status="Success" if ok else "Failed", message=message, run_result=result, files=run.files
        )

    return app


def files_bytes(ceiling: Limits) -> int:
    """How many bytes a request's files may hold together: half the run's tmpfs, the rest is the run's."""
    return (ceiling.disk_mb << 20) // 2


def _refusal(request: RunCodeRequest, ceiling: Limits) -> str:
    if request.language != "python":
        return f"sess's sandbox runs language 'python' only, not {request.language!r}"
    # The script carries the harness and an escaped job, so allow well over the job limit itself.
    if len(request.code) > 8 * ceiling.code_bytes:
        return f"code of {len(request.code)} characters is over the server's {8 * ceiling.code_bytes}"
    return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sess.sandbox.server", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--workers", type=int, default=4, help="sandboxes running at once")
    parser.add_argument("--wall-s", type=float, default=Limits.wall_s, help="the most run_timeout honoured")
    parser.add_argument("--cpu-s", type=float, default=Limits.cpu_s)
    parser.add_argument("--memory-mb", type=int, default=Limits.memory_mb)
    parser.add_argument("--bwrap", default=None, help="path of the bwrap binary (default: found)")
    parser.add_argument(
        "--python",
        default=None,
        help="the interpreter code runs on, with what it imports (default: this one's)",
    )
    args = parser.parse_args(argv)
    limits = Limits(cpu_s=args.cpu_s, wall_s=args.wall_s, memory_mb=args.memory_mb)
    try:
        app = create_app(limits, args.workers, bwrap=args.bwrap, python=args.python)
    except SandboxUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
