"""A /run_code run's working directory: the request's `files` written into it, its `fetch_files` read back.

SandboxFusion runs a request's code as a script in a fresh directory that already holds the request's
`files` (name -> base64 contents), with that directory as the working directory and on `sys.path`, and
returns the `fetch_files` it finds there after the run, base64 again. tinker-cookbook's code grader
relies on it: its script imports `testing_util` and opens `test_cases.txt` and `code.py`, all sent as
files. Here the directory is the sandbox's private size-capped tmpfs (`isolation.WORKDIR`): the files
go in through bwrap (`--file`, `--dir`), the code as `SCRIPT_NAME` beside them.

Names are checked before anything runs: a relative path of plain components (letters, digits, `_`,
`-`, `.`, `+`, not starting with a dot, so no `..` and no hidden files), at most `MAX_DEPTH` deep, not
the script's own name; contents must be valid base64, and the count and total size are capped, so a
request cannot fill the tmpfs before the code starts. A refusal names the file (`FilesRefused`).

Fetching happens inside the sandbox, after the code exits: a small program (`FETCH_SOURCE`) runs the
code as its child, then opens each fetched name component by component without following symbolic
links, reads regular files only, up to a byte budget, and prints them after a marker line. The code
could forge that line, but it could as well have written those files itself: fetched files are the
code's own output, so a forgery gains it nothing. A name not fetched (missing, a link, over budget)
is left out of the response's `files` and said in `message`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from dataclasses import dataclass, replace

from sess.sandbox.isolation import WORKDIR, Sandbox
from sess.sandbox.jobs import Limits
from sess.sandbox.process import RunOutcome

SCRIPT_NAME = "__run_code__.py"  # the request's code, in the working directory beside its files
MAX_FILES = 64
MAX_DEPTH = 4
MAX_NAME_CHARS = 200
_COMPONENT = re.compile(r"[A-Za-z0-9_+\-][A-Za-z0-9_+.\-]*\Z")

FETCH_SOURCE = r"""
import base64, errno, json, os, stat, subprocess, sys

def read(name, budget):
    parts = name.split("/")
    where = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=where)
            os.close(where)
            where = inner
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=where)
    finally:
        os.close(where)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > budget:
            raise ValueError(f"{info.st_size} bytes, over the {budget} bytes left to fetch")
        data = os.read(fd, budget + 1)
        if len(data) > budget:
            raise ValueError(f"over the {budget} bytes left to fetch")
        return data
    finally:
        os.close(fd)

def main():
    marker, script, names, budget = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    code = subprocess.run([sys.executable, "-E", "-s", "-B", script]).returncode
    files, notes = {}, []
    for name in names:
        try:
            data = read(name, budget)
        except OSError as exc:
            why = {errno.ELOOP: "a symbolic link, not followed", errno.ENOTDIR: "not in a directory"}
            notes.append(f"{name}: {why.get(exc.errno, exc.strerror)}")
        except ValueError as exc:
            notes.append(f"{name}: {exc}")
        else:
            budget -= len(data)
            files[name] = base64.b64encode(data).decode("ascii")
    report = json.dumps({"files": files, "notes": notes})
    os.write(1, ("\n" + marker + " " + report + "\n").encode("ascii"))
    sys.exit(code if code >= 0 else 128 - code)

main()
"""


class FilesRefused(ValueError):
    """A request's `files` or `fetch_files` cannot be run; the message names the file."""


@dataclass(frozen=True)
class CodeRun:
    """What a /run_code run left: its outcome (stdout without the fetch report), fetched files, notes."""

    outcome: RunOutcome
    files: dict[str, str]
    notes: list[str]


def check_name(name: object, field: str) -> str:
    """`name` if it is a safe relative path in the working directory; else `FilesRefused` naming it."""
    if not isinstance(name, str) or not name:
        raise FilesRefused(f"{field}: file name {name!r} is not a non-empty string")
    shown = repr(name[:MAX_NAME_CHARS])
    if len(name) > MAX_NAME_CHARS:
        raise FilesRefused(f"{field}: file name {shown}... is longer than {MAX_NAME_CHARS} characters")
    if name.startswith("/"):
        raise FilesRefused(
            f"{field}: file {shown} is an absolute path; names are relative to the run's directory"
        )
    parts = name.split("/")
    if ".." in parts:
        raise FilesRefused(f"{field}: file {shown} climbs out of the run's directory ('..')")
    if len(parts) > MAX_DEPTH:
        raise FilesRefused(f"{field}: file {shown} is more than {MAX_DEPTH} directories deep")
    if not all(_COMPONENT.match(part) for part in parts):
        raise FilesRefused(
            f"{field}: file {shown} is not a plain relative path (letters, digits, '_', '-', '+', '.', "
            "components not starting with '.', separated by '/')"
        )
    return name


def decode_files(files: dict, total_bytes: int) -> dict[str, bytes]:
    """The request's `files` as name -> bytes, checked; `FilesRefused` names the first bad one."""
    if not isinstance(files, dict):
        raise FilesRefused("files: expected an object of file name -> base64 contents")
    if len(files) > MAX_FILES:
        raise FilesRefused(f"files: {len(files)} files, over the limit of {MAX_FILES}")
    decoded: dict[str, bytes] = {}
    used = 0
    for name, contents in files.items():
        check_name(name, "files")
        if name == SCRIPT_NAME:
            raise FilesRefused(f"files: file {name!r} would replace the request's code, which runs as {name}")
        if contents is None:
            contents = ""
        if not isinstance(contents, str):
            raise FilesRefused(f"files: file {name!r} must have base64 text as its contents")
        if len(contents) > 4 * (total_bytes - used) // 3 + 4:
            raise FilesRefused(f"files: file {name!r} is over the {total_bytes}-byte limit of all files")
        try:
            data = base64.b64decode(contents, validate=True)
        except (binascii.Error, ValueError):
            raise FilesRefused(f"files: file {name!r} is not valid base64") from None
        used += len(data)
        if used > total_bytes:
            raise FilesRefused(f"files: file {name!r} brings the files over their {total_bytes}-byte limit")
        decoded[name] = data
    for name in decoded:  # "a" as a file and "a/b" beside it cannot both exist
        parts = name.split("/")
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in decoded:
                raise FilesRefused(f"files: file {name!r} needs {'/'.join(parts[:depth])!r} as a directory")
    return decoded


def check_fetch(names: list) -> list[str]:
    if not isinstance(names, list):
        raise FilesRefused("fetch_files: expected a list of file names")
    if len(names) > MAX_FILES:
        raise FilesRefused(f"fetch_files: {len(names)} names, over the limit of {MAX_FILES}")
    return list(dict.fromkeys(check_name(name, "fetch_files") for name in names))


def run_code(
    sandbox: Sandbox, code: str, stdin: bytes, limits: Limits, files: dict[str, bytes], fetch: list[str]
) -> CodeRun:
    """Run `code` as `SCRIPT_NAME` in a working directory holding `files`; read back `fetch` after.

    Fetched files may use up to `limits.output_bytes` on top of the code's own output allowance."""
    script = code.encode("utf-8", "surrogatepass")
    workdir_files = {**files, SCRIPT_NAME: script}
    script_path = f"{WORKDIR}/{SCRIPT_NAME}"
    if not fetch:
        outcome = sandbox.run_python(
            "", stdin, limits, files=workdir_files, python_args=["-E", "-s", "-B", script_path]
        )
        return CodeRun(outcome, {}, [])
    marker = "sess-fetch-" + secrets.token_hex(16)
    budget = limits.output_bytes
    room = replace(
        limits, output_bytes=limits.output_bytes + 2 * budget + 65536, processes=limits.processes + 1
    )
    args = ["-I", "-B", "/sandbox/main.py", marker, script_path, json.dumps(fetch), str(budget)]
    outcome = sandbox.run_python(FETCH_SOURCE, stdin, room, files=workdir_files, python_args=args)
    stdout, report = _split_report(outcome.stdout, marker.encode("ascii"))
    if report is None:
        notes = [f"{name}: not fetched (the run did not finish normally)" for name in fetch]
        return CodeRun(replace(outcome, stdout=stdout), {}, notes)
    return CodeRun(replace(outcome, stdout=stdout), report["files"], report["notes"])


def _split_report(stdout: bytes, marker: bytes) -> tuple[bytes, dict | None]:
    at = stdout.rfind(b"\n" + marker + b" ")
    if at < 0:
        return stdout, None
    end = stdout.find(b"\n", at + 1)
    if end < 0:
        return stdout, None
    try:
        report = json.loads(stdout[at + len(marker) + 2 : end])
        files = {str(k): str(v) for k, v in report["files"].items()}
        notes = [str(note) for note in report["notes"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return stdout, None
    return stdout[:at] + stdout[end + 1 :], {"files": files, "notes": notes}
