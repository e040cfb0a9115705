"""Tinker futures: the request ids that long operations answer with, polled by ``retrieve_future``.

Each future is an asyncio task on the server's loop that waits for its sess op (or runs a control
op in a worker thread) and turns the result into the Tinker answer: JSON, protobuf, or a failure
``{"error", "category"}``. ``retrieve_future`` holds the poll until the answer is ready or until
15 s before the client's read timeout (``x-stainless-read-timeout``, 45 s from the SDK), then
answers ``try_again`` with the queue state, so a waiting client neither busy-polls nor times out.
Finished answers are kept (bounded) so a poll whose answer was lost can be repeated.

The SDK re-sends a POST whose answer it did not get (a dropped connection, a timeout): with the
same idempotency key at the HTTP layer, with a new one from its outer retry loop, but always with
the same body. :meth:`Futures.once` answers every copy of one logical request (keyed by what the
SDK keeps fixed: model and ``seq_id``, session and ``model_seq_id``, ...) with the first copy's
answer, so the op runs once.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from sess.engine.protocol.errors import NotFound

KEEP = 20_000  # futures and answered POSTs remembered (oldest finished ones go first)
HOLD_S = 30.0  # longest a retrieve_future poll is held


@dataclass
class Answer:
    body: bytes
    media_type: str = "application/json"

    @classmethod
    def of(cls, data: Any) -> Answer:
        return cls(json.dumps(data, separators=(",", ":")).encode())


@dataclass
class Future:
    request_id: str
    owner: str
    task: asyncio.Task
    queue: Callable[[], str]  # why it is not done yet, for try_again
    created: float = field(default_factory=time.monotonic)


class Futures:
    def __init__(self) -> None:
        self._futures: OrderedDict[str, Future] = OrderedDict()
        self._posts: OrderedDict[Hashable, asyncio.Future] = OrderedDict()

    def start(self, owner: str, work: Awaitable[Answer], queue: Callable[[], str]) -> str:
        """Run ``work`` in the background as a new future of ``owner``; return its request id."""
        request_id = "req-" + secrets.token_hex(12)
        task = asyncio.get_running_loop().create_task(work)
        self._futures[request_id] = Future(request_id, owner, task, queue)
        _trim(self._futures, lambda f: f.task.done())
        return request_id

    async def retrieve(self, owner: str, request_id: Any, hold_s: float) -> Answer:
        future = self._futures.get(request_id) if isinstance(request_id, str) else None
        if future is None or future.owner != owner:
            raise NotFound(
                f"request_id: no future {str(request_id)[:80]!r} (unknown, expired, or another key's)"
            )
        if not future.task.done():
            await asyncio.wait({future.task}, timeout=max(0.0, min(hold_s, HOLD_S)))
        if not future.task.done():
            waited = time.monotonic() - future.created
            return Answer.of(
                {
                    "type": "try_again",
                    "request_id": request_id,
                    "queue_state": "active",
                    "queue_state_reason": f"{future.queue()}; submitted {waited:.1f} s ago",
                }
            )
        return future.task.result()

    async def once(self, key: Hashable, make: Callable[[], Awaitable[Any]]) -> Any:
        """``make()``'s result for the first request with ``key``, and the same result (or error) for
        every later one: a re-sent POST gets the request id of the op its first copy started."""
        if key in self._posts:
            return await asyncio.shield(self._posts[key])
        answer = asyncio.get_running_loop().create_future()
        self._posts[key] = answer
        _trim(self._posts, lambda f: f.done())
        try:
            result = await make()
        except BaseException as exc:
            answer.set_exception(exc)
            answer.exception()  # retrieved: no "never retrieved" warning when nobody re-sends
            if getattr(exc, "resend", False):  # over budget or a full queue: a re-send may pass
                del self._posts[key]
            raise
        answer.set_result(result)
        return result


def _trim(items: OrderedDict, finished: Callable[[Any], bool]) -> None:
    """Forget the oldest finished entries beyond :data:`KEEP` (pending ones always stay)."""
    if len(items) <= KEEP:
        return
    for key in list(items):
        if len(items) <= KEEP:
            break
        if finished(items[key]):
            del items[key]
