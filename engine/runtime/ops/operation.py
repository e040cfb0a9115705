"""An op as the executor holds it from submit to its answer, and the error that names a failure
inside the engine."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sess.engine.protocol.errors import SessError
from sess.engine.protocol.requests import Request
from sess.engine.protocol.types import Usage
from sess.engine.runtime.runtime import Runtime

log = logging.getLogger("sess.engine")


@dataclass
class Operation:
    id: str
    owner: str
    name: str  # a key of OPS, or "" for a callable of the engine's own (``run``)
    request: Request | None = None
    session: str | None = None
    seq: int | None = None
    fn: Callable[[Runtime], Any] | None = None  # ``run``'s callable: never built from client input
    created: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: SessError | None = None
    usage: Usage | None = None  # what it cost: tokens and engine seconds (see usage.py)
    refused: bool = False  # its request was refused on reading, before it was queued
    saved: str | None = None  # a stop_session's state save, made before the session stopped
    # a sample op's listener of its tokens as they are drawn (SampleJob.progress), set by the server
    # that submitted it; never built from client input
    progress: Any = None

    def finish(self, result: Any = None, error: SessError | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


def internal_error(op: Operation, exc: BaseException) -> SessError:
    """A 500 naming what failed inside the engine (a bug of its own, not the client's input); the
    traceback goes to the engine's log."""
    log.error("op %s failed:\n%s", op.name or "internal", "".join(traceback.format_exception(exc)))
    return SessError(
        f"{op.name or 'internal op'} failed inside the engine: {type(exc).__name__}: {exc}", status=500
    )
