"""A run that outlives its engine: when the engine goes away mid-run, bring it back and resume.

After a run fails, :func:`engine_down` asks whether its engine still answers. If it does, the
failure was the run's own and stands. If it does not, the runner (:mod:`.runner`) brings it back
(:func:`bring_back`: a local engine is started again on the same home; a remote one is waited for,
with backoff, for up to ``engine.wait_s``) and resumes the run from its last saved state, exactly as
``sess run --resume RUN_DIR`` would, at most ``engine.restarts`` times, saying so in one line each
time. The steps done after that state are computed again on a new session (the seeds make them the
same bits); the run record lists them (``meta.json`` ``resumes[].recomputed``) and its usage adds up
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

WAIT_FIRST_S, WAIT_MAX_S = 1.0, 15.0  # a remote engine's backoff between health checks


class EngineLost(RuntimeError):
    """The run's engine went away and the run could not continue on its own; the message says how
    to continue it."""


def continue_hint(run_dir: Path) -> str:
    return f"continue it with: sess run --resume {shlex.quote(str(run_dir))}"


def engine_down(cfg: DictConfig, url: str | None) -> str | None:
    """Why the run's engine does not answer now, or None when it does (or runs in this process)."""
    if cfg.engine.kind == "inprocess":
        return None
    if cfg.engine.kind == "local" and url is None:
        return None if engine_info() is not None else "the local engine is not running"
    return (
        None if _answers(url or cfg.engine.url) else f"the engine at {url or cfg.engine.url} does not answer"
    )


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url.rstrip('/')}/healthz", timeout=5.0).status_code == 200
    except (httpx.HTTPError, OSError):
        return False


def bring_back(cfg: DictConfig, url: str | None, say: Callable[[str], None] = print) -> None:
    """Start the local engine again, or wait for a remote one (:class:`EngineLost` past
    ``engine.wait_s``)."""
    if cfg.engine.kind == "local" and url is None:
        ensure_local_engine()
        return
    target = url or cfg.engine.url
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


def resume_point(record: RunRecord, reason: str) -> tuple[int, str | None]:
    """Where a resume of ``record`` starts: its last saved state (or, with none, the beginning),
    with the work done past it dropped from the record and listed in ``meta.json``'s ``resumes``
    (``recomputed``: the steps that will run again)."""
    state = record.last_state()
    step = state["step"] if state is not None else 0
    recorded = {r["step"] for r in record.metrics() if r.get("kind") == "train"}
    record.truncate_after(step)
    if state is None:  # nothing saved: from the start, as the same seed gives it
        record.truncate_after(-1)
    meta = record.meta
    resumes = [
        *meta.get("resumes", []),
        {
            "step": step,
            "path": state["path"] if state else None,
            "reason": reason,
            "recomputed": sorted(s for s in recorded if s > step),
        },
    ]
    record.write_meta(
        {**{k: v for k, v in meta.items() if k != "error"}, "status": "running", "resumes": resumes}
    )
    return step, state["path"] if state else None


def run_recovering(
    cfg: DictConfig,
    record: RunRecord,
    execute: Callable[[int, str | None], None],
    start_step: int,
    resume_from: str | None,
    passes: tuple[type[BaseException], ...] = (),
) -> None:
    """``execute(start_step, resume_from)``; when it fails because its engine went away after it had
    opened its session, bring the engine back and execute again from the last saved state, at most
    ``engine.restarts`` times. Exceptions of ``passes`` are never taken for a lost engine."""
    url = engine_url(cfg)
    for restart in range(int(cfg.engine.restarts) + 1):
        opened = len(record.meta.get("sessions", []))
        try:
            execute(start_step, resume_from)
            return
        except passes:
            raise
        except Exception as exc:
            if len(record.meta.get("sessions", [])) == opened:
                raise  # it never got a session: an engine it cannot reach is the error, not a loss
            why = engine_down(cfg, url)
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
            start_step, resume_from = resume_point(record, why)
            _say(
                f"{why} (at step {done}): started it again and resuming from step {start_step} "
                f"(recovery {restart + 1} of {cfg.engine.restarts})"
                if url is None
                else f"{why} (at step {done}): it is back; resuming from step {start_step} "
                f"(recovery {restart + 1} of {cfg.engine.restarts})"
            )


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
