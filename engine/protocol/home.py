"""Where sess keeps its files: the engine home (``SESS_HOME``, default ``~/.sess``) and its layout.

The home holds the model cache (``models/``), checkpoints (``checkpoints/``), the registry, the
local engine's key (``api_key``), which the SDK reads, and what a running engine writes for the
clients that look for it (``engine.json``, ``engine.log``). The local launcher, the CLI and the
engine server all agree on this layout, and on the command line that starts an engine for a home
(:func:`server_command`). Every writer goes through :func:`atomic_write_bytes` or :func:`atomic_dir`
so a crash never leaves a half-written file under a final name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


def sess_home(home: str | os.PathLike | None = None) -> Path:
    """The engine home: ``home`` if given, else ``$SESS_HOME``, else ``~/.sess`` (created)."""
    path = Path(home or os.environ.get("SESS_HOME") or Path.home() / ".sess").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


LOCAL_KEY_FILE = "api_key"  # the local engine's own key (0600), which the SDK reads when given none
ENGINE_FILE = "engine.json"  # written by a running engine into its home: url, pid, port
LOG_FILE = "engine.log"  # a background engine's output, in its home


def server_command(
    home: Path, host: str, port: int, device: str, extra_args: list[str] | None = None
) -> list[str]:
    """The command line of an engine server process (``python -m sess.engine.server``) for ``home``."""
    command = [sys.executable, "-m", "sess.engine.server", "--home", str(home), "--host", host]
    return command + ["--port", str(port), "--device", device, *(extra_args or [])]


def read_local_key(home: str | os.PathLike | None = None) -> str | None:
    """The key of the local engine of ``home``, if it has written one."""
    path = sess_home(home) / LOCAL_KEY_FILE
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def models_dir(home: str | os.PathLike | None = None) -> Path:
    path = sess_home(home) / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path``, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory beside ``path``; on success fsync its files and rename it to ``path``.

    An existing ``path`` is replaced. On error the temp directory is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_dir(path: str | os.PathLike) -> None:
    """Remove a directory: rename it to a hidden name beside it, then delete that, so a reader never
    finds a half-deleted directory under ``path``. A missing ``path`` is not an error."""
    path = Path(path)
    gone = path.with_name(f".{path.name}.removed")
    shutil.rmtree(gone, ignore_errors=True)  # left by a removal that was cut short
    try:
        os.replace(path, gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)
    _fsync_dir(path.parent)
