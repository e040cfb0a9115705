"""Where a resumed run continues: the newest whole state on a step the run recorded, so no recorded
step is computed again when one exists.

Two kinds of state qualify. The run's own (``checkpoints.jsonl``, saved every ``save_every`` steps,
at the end and on Ctrl-C or SIGTERM), and the states the engine saves of a live session when it
stops it: on its own shutdown (SIGTERM or SIGINT to the engine), on a ``stop``, or when the session
idles (``shutdown-step<N>-<k>``, ``stop-...``, ``idle-...``, where N is the session's count of
optimizer steps). At the end of every step the runner records that count beside the step
(``session_steps.jsonl``, :func:`note_step`). An engine's state of the run's last session at count N
is the state at the last recorded step whose count is N; one whose count matches no recorded step
was saved after a step's update and before the step was recorded, and is not used.

A state that does not load (a file or ``state.json`` missing, a file cut short: the engine answers
400 or 404) is skipped with a line saying so, and the next best one is tried: the newer of the two kinds
first, then older states of the run's own, then the start. The choice is recorded in ``meta.json``'s
``resumes`` (``step``, ``path``, ``saved_by``, ``recomputed``: the recorded steps run again, and
``skipped``: the states that would not load).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from sess.engine import ServiceClient, TrainingClient
from sess.engine.protocol.errors import InvalidRequest, NotFound

from .records import RunRecord

STEPS_FILE = "session_steps.jsonl"
ENGINE_SAVED = re.compile(r"^(shutdown|stop|idle)-step(\d+)-\d+$")


@dataclass
class Resume:
    """A resume of a run: why (``meta.json``'s ``resumes[].reason``) and, optionally, the line to say
    once the step it continues from is known."""

    reason: str
    announce: Callable[[int], str] | None = None


@dataclass(frozen=True)
class State:
    step: int  # the run's step this state holds
    path: str | None  # None: the start, nothing saved
    saved_by: str  # "engine", "run" or "start"


def note_step(record: RunRecord, tc: TrainingClient, done: int) -> None:
    """Record the session's optimizer-step count at the end of step ``done``. An engine that does not
    answer leaves the step out: its states then never stand for that step."""
    try:
        found = [s for s in tc.service.list_sessions(name_contains=tc.name) if s.name == tc.name]
    except Exception:
        return
    if found:
        record.append(STEPS_FILE, {"step": done, "session": tc.name, "session_step": found[0].step})


def engine_states(svc: ServiceClient, record: RunRecord) -> list[State]:
    """The states the engine saved of the run's last session that stand for a recorded step, newest
    first."""
    session = record.meta.get("session")
    if session is None:
        return []
    steps: dict[int, int] = {}  # session step -> the last recorded run step at it
    for row in record.rows(STEPS_FILE):
        if row.get("session") == session:
            steps[row["session_step"]] = max(row["step"], steps.get(row["session_step"], 0))
    try:
        saved = [c for c in svc.list_checkpoints(session) if c.get("kind") == "state"]
    except Exception:  # the session is gone from the engine: its states with it
        return []
    found = []
    for checkpoint in saved:
        match = ENGINE_SAVED.match(checkpoint["path"].rsplit("/", 1)[-1])
        if match and int(match.group(2)) in steps:
            found.append((steps[int(match.group(2))], checkpoint["created"], checkpoint["path"]))
    return [State(step, path, "engine") for step, _, path in sorted(found, reverse=True)]


def candidates(svc: ServiceClient, record: RunRecord) -> list[State]:
    """Every state a resume may continue from, best first: the newest on the latest step (the run's
    own before the engine's at the same step), down to the start."""
    own = [State(c["step"], c["path"], "run") for c in record.checkpoints() if c.get("kind") == "state"]
    ordered = sorted(
        [*engine_states(svc, record), *own], key=lambda s: (s.step, s.saved_by == "run"), reverse=True
    )
    return [*ordered, State(0, None, "start")]


def open_resumed(
    svc: ServiceClient, record: RunRecord, resume: Resume, open_from: Callable[[str], TrainingClient]
) -> tuple[TrainingClient | None, int]:
    """Open a session from the best state that loads (``open_from(path)``); record the choice.
    Returns the session (None: from the start, the caller opens a fresh one) and its step."""
    skipped: list[str] = []
    tc = None
    for state in candidates(svc, record):
        if state.path is None:
            break
        try:
            tc = open_from(state.path)
            break
        except (InvalidRequest, NotFound) as exc:
            if exc.status not in (400, 404):  # not about the state (a name taken, a budget): the run's error
                raise
            why = " ".join(str(exc).split())
            skipped.append(f"{state.path} ({why})")
            say(f"state {state.path} of step {state.step} is not whole ({why}): skipped")
    settle(record, state, resume.reason, skipped)
    if resume.announce is not None:
        say(resume.announce(state.step))
    return tc, state.step


def settle(record: RunRecord, state: State, reason: str, skipped: list[str]) -> None:
    """Drop the record's work past ``state`` and list the resume in ``meta.json``."""
    recorded = {r["step"] for r in record.metrics() if r.get("kind") == "train"}
    record.truncate_after(state.step if state.path is not None else -1)
    if state.saved_by == "engine":  # the run's state from now on: a later resume may start from it
        record.append("checkpoints.jsonl", {"step": state.step, "kind": "state", "path": state.path})
    meta = record.meta
    entry = {
        "step": state.step,
        "path": state.path,
        "saved_by": state.saved_by,
        "reason": reason,
        "recomputed": sorted(s for s in recorded if s > state.step),
    }
    resumes = [*meta.get("resumes", []), entry | ({"skipped": skipped} if skipped else {})]
    record.write_meta(
        {**{k: v for k, v in meta.items() if k != "error"}, "status": "running", "resumes": resumes}
    )


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
