"""Transports: how an SDK client reaches an engine, behind one small interface.

``call`` runs a control op and returns its result; ``submit`` queues an op and returns its id at
once; ``wait`` long-polls for that op's result; ``download`` copies a checkpoint's files. The HTTP
transport (:mod:`.http_transport`) talks to an engine server with these verbs; the in-process
transport (:mod:`sess.engine.runtime.inprocess`, ``ServiceClient("inproc")``, which needs the engine's
dependencies) lives beside the executor it drives, above the SDK: :func:`in_process_transport` loads
it by module path when asked for, as :mod:`.local_engine` starts an engine process by module path,
so importing the SDK imports nothing of the engine's.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Protocol

from sess.engine.sdk.local_engine import require_engine_install

IN_PROCESS = "sess.engine.runtime.inprocess"  # the in-process engine's module


class Transport(Protocol):
    def call(self, name: str, args: dict | None = None) -> Any: ...

    def submit(
        self,
        name: str,
        args: dict,
        *,
        session: str | None = None,
        seq: int | None = None,
        client_token: str | None = None,
    ) -> str: ...

    def wait(self, op_id: str, timeout: float) -> tuple[bool, Any]:
        """(True, result) when the op finished, (False, None) while pending; raises its SessError."""
        ...

    def download(self, path: str, dest_dir: Path) -> Path: ...

    def close(self) -> None: ...


def in_process_transport(home: str | os.PathLike | None = None, owner: str = "local") -> Transport:
    """A transport to this process's engine of ``home`` (started on first use, shared by every
    in-process client); raises a clear error when this Python has the client only."""
    require_engine_install()
    inprocess = importlib.import_module(IN_PROCESS)
    return inprocess.InProcessTransport(inprocess.shared_engine(home), owner=owner)
