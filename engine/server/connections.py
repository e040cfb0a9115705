"""The engine's HTTP connections: uvicorn's h11 protocol, closing what a client abandons.

uvicorn closes a connection left idle after a response (``timeout_keep_alive``), bounds the bytes of
an unfinished request head (``h11_max_incomplete_event_size``) and answers 503 past
``limit_concurrency`` open connections, but it never closes a connection that sends nothing, a
request head that never ends, or a body that stops arriving. :class:`BoundedH11Protocol` is
uvicorn's own h11 protocol, handed to it as ``Config(http=...)``, with three bounds on top:

- a new connection must finish its request head within ``read_timeout`` seconds, and so must a
  request head that starts on a kept-alive connection (its total time, however slowly it drips);
- a request body must keep arriving: a pause of ``read_timeout`` seconds closes the connection
  (the handler reading it then ends with one line in the log, see :mod:`.http_app`);
- one client address holds at most ``max_per_client`` connections: a connection past that is
  closed as soon as it is accepted (clients retry on a fresh connection once one of theirs ends).

A request that is complete and waiting for its answer (a long-poll, a long op) is never timed out
here. Each close is one line in the engine log. The subclass reads the protocol's ``conn`` (its h11
connection), ``client``, ``loop`` and ``transport``; checked on uvicorn 0.55 with h11 0.16, and
tests/server/test_connections.py fails if a release moves them.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from sess.engine.server.settings import MAX_CLIENT_CONNECTIONS, READ_TIMEOUT_S

log = logging.getLogger("sess.engine")
OWES_BYTES = (h11.IDLE, h11.SEND_BODY)  # the client's state while it owes us a head or a body


class BoundedH11Protocol(H11Protocol):
    read_timeout: float = READ_TIMEOUT_S
    max_per_client: int = MAX_CLIENT_CONNECTIONS
    _open: dict[str, int] = {}  # client address -> connections open (the server's one event loop)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._host = self.client[0] if self.client else "?"
        held = self._open.get(self._host, 0)
        if held >= self.max_per_client:
            log.warning(
                "connection from %s closed: it holds %d connections (limit %d per client)",
                self._host,
                held,
                self.max_per_client,
            )
            self._host = None
            transport.close()
            return
        self._open[self._host] = held + 1
        self._arm()  # its first request head is due within read_timeout

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if getattr(self, "_host", None) is not None:
            left = self._open.get(self._host, 1) - 1
            if left > 0:
                self._open[self._host] = left
            else:
                self._open.pop(self._host, None)
            self._host = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm()  # the body moved on: it has another read_timeout
        elif state is h11.IDLE:
            if self._deadline is None:  # a request head began: it must end within read_timeout
                self._arm()
        else:
            self._disarm()  # the request is whole (or the connection is ending): not ours to time

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout, self._expire)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state not in OWES_BYTES:
            return
        if self.conn.their_state is h11.IDLE:  # no request is running: this is the only line about it
            log.warning(
                "connection from %s:%s closed: no complete request head within %.0f s",
                *(self.client or ("?", 0)),
                self.read_timeout,
            )
        self.transport.close()
