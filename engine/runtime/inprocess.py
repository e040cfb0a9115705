"""The in-process transport: an SDK client driving an :class:`~.executor.Executor` in this Python process.

``ServiceClient("inproc")`` reaches it through :func:`sess.engine.sdk.transport.in_process_transport`.
One executor per engine home serves every in-process client of the process, and is closed before the
interpreter exits. It speaks the SDK's five-verb ``Transport``, as the HTTP transport does.
"""

from __future__ import annotations

import atexit
import shutil
import threading
from pathlib import Path
from typing import Any

from sess.engine.protocol.home import sess_home
from sess.engine.runtime.executor import Executor

_engines: dict[Path, Executor] = {}
_engines_lock = threading.Lock()


def shared_engine(home: str | Path | None = None, device: str = "cpu") -> Executor:
    """One in-process engine per home, shared by every in-process client of this Python process.
    They are closed when the interpreter exits (see :func:`_close_shared_engines`)."""
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
