"""Run one command with a wall-clock deadline and a cap on its output, and kill its whole process group.

The sandbox's rlimits bound CPU, memory and processes from inside; the two limits only the parent can
enforce are here: wall time (a sleeping or blocked run uses no CPU) and output size (a pipe has no
rlimit, and reading 1 GB into the grader would hurt the grader). Both are read in one select loop, so
a run costs no threads. On either limit the process group is killed with SIGKILL; the sandbox's pid
namespace and `--die-with-parent` take everything below it down too.

bwrap's outer process may exit as soon as the sandboxed command has, while the sandbox's init (its
pid 1) is still killing what the command left behind. With a status pipe (bwrap's `--json-status-fd`)
this module learns that init's pid and returns only once it is gone, so when a run returns, none of its
processes is left, and the next run in the same slot starts with a process count of zero.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

_CHUNK = 1 << 16
_INIT_EXIT_S = 10.0  # how long to wait for the sandbox's init to finish killing its namespace


@dataclass(frozen=True)
class RunOutcome:
    """What a run left behind. `exit_code` uses the shell's encoding: n, or 128 + signal number."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    seconds: float
    killed_for: str | None = None  # "wall" or "output" when the parent killed the run


def run_bounded(
    argv: list[str],
    stdin: bytes,
    wall_s: float,
    output_bytes: int,
    pass_fds: tuple[int, ...] = (),
    status_pipe: tuple[int, int] | None = None,
) -> RunOutcome:
    """Run `argv`, feed it `stdin`, and collect stdout/stderr until it exits or breaks a limit.

    `status_pipe` is (read end, write end) of a pipe whose write end `argv` gives bwrap as
    `--json-status-fd`; this function closes both.
    """
    start = time.monotonic()
    deadline = start + wall_s
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds + ((status_pipe[1],) if status_pipe else ()),
            start_new_session=True,  # its own process group: one killpg reaches every process it starts
        )
    except BaseException:
        if status_pipe is not None:
            os.close(status_pipe[0])
        raise
    finally:
        if status_pipe is not None:
            os.close(status_pipe[1])  # bwrap holds its own copy now
    status_fd = status_pipe[0] if status_pipe is not None else None
    status = b""
    init_fd = None  # a pidfd on the sandbox's init, once bwrap has said its pid
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    total = 0
    killed_for = None
    pending = memoryview(stdin)
    exit_fd = os.pidfd_open(proc.pid)  # readable once it exits, even if it closed its pipes long before
    exited = False
    with selectors.DefaultSelector() as selector:
        for fd in (out_fd, err_fd, exit_fd, status_fd):
            if fd is not None:
                selector.register(fd, selectors.EVENT_READ)
        if pending:
            os.set_blocking(in_fd, False)
            selector.register(in_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while not exited or out_fd in selector.get_map() or err_fd in selector.get_map():
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                killed_for = "wall"
                break
            for key, _ in selector.select(timeout):
                if key.fd == exit_fd:
                    exited = True
                    selector.unregister(exit_fd)
                elif key.fd == status_fd:
                    data = os.read(status_fd, _CHUNK)
                    status += data
                    if not data:
                        selector.unregister(status_fd)
                    elif init_fd is None:
                        init_fd = _open_init(status)
                elif key.fd == in_fd:
                    pending = _feed(in_fd, pending)
                    if not pending:
                        selector.unregister(in_fd)
                        proc.stdin.close()
                else:
                    data = os.read(key.fd, _CHUNK)
                    if not data:
                        selector.unregister(key.fd)
                    chunks[key.fd].append(data)
                    total += len(data)
            if total > output_bytes:
                killed_for = "output"
                break
    os.close(exit_fd)
    if killed_for is not None:
        _kill_group(proc.pid)
    if init_fd is None and status_fd is not None:
        init_fd = _open_init(status + _read_rest(status_fd))  # before the reap below can free its pid
    proc.wait()
    if init_fd is not None:
        select.select([init_fd], [], [], _INIT_EXIT_S)  # readable once the whole namespace is gone
        os.close(init_fd)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()
    if status_fd is not None:
        os.close(status_fd)
    code = proc.returncode
    return RunOutcome(
        exit_code=128 - code if code < 0 else code,
        stdout=b"".join(chunks[out_fd]),
        stderr=b"".join(chunks[err_fd]),
        seconds=time.monotonic() - start,
        killed_for=killed_for,
    )


def _feed(fd: int, pending: memoryview) -> memoryview:
    """Write what the pipe takes now; a reader that stopped reading gets no more."""
    try:
        return pending[os.write(fd, pending[:_CHUNK]) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        return memoryview(b"")


def _open_init(status: bytes) -> int | None:
    """A pidfd on the pid bwrap reports first ("child-pid", its init), or None if not reported yet."""
    first, newline, _ = status.partition(b"\n")
    if not newline:
        return None
    try:
        return os.pidfd_open(int(json.loads(first)["child-pid"]))
    except (ValueError, KeyError, TypeError, ProcessLookupError):
        return None


def _read_rest(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, _CHUNK)
    except BlockingIOError:
        return b""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
