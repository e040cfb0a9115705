"""A checkpoint's manifest: who owns it and what it is, in a JSON file inside its own directory.

Every checkpoint directory the engine writes holds ``sess-checkpoint.json``: its owner as
:func:`owner_digest` (a SHA-256 of the owner id that a key acts as: never a key, nor the id in
clear), its session, kind and name, the base model and when it was written. The registry is what
the engine reads; the manifests are what ``sess engine repair`` rebuilds a lost registry from
(:mod:`sess.engine.server.registry_repair`), so the files never lose their owner with it.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from sess.engine.protocol.home import atomic_write_bytes

MANIFEST_FILE = "sess-checkpoint.json"
FORMAT = 1


def owner_digest(owner: str) -> str:
    """The owner as manifests name it: ``sha256("sess-owner:" + owner)`` in hex."""
    return hashlib.sha256(f"sess-owner:{owner}".encode("utf-8", "surrogatepass")).hexdigest()


def write_manifest(
    directory: Path, *, owner: str, session: str, kind: str, name: str, base_model: str
) -> None:
    """Write (atomically) the manifest of the checkpoint whose files are in ``directory``."""
    manifest = {
        "format": FORMAT,
        "owner_sha256": owner_digest(owner),
        "session": session,
        "kind": kind,
        "name": name,
        "base_model": base_model,
        "created": time.time(),
    }
    atomic_write_bytes(directory / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True).encode())


def read_manifest(directory: Path) -> dict | None:
    """The manifest of the checkpoint in ``directory``, or None where it has none or it is unreadable."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    needed = ("owner_sha256", "session", "kind", "name", "base_model")
    if not isinstance(manifest, dict) or any(not isinstance(manifest.get(k), str) for k in needed):
        return None
    return manifest


def checkpoint_dirs(home: Path) -> list[Path]:
    """Every checkpoint directory under ``<home>/checkpoints`` (``<session>/<kind>/<name>``), hidden
    ones (being written or removed) left out."""
    root = home / "checkpoints"
    return sorted(
        d
        for d in root.glob("*/*/*")
        if d.is_dir() and not any(part.startswith(".") for part in d.relative_to(root).parts)
    )


def foreign_files(home: Path, session: str, owner: str) -> bool:
    """Whether ``<home>/checkpoints/<session>`` holds a checkpoint not shown to be ``owner``'s (another
    owner's manifest, or none): files a registry lost track of, which a new session of that name must
    not be handed."""
    mine = owner_digest(owner)
    root = home / "checkpoints" / session
    for directory in root.glob("*/*"):
        if (
            directory.is_dir()
            and not directory.name.startswith(".")
            and not directory.parent.name.startswith(".")
        ):
            manifest = read_manifest(directory)
            if manifest is None or manifest["owner_sha256"] != mine:
                return True
    return False
