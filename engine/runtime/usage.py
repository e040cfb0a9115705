"""What an op costs, in one place: its tokens and the engine's seconds on it, and whose it is.

Every op the registry records is counted once, with the same :class:`~sess.engine.protocol.types.Usage`
added to its session's totals and written to the registry's per-operation rows, so a session's
total is the sum of its rows. Seconds are the engine's own time on the op: a synchronous op's
handler time, and for a sample request its share of every prefill and decode step it took part in
(a step's time split by the rows each request had in it), never the time it spent waiting. Tokens:
``training_tokens`` for forward / forward_backward, ``prefill_tokens`` for prompts (sample,
compute_logprobs), ``sampled_tokens`` for what sampling produced; ``cached_prefill_tokens``, the
part of a sample's prompt tokens the sampler found in its prefix cache, is counted by the sample op.

The ledger is written before the answer: an op whose row cannot be written (a full disk under the
engine home) is answered with :class:`Unrecorded` instead of its result, and its usage is taken back
from its session, so no client is served work that is not billed.
"""

from __future__ import annotations

from typing import Any

from sess.engine.protocol import requests as rq
from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.protocol.errors import SessError
from sess.engine.protocol.types import Usage


class Unrecorded(SessError):
    """The op ran but its usage could not be recorded: its result is withheld, and it is not billed.
    507 Insufficient Storage: the engine's fault (its disk), not the request's."""

    status = 507


def usage_of(request: rq.Request | None, result: Any, seconds: float) -> Usage:
    """The usage of a synchronous op that ran for ``seconds`` (``result`` None: it failed)."""
    tokens = {}
    if result is not None and isinstance(request, rq.ForwardRequest):
        tokens["training_tokens"] = sum(d.model_input.length for d in request.data)
    elif result is not None and isinstance(request, rq.ComputeLogprobs):
        tokens["prefill_tokens"] = len(request.prompt)
    return Usage(wall_time_s=seconds, operations=1, **tokens)


def session_of(session: str | None, request: rq.Request | None, result: Any = None) -> str | None:
    """The session an op works on or is accounted to, if any: its envelope's session, a sample's
    target session or checkpoint's session, or the session a control op names (or created)."""
    if session:
        return session
    if isinstance(request, rq.SampleRequest | rq.ComputeLogprobs):
        target = request.target
        if target.session is not None:
            return target.session
        if target.model_path is not None:
            try:
                return parse_path(target.model_path).session
            except SessError:
                return None
        return None
    if isinstance(request, rq.CreateSession | rq.CreateSessionFromState):
        return result["name"] if isinstance(result, dict) else None
    if isinstance(request, rq.SessionName | rq.DeleteSession):
        return request.name
    return None
