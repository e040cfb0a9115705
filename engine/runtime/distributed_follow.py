"""A follower rank's loop: run each op rank 0 broadcasts, on the same runtime state, until it says stop.

Rank 0 sends, in the order its executor runs them: followed ops (``{"op", "owner", "request"}``,
the request as its ``to_wire`` JSON), weight gathers (``{"gather"}``), gathers of a session's whole
adapter for a checkpoint it writes (``{"collect", "optimizer", "merge"}``), base models it loaded outside
a followed op (``{"host", "ok"}``) and ``{"stop"}``. A follower starts from rank 0's sessions
(:func:`session_snapshot`), so an op that rank 0 refuses (an unknown or stopped session, a name
taken) is refused here the same way, before any collective. Files are rank 0's: a follower reads
checkpoints but never writes or deletes them.
"""

from __future__ import annotations

import logging

from sess.engine.runtime.checkpoint_ops import whole_adapter
from sess.engine.runtime.distributed import RankFailed, Ranks
from sess.engine.runtime.ops import OPS
from sess.engine.runtime.runtime import Runtime
from sess.engine.runtime.session import Session
from sess.engine.runtime.session_ops import stop_session
from sess.engine.sdk.errors import SessError
from sess.engine.sdk.requests import SessionName
from sess.engine.sdk.types import SessionStatus

log = logging.getLogger("sess.engine")


def session_snapshot(runtime: Runtime) -> dict:
    """Rank 0's sessions as the followers need them: name, owner, base model, LoRA, status."""
    return {
        "sessions": [
            {
                "name": s.name,
                "owner": s.owner,
                "base_model": s.base_model,
                "lora": s.lora,
                "status": s.status.value,
            }
            for s in runtime.sessions.values()
        ]
    }


def follow(runtime: Runtime, ranks: Ranks) -> None:
    """Run rank 0's op stream until it stops (or a collective fails: :class:`RankFailed` propagates)."""
    for row in ranks.receive()["sessions"]:
        runtime.sessions[row["name"]] = Session(
            name=row["name"],
            owner=row["owner"],
            base_model=row["base_model"],
            lora=row["lora"],
            status=SessionStatus(row["status"]),
        )
    while True:
        message = ranks.receive()
        if message.get("stop"):
            return
        if message.get("gather"):
            ranks.join_gather()
        elif "collect" in message:  # rank 0 saves a checkpoint: give it the whole tensors
            session = runtime.sessions[message["collect"]]
            whole_adapter(runtime, session, optimizer=message["optimizer"], merge=message["merge"])
        elif "host" in message:
            ranks.announced = message
            try:
                runtime.host(message["host"])
            except SessError:
                pass  # rank 0 could not load it either, and told its client
        else:
            _run(runtime, message)


def _run(runtime: Runtime, message: dict) -> None:
    name, owner = message["op"], message["owner"]
    spec = OPS[name]
    try:
        request = spec.request.from_wire(message["request"])
        if name == "delete_session":
            _forget(runtime, owner, request)
        else:
            spec.handler(runtime, owner, request)
    except RankFailed:
        raise
    except SessError as exc:  # rank 0 met the same refusal and answered its client with it
        log.info("rank %d: %s refused as on rank 0: %s", runtime.ranks.rank, name, exc)


def _forget(runtime: Runtime, owner: str, request) -> None:
    """``delete_session`` on a follower: stop and forget the session; rank 0 deletes its files (two
    processes removing one directory would race)."""
    session = runtime.session(owner, request.name, live=False)
    if session.live:
        if not request.stop_if_active:
            return  # rank 0 refused it
        stop_session(runtime, owner, SessionName(name=session.name))
    del runtime.sessions[session.name]
