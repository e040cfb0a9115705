"""Models the operator registers: names beyond the catalog that every key of the engine may use.

``sess engine models add NAME DIR|HUB_ID`` writes them to ``models.json`` in the engine home, under a
lock and atomically (temp file + rename), as ``{"models": {NAME: {"source": "local" | "hf", "repo":
DIR | HUB_ID, "arch": ...}}}``. A running engine reads the file again when it changes, so a model
added while it runs is usable at once; one removed is refused to every request that names it (a
base model already in memory stays there until the engine restarts).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from sess.engine.protocol.checkpoint_paths import check_name
from sess.engine.protocol.errors import InvalidRequest, SessError
from sess.engine.protocol.home import atomic_write_bytes, sess_home

MODELS_FILE = "models.json"
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


class ModelsFileError(SessError, ValueError):
    """``models.json`` cannot be read: the engine's setup, not the request, is at fault (503)."""

    status = 503


_cache: dict[Path, tuple[tuple[int, int, int], dict[str, dict]]] = {}


def models_file(home: str | os.PathLike | None = None) -> Path:
    return sess_home(home) / MODELS_FILE


def registered(home: str | os.PathLike | None = None, *, fresh: bool = False) -> dict[str, dict]:
    """The registered models of ``home``: name -> {"source", "repo", "arch", "added"} (none: {}).
    Read again when the file changed (each write renames a new file into place); ``fresh``: always."""
    path = models_file(home)
    try:
        stat = path.stat()
    except FileNotFoundError:
        return {}
    stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    cached = _cache.get(path)
    if cached is not None and cached[0] == stamp and not fresh:
        return cached[1]
    try:
        models = json.loads(path.read_text())["models"]
        if not isinstance(models, dict):
            raise TypeError("models is not an object")
        for name, entry in models.items():
            if not (isinstance(entry, dict) and entry.get("source") in ("local", "hf")):
                raise TypeError(f"model {name!r} has no source local or hf")
            if not isinstance(entry.get("repo"), str):
                raise TypeError(f"model {name!r} has no repo")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelsFileError(f"{path}: not a registered-models file ({exc}); fix or remove it") from None
    _cache[path] = (stamp, models)
    return models


@contextlib.contextmanager
def _locked(home: str | os.PathLike | None) -> Iterator[dict[str, dict]]:
    """The registered models, to change in place; written back atomically on success, under a lock
    that keeps concurrent writers from losing each other's changes."""
    path = models_file(home)
    with open(path.with_name(f".{MODELS_FILE}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        models = dict(registered(home, fresh=True))
        yield models
        atomic_write_bytes(path, (json.dumps({"models": models}, indent=1, sort_keys=True) + "\n").encode())


def source_of(where: str) -> dict:
    """{"source", "repo", "arch"} for a model directory (it must hold ``config.json``) or a hub id."""
    path = Path(where).expanduser()
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{where}: not a transformers model directory (config.json: {exc})") from None
        return {
            "source": "local",
            "repo": str(path.resolve()),
            "arch": str(config.get("model_type", "unknown")),
        }
    if HUB_ID.fullmatch(where) and ".." not in where:
        return {"source": "hf", "repo": where, "arch": "unknown"}
    raise ValueError(f"{where}: neither a model directory here nor a Hugging Face hub id (org/name)")


def register(home: str | os.PathLike | None, name: str, where: str, *, reserved: set[str]) -> dict:
    """Register ``name`` for the model at ``where`` (a directory or a hub id); its entry.
    A name in ``reserved`` (the catalog's) or already registered is refused."""
    try:
        check_name(name, "NAME")
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from None
    if name in reserved:
        raise ValueError(f"NAME: {name!r} is a catalog model already; pick another name")
    entry = {**source_of(where), "added": time.time()}
    with _locked(home) as models:
        if name in models:
            raise ValueError(
                f"NAME: {name!r} is registered already ({models[name]['repo']}); remove it first"
            )
        models[name] = entry
    return entry


def unregister(home: str | os.PathLike | None, name: str) -> dict:
    """Remove registered model ``name``; its entry (an unknown name is a ValueError)."""
    with _locked(home) as models:
        if name not in models:
            raise ValueError(f"NAME: no registered model {name!r}")
        return models.pop(name)
