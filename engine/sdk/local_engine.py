"""Finding, starting and stopping the local engine of an engine home, from the client's side.

A running engine writes ``engine.json`` (url, pid, port) into its home. :func:`ensure_local_engine`
returns that engine's URL when it answers, and otherwise starts one in the background (a new session
leader, logging to ``engine.log``) under a file lock, so two clients starting at once share one engine;
``sess engine up`` takes the same lock. Starting one says so on stderr, since it outlives the command.
The engine is started by its module path (``python -m sess.engine.server``, which sets up its own
process environment), so this module, part of the SDK, imports nothing of the engine's.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from sess.engine.protocol.errors import SessError
from sess.engine.protocol.home import ENGINE_FILE, LOG_FILE, server_command, sess_home

START_TIMEOUT_S = float(os.environ.get("SESS_ENGINE_START_TIMEOUT_S", 120.0))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def engine_info(home: str | os.PathLike | None = None, *, timeout: float = 2.0) -> dict | None:
    """The running engine of ``home`` ({url, pid, port, idle_timeout, rss_bytes, peak_rss_bytes,
    trimmed, batch_invariant, models (base models in memory), ...}) if it answers its health check."""
    path = sess_home(home) / ENGINE_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not _alive(int(info.get("pid", -1))):
        return None
    try:
        health = httpx.get(f"{info['url']}/healthz", timeout=timeout, verify=_own_certificate(info)).json()
    except (httpx.HTTPError, ValueError, OSError):
        return None
    if health.get("pid") != info.get("serving_pid", info["pid"]):  # serving_pid: rank 0 of several
        return None
    wanted = (
        "idle_timeout",
        "rss_bytes",
        "peak_rss_bytes",
        "trimmed",
        "trim_after_s",
        "batch_invariant",
        "models",
    )
    return {**info, **{key: health.get(key) for key in wanted}}


def memory_text(info: dict) -> str:
    """What an engine's memory figures measure, as one phrase: resident now (and whether that is
    after the idle trim, which hands free memory back a few seconds after the last op), and the
    peak since it started; so two readings a minute apart do not seem to contradict each other."""
    if not info.get("rss_bytes"):
        return ""
    text = f"{info['rss_bytes'] / 1e9:.1f} GB resident now"
    if info.get("trimmed"):
        text += " (idle: free memory handed back)"
    if info.get("peak_rss_bytes"):
        text += f", peak {info['peak_rss_bytes'] / 1e9:.1f} GB"
    if not info.get("trimmed") and info.get("trim_after_s"):
        text += f"; free memory goes back after {info['trim_after_s']:.0f} s idle, so a later reading may be lower"
    return text


def _own_certificate(info: dict) -> ssl.SSLContext | bool:
    """How to check the engine's own https certificate: trust the certificate it serves (its
    engine.json names it), whatever host name it was issued for, since this is a loopback call to
    the port that engine wrote down, and the answer must carry its pid."""
    if "tls_cert" not in info:
        return True
    context = ssl.create_default_context(cafile=info["tls_cert"])
    context.check_hostname = False
    return context


def acquire_start_lock(home: Path) -> int:
    """Wait for the home's start lock and return its file descriptor: closing it releases the lock.
    A raw descriptor, so that a foreground engine can inherit it and close it once it is findable
    (serve.release_start_lock)."""
    fd = os.open(home / "engine.lock", os.O_WRONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


@contextlib.contextmanager
def start_lock(home: Path):
    """Held while one process checks for the home's engine and starts it, so no two start one."""
    fd = acquire_start_lock(home)
    try:
        yield
    finally:
        os.close(fd)


ENGINE_MODULES = ("torch", "peft", "fastapi", "uvicorn")


def require_engine_install() -> None:
    """Raise a clear error when this Python has the client only (no ``sess[engine]``)."""
    missing = [m for m in ENGINE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SessError(
            f"this Python has no engine installed (missing {', '.join(missing)}): install it with "
            "pip install 'sess[engine]', or use a remote engine: ServiceClient(url, api_key=...), "
            "SESS_ENGINE_URL, or sess run engine=remote engine.url=..."
        )


def start_engine(
    home: str | os.PathLike | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "cpu",
    extra_args: list[str] | None = None,
    timeout: float = START_TIMEOUT_S,
) -> dict:
    """Start an engine process for ``home`` in the background and wait until it answers."""
    require_engine_install()
    home = sess_home(home)
    (home / ENGINE_FILE).unlink(missing_ok=True)
    command = server_command(home, host, port, device, extra_args)
    with open(home / LOG_FILE, "ab") as log:
        log_start = log.tell()
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # the server's __main__ re-executes it under the engine's malloc settings
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SessError(_exit_reason(home / LOG_FILE, log_start, process.returncode))
        info = engine_info(home, timeout=1.0)
        if info is not None and info["pid"] == process.pid:
            return info
        time.sleep(0.1)
    process.terminate()
    raise SessError(f"the engine did not answer within {timeout:.0f} s; see {home / LOG_FILE}")


def _exit_reason(log: Path, start: int, code: int) -> str:
    """Why an engine exited at start, from what it wrote to ``log`` past ``start``: the engine's own
    one-line refusal (``sess engine: ...``) when it gave one, else the last lines."""
    with open(log, "rb") as file:
        file.seek(start)
        lines = file.read().decode(errors="replace").strip().splitlines()
    if lines and lines[-1].startswith("sess engine: "):
        return f"the engine refused to start: {lines[-1].removeprefix('sess engine: ')}"
    return f"the engine exited at start (code {code}): {' | '.join(lines[-3:])} (all of it in {log})"


def ensure_local_engine(home: str | os.PathLike | None = None, **start_options) -> str:
    """The URL of the local engine of ``home``, started in the background if none is running."""
    home = sess_home(home)
    info = engine_info(home)
    if info is not None:
        return info["url"]
    with start_lock(home):
        info = engine_info(home)
        if info is None:
            info = start_engine(home, **start_options)
            print(
                f"started the local engine at {info['url']} (pid {info['pid']}, home {home}); "
                "it keeps running: stop it with `sess engine down`",
                file=sys.stderr,
                flush=True,
            )
    return info["url"]


def engine_gone_probe(home: str | os.PathLike | None = None) -> Callable[[], str | None]:
    """For a client of the local engine of ``home`` now running: a call that says why that engine
    can no longer answer (its process has exited) or None while it runs, so a client fails at once
    instead of retrying a dead address (:class:`~.http_transport.HttpTransport`)."""
    info = json.loads((sess_home(home) / ENGINE_FILE).read_text())
    pid = int(info["pid"])

    def gone() -> str | None:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)  # this process started it: reap it, or it lingers as a zombie
        return None if _alive(pid) else f"the local engine (pid {pid}) has exited"

    return gone


def stop_engine(home: str | os.PathLike | None = None, *, timeout: float = 20.0) -> dict | None:
    """Stop the engine of ``home`` (SIGTERM, then SIGKILL after ``timeout``): its info, with
    ``killed`` (the seconds waited) if it had to be killed; None if none was running."""
    home = sess_home(home)
    info = engine_info(home)
    if info is None:
        return None
    pid = int(info["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        info = {**info, "killed": timeout}
    (home / ENGINE_FILE).unlink(missing_ok=True)
    return info
