"""APIFuture and the background submitter that sends a client's ops in call order.

Every engine call returns an :class:`APIFuture` at once. The :class:`Submitter` hands ops to the
transport on one thread, in exactly the order they were made (so sequence numbers arrive in order),
then long-polls each op's result on a worker pool and resolves its future.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sess.engine.sdk.transport import Transport

T = TypeVar("T")
POLL_S = 30.0


class APIFuture(Generic[T]):
    """The eventual result of one engine op; a failure surfaces at :meth:`result` with the engine's message."""

    def __init__(self, future: cf.Future | None = None):
        self._future: cf.Future = future or cf.Future()
        self.operation_id: str | None = None

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Cancel an op that has not yet left the client; an op already sent runs to completion."""
        return self._future.cancel()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def add_done_callback(self, fn: Callable[[APIFuture[T]], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def set_result(self, value: T) -> None:
        """Resolve the future with ``value`` (the client that made it, once the op's answer is in)."""
        self._future.set_result(value)

    def set_exception(self, error: BaseException) -> None:
        """Resolve the future with ``error``, which :meth:`result` raises."""
        self._future.set_exception(error)

    async def result_async(self) -> T:
        return await asyncio.wrap_future(self._future)

    def __await__(self):
        return self.result_async().__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture {self.operation_id or '?'} {state}>"


class Submitter:
    """Sends ops to a transport in call order and resolves their futures from a poll pool."""

    def __init__(self, transport: Transport, max_pollers: int = 64):
        self.transport = transport
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pollers = cf.ThreadPoolExecutor(max_workers=max_pollers, thread_name_prefix="sess-poll")
        self._thread = threading.Thread(target=self._send_loop, name="sess-submit", daemon=True)
        self._thread.start()

    def submit(
        self,
        name: str,
        args: dict,
        convert: Callable[[Any], T],
        *,
        session: str | None = None,
        seq: int | None = None,
        client_token: str | None = None,
    ) -> APIFuture[T]:
        future: APIFuture[T] = APIFuture()
        self._queue.put((future, name, args, convert, session, seq, client_token))
        return future

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, name, args, convert, session, seq, token = item
            if not future._future.set_running_or_notify_cancel():
                if seq is not None:  # keep the session's order moving past a cancelled op
                    self._send_noop(session, seq)
                continue
            try:
                future.operation_id = self.transport.submit(
                    name, args, session=session, seq=seq, client_token=token
                )
            except BaseException as exc:
                future.set_exception(exc)
                continue
            self._pollers.submit(self._poll, future, convert)

    def _send_noop(self, session: str, seq: int) -> None:
        try:
            self.transport.submit("noop", {}, session=session, seq=seq)
        except Exception:
            pass

    def _poll(self, future: APIFuture, convert: Callable) -> None:
        try:
            while True:
                finished, result = self.transport.wait(future.operation_id, POLL_S)
                if finished:
                    break
            future.set_result(convert(result))
        except BaseException as exc:
            future.set_exception(exc)

    def close(self) -> None:
        self._queue.put(None)
        self._pollers.shutdown(wait=False, cancel_futures=True)


def with_async_twins(*names: str):
    """Give a client class ``name_async`` coroutine twins of its methods ``names``, each returning
    the same APIFuture (so ``await (await tc.forward_backward_async(...))`` gives the result)."""

    def decorate(cls):
        for name in names:

            def make(method_name):
                async def twin(self, *args, **kwargs):
                    return getattr(self, method_name)(*args, **kwargs)

                twin.__name__ = f"{method_name}_async"
                twin.__doc__ = f"Coroutine twin of :meth:`{method_name}`; awaits to its APIFuture."
                return twin

            setattr(cls, f"{name}_async", make(name))
        return cls

    return decorate
