"""Before the engine opens its registry: is ``registry.db`` whole, and if not, what to do.

A registry that is missing, empty (0 bytes, or no tables) or not a SQLite database while checkpoint
directories exist under the home has lost who owns them: an engine that started on it would create
a fresh registry and hand each checkpoint's session name to the next key that asked for it. So the
engine refuses to start (:func:`problem`), naming the file and both fixes: ``sess engine repair``
rebuilds sessions and checkpoints from the manifests beside the files
(:mod:`.registry_repair`), or the backup the engine writes at each start (``registry.db.bak``,
SQLite's online backup, :func:`backup`) is copied back.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
from pathlib import Path

from sess.engine.runtime.checkpoints.manifest import checkpoint_dirs

REGISTRY_FILE = "registry.db"
BACKUP_FILE = "registry.db.bak"


class RegistryUnreadable(RuntimeError):
    """``registry.db`` exists but SQLite cannot read it (the message names the file and the fixes)."""


def fixes(home: Path) -> str:
    """The two ways back to a whole registry, as one sentence."""
    backup_path = home / BACKUP_FILE
    restore = (
        f"or restore the backup the engine took at its last start (cp {backup_path} {home / REGISTRY_FILE}; "
        "it has usage and spend too)"
        if backup_path.is_file()
        else f"(no backup: {backup_path} does not exist)"
    )
    return (
        f"rebuild it from the checkpoints' manifests with `sess engine repair --home {home}` "
        f"(sessions and checkpoints, owners included; not usage or spend), {restore}"
    )


def unreadable(home: Path, error: BaseException) -> str:
    path = home / REGISTRY_FILE
    return f"the registry {path} is not a readable SQLite database ({error}); {fixes(home)}"


def state(home: Path) -> str | None:
    """What is wrong with ``<home>/registry.db`` ("missing", "empty", "unreadable (...)"), or None."""
    path = home / REGISTRY_FILE
    if not path.exists():
        return "missing"
    if path.stat().st_size == 0:
        return "empty (0 bytes)"
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "sessions" not in tables:
                return "empty (no sessions table)"
            used = db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
            if "audit" in tables:  # a repair that found nothing to restore leaves its entry
                used += db.execute("SELECT COUNT(*) FROM audit").fetchone()[0]
            if not used:
                return "empty (no sessions)"
    except sqlite3.DatabaseError as exc:
        return f"unreadable ({exc})"
    return None


def problem(home: Path) -> str | None:
    """Why the engine must not start on this home's registry, or None. A missing or empty registry
    is fine for a home with no checkpoints (a new one); an unreadable one never is."""
    wrong = state(home)
    if wrong is None:
        return None
    found = checkpoint_dirs(home)
    if wrong.startswith("unreadable"):
        return f"the registry {home / REGISTRY_FILE} is {wrong}; {fixes(home)}"
    if not found:
        return None
    return (
        f"the registry {home / REGISTRY_FILE} is {wrong} while {len(found)} checkpoint directories exist "
        f"under {home / 'checkpoints'}: starting would lose who owns them; {fixes(home)}"
    )


def backup(db: sqlite3.Connection, home: Path) -> Path:
    """Copy the open registry ``db`` to ``<home>/registry.db.bak`` with SQLite's online backup:
    into a temp file beside it, fsynced, then renamed over the old backup."""
    target = home / BACKUP_FILE
    fd, tmp = tempfile.mkstemp(prefix=f".{BACKUP_FILE}.", dir=home)
    os.close(fd)
    try:
        with contextlib.closing(sqlite3.connect(tmp)) as copy:
            db.backup(copy)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target
