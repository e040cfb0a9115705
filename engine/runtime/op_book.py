"""The executor's book of ops (:mod:`.executor`): every op it took, by id, until its answer has been
kept long enough (the newest :data:`KEEP_RESULTS`, never a pending one); the client token each op
came with, so a resubmitted op finds the first; and the long-polls waiting on each, woken the
moment it finishes. Callers outside the book take :attr:`OpBook.lock` where a check and a change
must be one step (the executor's submit holds it while it queues)."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Any

from sess.engine.protocol.errors import NotFound
from sess.engine.runtime.ops.operation import Operation

KEEP_RESULTS = 20_000


class OpBook:
    """Ops by id, client tokens and long-poll waiters, under one lock."""

    def __init__(self, lock: threading.Condition | threading.Lock | None = None):
        """``lock``: the executor's, so that its queue and this book change together."""
        self.lock = lock or threading.Lock()
        self._ops: OrderedDict[str, Operation] = OrderedDict()
        self._tokens: dict[tuple[str, str], str] = {}
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}

    def known(self, owner: str, client_token: str | None) -> str | None:
        """(Under :attr:`lock`) the id of ``owner``'s op sent with ``client_token``, if any."""
        if client_token is None:
            return None
        return self._tokens.get((owner, client_token))

    def remember(self, op: Operation, client_token: str | None) -> None:
        """(Under :attr:`lock`) keep ``op`` and its client token, dropping the oldest finished ops
        beyond :data:`KEEP_RESULTS`."""
        self._ops[op.id] = op
        if client_token is not None:
            self._tokens[(op.owner, client_token)] = op.id
        while len(self._ops) > KEEP_RESULTS:
            old_id, old = self._ops.popitem(last=False)
            if not old.done.is_set():  # never drop a pending op
                self._ops[old_id] = old
                self._ops.move_to_end(old_id, last=False)
                break
        if len(self._tokens) > 2 * KEEP_RESULTS:
            self._tokens = {k: v for k, v in self._tokens.items() if v in self._ops}

    def owned(self, owner: str, op_id: Any) -> Operation:
        """``owner``'s op ``op_id``; NotFound for an unknown id and for another key's op alike."""
        with self.lock:
            op = self._ops.get(op_id) if isinstance(op_id, str) else None
        if op is None or op.owner != owner:
            raise NotFound(f"operation {str(op_id)[:64]!r} not found")
        return op

    async def wait_async(self, op: Operation, timeout: float) -> Operation | None:
        """``op`` once finished, or None after ``timeout`` seconds: the waiter is woken by
        :meth:`wake`, without a thread of its own."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            if op.done.is_set():
                return op
            self._waiters.setdefault(op.id, []).append((loop, future))
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self.lock:
                waiters = self._waiters.get(op.id, [])
                if (loop, future) in waiters:
                    waiters.remove((loop, future))
                if not waiters:
                    self._waiters.pop(op.id, None)
        return op if op.done.is_set() else None

    def wake(self, op: Operation) -> None:
        """Answer the long-polls waiting on ``op`` (call it once ``op`` is finished)."""
        with self.lock:
            waiters = self._waiters.pop(op.id, [])
        for loop, future in waiters:
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(True))
