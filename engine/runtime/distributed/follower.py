"""A follower rank's loop: run each op rank 0 broadcasts, on the same runtime state, until it says stop.

Rank 0 sends, in the order its executor runs them: followed ops (``{"op", "owner", "request"}``,
the request as its ``to_wire`` JSON), weight gathers (``{"gather"}``; a follower keeps the whole
weights, as rank 0 does, until a message that needs the shards), decode steps with the sample
requests handed to each rank (``{"decode", "jobs"}``), the checkpoint adapters to hold for them
(``{"samplers"}``, :mod:`sess.engine.runtime.distributed.sample_spread`), ``compute_logprobs`` requests handed to each rank
(``{"logprobs"}``, :mod:`sess.engine.runtime.distributed.logprob_spread`), gathers of a session's whole
adapter for a checkpoint it writes (``{"collect", "optimizer", "merge"}``), base models it loaded outside
a followed op (``{"host", "ok"}``) and ``{"stop"}``. A follower starts from rank 0's sessions
(:func:`session_snapshot`), so an op that rank 0 refuses (an unknown or stopped session, a name
taken) is refused here the same way, before any collective. Files are rank 0's: a follower reads
checkpoints but never writes or deletes them, so on another host it needs rank 0's home on a
shared filesystem: rank 0 writes a token there that every follower checks before it follows.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from sess.engine.protocol.errors import SessError
from sess.engine.protocol.home import atomic_write_bytes
from sess.engine.protocol.requests import SessionName
from sess.engine.protocol.types import SessionStatus
from sess.engine.runtime.distributed.logprob_spread import follow_group
from sess.engine.runtime.distributed.ranks import RankFailed, Ranks
from sess.engine.runtime.distributed.sample_spread import Decoding, follow_samplers
from sess.engine.runtime.ops.checkpoint_ops import whole_adapter
from sess.engine.runtime.ops.session_ops import stop_session
from sess.engine.runtime.ops.table import OPS
from sess.engine.runtime.runtime import Runtime
from sess.engine.runtime.session import Session

log = logging.getLogger("sess.engine")


HOME_TOKEN = "ranks.token"


def session_snapshot(runtime: Runtime) -> dict:
    """Rank 0's sessions as the followers need them (name, owner, base model, LoRA, status), and its
    home with a token just written into it (:func:`check_home`)."""
    token = secrets.token_hex(16)
    atomic_write_bytes(runtime.home / HOME_TOKEN, token.encode())
    return {
        "home": str(runtime.home),
        "token": token,
        "sessions": [
            {
                "name": s.name,
                "owner": s.owner,
                "base_model": s.base_model,
                "lora": s.lora,
                "status": s.status.value,
            }
            for s in runtime.sessions.values()
        ],
    }


def follow(runtime: Runtime, ranks: Ranks) -> None:
    """Run rank 0's op stream until it stops (or a collective fails: :class:`RankFailed` propagates)."""
    snapshot = ranks.receive()
    check_home(runtime.home, snapshot)
    for row in snapshot["sessions"]:
        runtime.sessions[row["name"]] = Session(
            name=row["name"],
            owner=row["owner"],
            base_model=row["base_model"],
            lora=row["lora"],
            status=SessionStatus(row["status"]),
        )
    decoding = Decoding(runtime, ranks)
    while True:
        message = ranks.receive()
        if message.get("stop"):
            return
        if "decode" in message:  # a decode step, with the sample requests this rank joins to it
            decoding.step(message)
            continue
        if "logprobs" in message:  # compute_logprobs requests, some of them this rank's
            follow_group(runtime, message)
            continue
        if "samplers" in message:  # rank 0's checkpoint adapters for sampling changed
            ranks.sharded()  # as rank 0 before it sent this
            follow_samplers(runtime, message)
            continue
        if message.get("gather"):
            ranks.join_gather()
            continue
        ranks.sharded()  # as rank 0 before it sent this
        if "collect" in message:  # rank 0 saves a checkpoint: give it the whole tensors
            session = runtime.sessions[message["collect"]]
            whole_adapter(runtime, session, optimizer=message["optimizer"], merge=message["merge"])
        elif "host" in message:
            ranks.announced = message
            try:
                runtime.host(message["host"])
            except SessError:
                pass  # rank 0 could not load it either, and told its client
        else:
            _run(runtime, ranks, message)


def check_home(home: Path, snapshot: dict) -> None:
    """SystemExit naming this rank's home unless it is rank 0's (the same files, on a shared
    filesystem on another host): a follower reads the checkpoints rank 0 writes."""
    try:
        same = (home / HOME_TOKEN).read_text() == snapshot["token"]
    except OSError:
        same = False
    if not same:
        raise SystemExit(
            f"sess engine: --home {home} on this host is not rank 0's home ({snapshot['home']} on node 0): "
            "every host of an engine runs with the same home on a filesystem they share (NFS or the "
            "like), where rank 0 writes the checkpoints the others read"
        )


def _run(runtime: Runtime, ranks: Ranks, message: dict) -> None:
    name, owner = message["op"], message["owner"]
    spec = OPS[name]
    ranks.forget_forward_order()  # as rank 0 did before sending it
    try:
        request = spec.request.from_wire(message["request"])
        if name == "delete_session":
            _forget(runtime, owner, request)
        else:
            spec.handler(runtime, owner, request)
    except RankFailed:
        raise
    except SessError as exc:  # rank 0 met the same refusal and answered its client with it
        log.info("rank %d: %s refused as on rank 0: %s", ranks.rank, name, exc)


def _forget(runtime: Runtime, owner: str, request) -> None:
    """``delete_session`` on a follower: stop and forget the session; rank 0 deletes its files (two
    processes removing one directory would race)."""
    session = runtime.session(owner, request.name, live=False)
    if session.live:
        if not request.stop_if_active:
            return  # rank 0 refused it
        stop_session(runtime, owner, SessionName(name=session.name))
    del runtime.sessions[session.name]
