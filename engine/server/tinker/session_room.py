"""Room for a new Tinker model at a key's live-session limit: release the sessions of exited clients.

A finished recipe's process exits without finishing its Tinker session, so its model stays live
until the engine notices its client is gone. The tinker SDK heart-beats every
:data:`SDK_BEAT_S` seconds (``SESSION_HEARTBEAT_PERIOD_SEC`` in its ``internal_client_holder``); a
model whose client has sent neither a beat nor an op for over two beat periods
(:data:`MISSED_BEATS_S`) has missed its beats, and its process has exited or lost the engine. When a
key at its limit asks for a new model, the longest silent of such Tinker models is stopped first
(a sess SDK session, which beats on a period of its own, waits for the lapse), state saved exactly
as the engine's heartbeat lapse would (:meth:`ManagedEngine.release_silent`), and resumable; the
others are left to the lapse. When none has missed its beats yet but one heart-beating session is
silent, the request waits for it, at most :data:`MAX_WAIT_S` seconds (the log says so); a session
whose client still beats is never released, and the engine refuses the model with its usual limit
message, saying that it waited.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.concurrency import run_in_threadpool

from sess.engine.protocol.errors import InvalidRequest
from sess.engine.server.tinker.state import Tinker

log = logging.getLogger("sess.engine")
SDK_BEAT_S = 10.0
MISSED_BEATS_S = 2 * SDK_BEAT_S
MAX_WAIT_S = MISSED_BEATS_S + 5.0  # one silent since its last beat crosses MISSED_BEATS_S by then


async def make_room(tinker: Tinker, owner: str) -> None:
    """Release ``owner``'s Tinker models whose clients missed their beats when the key is at its
    limit, waiting up to :data:`MAX_WAIT_S` for one; refuse (429) when the wait frees none. Only
    Tinker models: the sess SDK beats on its own period (a quarter of the lapse)."""
    engine = tinker.engine
    if not engine.at_limit(owner):
        return
    models = {name for s in tinker.sessions.values() if s.owner == owner for name in s.models}
    deadline = time.monotonic() + MAX_WAIT_S
    waited = False
    while True:
        released = await run_in_threadpool(engine.release_silent, owner, MISSED_BEATS_S, models)
        if released or not engine.at_limit(owner):
            if released:
                log.info("key at its session limit: released %s (its client missed its beats)", released)
            return
        silent = engine.silent_for(owner, models)
        left = deadline - time.monotonic()
        if not silent or left <= 0:
            break
        if not waited:
            log.info(
                "key at its session limit: waiting up to %.0f s for a session whose client is silent "
                "(%s, %.1f s) to miss its beats",
                left,
                silent[0][1],
                silent[0][0],
            )
            waited = True
        await asyncio.sleep(min(1.0, max(0.05, MISSED_BEATS_S - silent[0][0] + 0.05), left))
    if waited:
        raise InvalidRequest(
            f"session limit: this key is at its limit of live sessions and none of their clients missed "
            f"its heartbeats (silent over {MISSED_BEATS_S:.0f} s) within {MAX_WAIT_S:.0f} s of waiting; "
            "finish a session (ServiceClient's session end, or sess stop NAME) first",
            status=429,
        )
