"""The engine's control calls as a client sees them: one row per call, with what the client does around it.

A control call (``POST /api/call``) answers at once: list, create, stop and delete sessions,
usage, checkpoints, model facts. The engine's op table (:mod:`sess.engine.runtime.ops.table`) holds
how the engine runs each one; this table holds the client's side, so the SDK, which must not import
torch, never keeps a set of call names of its own: whether a call may be sent again after a lost
answer, and which sessions the client's heartbeat keeps alive. tests/test_architecture.py checks
that the two tables name the same calls. Plain data: importing it loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    reads_only: bool = False  # changes nothing on the engine: sent again after a lost answer
    keeps_alive: bool = False  # a running session in its answer gets the client's heartbeat
    ends_session: bool = False  # the session its ``name`` argument names needs no heartbeat after it


CALLS: dict[str, Call] = {
    "list_base_models": Call(reads_only=True),
    "model_windows": Call(reads_only=True),
    "create_session": Call(keeps_alive=True),
    "create_session_from_state": Call(keeps_alive=True),
    "stop_session": Call(ends_session=True),
    "delete_session": Call(ends_session=True),
    "list_sessions": Call(reads_only=True),
    "get_usage": Call(reads_only=True),
    "session_info": Call(reads_only=True, keeps_alive=True),
    "tokenizer_files": Call(reads_only=True),
    "list_checkpoints": Call(reads_only=True),
    "delete_checkpoint": Call(),
    "model_info": Call(reads_only=True),
    "checkpoint_info": Call(reads_only=True),
    "checkpoint_files": Call(reads_only=True),
}

UNKNOWN = Call()  # a name outside the table: sent once, and the engine answers why it refuses it


def row(name: str) -> Call:
    """The row of ``name``; a name the engine does not know gets the most careful one."""
    return CALLS.get(name, UNKNOWN)
