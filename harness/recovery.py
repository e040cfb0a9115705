"""A run that outlives its engine: when the engine goes away mid-run, bring it back and resume.

After a run that had opened its session fails, :func:`engine_down` asks whether its engine went
away: it does not answer, or it answers as a new process that found the run's session Interrupted.
If not, the failure was the run's own and stands. If so, the runner (:mod:`.runner`) brings it back
(:func:`bring_back`: a local engine is started again on the same home; a remote one is waited for,
with backoff, for up to ``engine.wait_s``) and resumes the run, exactly as ``sess run --resume
RUN_DIR`` would, at most ``engine.restarts`` times, saying so in one line each time. It continues
from the newest whole state on a step the run recorded (:mod:`.resumes`): the state the engine
saved of the session on its way down (SIGTERM, SIGINT) when there is one, else the run's last own
save. Steps done after that state are computed again on a new session (the seeds make them the same
bits); the run record lists them (``meta.json`` ``resumes[].recomputed``) and its usage adds up
every session the run used, so each op the engines ran is counted once. With recovery off
(``engine.restarts=0``) or spent, :class:`EngineLost` names the command that continues.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from omegaconf import DictConfig

from sess.engine import ServiceClient, Usage
from sess.engine.sdk.local_engine import engine_info, ensure_local_engine

from .records import RunRecord
from .resumes import Resume

WAIT_FIRST_S, WAIT_MAX_S = 1.0, 15.0  # a remote engine's backoff between health checks


class EngineLost(RuntimeError):
    """The run's engine went away and the run could not continue on its own; the message says how
    to continue it."""


def continue_hint(run_dir: Path) -> str:
    return f"continue it with: sess run --resume {shlex.quote(str(run_dir))}"


def engine_down(cfg: DictConfig, url: str | None, session: str | None) -> str | None:
    """Why the run's engine has gone away, or None when it has not (or runs in this process): it
    does not answer now, or it answers as a new process that found ``session`` live and marked it
    Interrupted (an engine restarted under the run, by a supervisor or by hand)."""
    if cfg.engine.kind == "inprocess":
        return None
    if url is None and engine_info() is None:
        return "the local engine is not running"
    if url is not None and not _answers(url):
        return f"the engine at {url} does not answer"
    if session is not None and _interrupted(cfg, url, session):
        where = "the local engine" if url is None else f"the engine at {url}"
        return f"{where} restarted (session {session} was interrupted)"
    return None


def _interrupted(cfg: DictConfig, url: str | None, session: str) -> bool:
    svc = ServiceClient(url, cfg.engine.api_key) if url is not None else ServiceClient()
    try:
        found = [s for s in svc.list_sessions(name_contains=session) if s.name == session]
    except Exception:  # it stopped answering again: the next attempt finds out
        return False
    finally:
        svc.close()
    return bool(found) and found[0].status.value == "Interrupted"


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url.rstrip('/')}/healthz", timeout=5.0).status_code == 200
    except (httpx.HTTPError, OSError):
        return False


def bring_back(cfg: DictConfig, url: str | None, say: Callable[[str], None] = print) -> None:
    """Start the local engine again, or wait for a remote one (:class:`EngineLost` past
    ``engine.wait_s``)."""
    if url is None:
        ensure_local_engine()
        return
    target = url
    started, delay, last_said = time.monotonic(), WAIT_FIRST_S, -1.0
    while not _answers(target):
        waited = time.monotonic() - started
        if waited >= cfg.engine.wait_s:
            raise EngineLost(f"the engine at {target} did not come back within {cfg.engine.wait_s:.0f} s")
        if sys.stderr.isatty():
            print(
                f"\rwaiting for the engine at {target}: {waited:.0f} s of {cfg.engine.wait_s:.0f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )
        elif waited - last_said >= 30 or last_said < 0:
            say(f"waiting for the engine at {target}: {waited:.0f} s of {cfg.engine.wait_s:.0f} s")
            last_said = waited
        time.sleep(min(delay, max(cfg.engine.wait_s - waited, 0.05)))
        delay = min(delay * 2, WAIT_MAX_S)
    if sys.stderr.isatty():
        print(file=sys.stderr)


def run_recovering(
    cfg: DictConfig,
    record: RunRecord,
    execute: Callable[[Resume | None], None],
    resume: Resume | None,
    passes: tuple[type[BaseException], ...] = (),
) -> None:
    """``execute(resume)`` (None: a fresh start); when it fails because its engine went away after it
    had opened its session, bring the engine back and execute again as a resume
    (:mod:`.resumes`: from the newest whole state on a recorded step), at most ``engine.restarts``
    times. Exceptions of ``passes`` are never taken for a lost engine."""
    url = engine_url(cfg)
    for restart in range(int(cfg.engine.restarts) + 1):
        opened = len(record.meta.get("sessions", []))
        try:
            execute(resume)
            return
        except passes:
            raise
        except Exception as exc:
            if len(record.meta.get("sessions", [])) == opened:
                raise  # it never got a session: an engine it cannot reach is the error, not a loss
            why = engine_down(cfg, url, record.meta.get("session"))
            if why is None:
                raise
            if restart == cfg.engine.restarts:
                spent = f" after {restart} restarts" if restart else " (engine.restarts=0)"
                raise EngineLost(f"{why}{spent}; {continue_hint(record.path)}") from exc
            done = max((r["step"] for r in record.metrics() if r.get("kind") == "train"), default=0)
            try:
                bring_back(cfg, url, say=_say)
            except EngineLost as lost:
                raise EngineLost(f"{lost}; {continue_hint(record.path)}") from exc
            back = "started it again" if url is None and "not running" in why else "it is back"
            said = f"{why} (at step {done}): {back} and resuming from step {{}} (recovery {restart + 1} of {cfg.engine.restarts})"
            resume = Resume(why, announce=said.format)


def engine_url(cfg: DictConfig) -> str | None:
    """The address of a run's engine when it is not the local engine of SESS_HOME (None then)."""
    if cfg.engine.kind == "local" and not os.environ.get("SESS_ENGINE_URL"):
        return None
    return cfg.engine.url or os.environ.get("SESS_ENGINE_URL")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_usage(svc: ServiceClient, record: RunRecord) -> Usage:
    """The usage of every session the run used (a resume or a recovery opens a new one), each op
    counted once."""
    total = Usage()
    for name in record.meta.get("sessions") or [record.meta["session"]]:
        total = total.add(svc.get_usage(name))
    return total
