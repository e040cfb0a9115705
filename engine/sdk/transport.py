"""Transports: how an SDK client reaches an engine, behind one small interface.

``call`` runs a control op and returns its result; ``submit`` queues an op and returns its id at
once; ``wait`` long-polls for that op's result; ``download`` copies a checkpoint's files.
:class:`InProcessTransport` talks to an :class:`~sess.engine.runtime.executor.Executor` living in
this Python process (``ServiceClient("inproc")``, which needs the engine's dependencies); the HTTP
transport (:mod:`.http_transport`) talks to an engine server with the same verbs.
"""

from __future__ import annotations

import atexit
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sess.engine.sdk.home import sess_home

if TYPE_CHECKING:
    from sess.engine.runtime.executor import Executor


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


_engines: dict[Path, Executor] = {}
_engines_lock = threading.Lock()


def shared_engine(home: str | Path | None = None, device: str = "cpu") -> Executor:
    """One in-process engine per home, shared by every in-process client of this Python process.
    They are closed when the interpreter exits (see :func:`_close_shared_engines`)."""
    from sess.engine.server.launcher import require_engine_install

    require_engine_install()
    from sess.engine.runtime.executor import Executor

    key = sess_home(home).resolve()
    with _engines_lock:
        if not _engines:
            atexit.register(_close_shared_engines)
        if key not in _engines:
            _engines[key] = Executor(home=key, device=device)
        return _engines[key]


def _close_shared_engines() -> None:
    """Stop each in-process engine's executor before the interpreter finalizes. Left running, the
    executor (a daemon thread) can still be freeing a finished request's tensors then; torch takes
    the GIL to do that, the finalizing interpreter ends the thread inside a C++ destructor, and the
    process aborts ("terminate called without an active exception", exit status 134)."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.close()


class InProcessTransport:
    def __init__(self, engine: Executor, owner: str = "local"):
        self.engine = engine
        self.owner = owner

    def call(self, name: str, args: dict | None = None) -> Any:
        return self.engine.call(self.owner, name, args)

    def submit(self, name, args, *, session=None, seq=None, client_token=None) -> str:
        return self.engine.submit(self.owner, name, args, session=session, seq=seq, client_token=client_token)

    def wait(self, op_id: str, timeout: float) -> tuple[bool, Any]:
        op = self.engine.wait(self.owner, op_id, timeout)
        if op is None:
            return False, None
        if op.error is not None:
            raise op.error
        return True, op.result

    def download(self, path: str, dest_dir: Path) -> Path:
        files = self.call("checkpoint_files", {"path": path})
        dest_dir = Path(dest_dir)
        for relative, source in files:
            target = dest_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        return dest_dir

    def close(self) -> None:
        pass
