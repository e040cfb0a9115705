"""What a checkpoint's life needs from the runtime: who may read it, copies, expiry, bytes on disk.

A checkpoint belongs to the key that owns its session. A *published* one (its ``sess://`` path in
``runtime.published``) is readable by every key on the engine: sampled, loaded into a new session,
downloaded; deleting it, changing its TTL or unpublishing it stays its owner's. Copying a readable
checkpoint gives the copying key a checkpoint of its own, in a new stopped session (its base model
and LoRA the source's), with its own TTL. The registry side (TTLs, the public flag, the audit log)
is the server's (:mod:`sess.engine.server.lifecycle`); these functions run on the executor thread.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from sess.engine.protocol.checkpoint_paths import CheckpointRef, parse_path
from sess.engine.protocol.errors import NotFound, SessError
from sess.engine.protocol.home import atomic_dir
from sess.engine.protocol.types import SessionStatus
from sess.engine.runtime.checkpoints import checkpoint_files as ckpt
from sess.engine.runtime.checkpoints.manifest import write_manifest
from sess.engine.runtime.session import Session

if TYPE_CHECKING:
    from sess.engine.runtime.runtime import Runtime


class NotYours(SessError):
    """A published checkpoint of another key: readable, not writable (403)."""

    def __init__(self, message: str):
        super().__init__(message, status=403)


def readable_session(runtime: Runtime, owner: str, ref: CheckpointRef) -> Session:
    """The session holding checkpoint ``ref``: ``owner``'s own, or any key's when ``ref`` is
    published; NotFound otherwise (another key's private checkpoint looks absent)."""
    session = runtime.find_session(owner, ref.session)
    if session is not None and session.name != ref.session:  # a client's name, not the files' session
        session = None
    if session is None and ref.uri in runtime.published:
        session = runtime.sessions.get(ref.session)
    if session is None:
        raise NotFound(f"checkpoint {ref.uri} not found")
    return session


def owned_dir(runtime: Runtime, owner: str, path: str, field: str = "path") -> Path:
    """The directory of checkpoint ``path`` for a change only its owner may make: NotFound for
    another key's private one, 403 for another key's published one (which every key can see)."""
    ref = parse_path(path, field=field)
    session = runtime.find_session(owner, ref.session)
    if session is None or session.name != ref.session:  # paths name files by the engine's session id
        if ref.uri in runtime.published and ref.session in runtime.sessions:
            raise NotYours(f"{field}: {ref.uri} is published by another key; only its owner can change it")
        raise NotFound(f"{field}: checkpoint {ref.uri} not found")
    directory = ref.directory(runtime.home)
    if not directory.exists():
        raise NotFound(f"{field}: checkpoint {ref.uri} not found")
    return directory


def copy_checkpoint(runtime: Runtime, owner: str, path: str) -> dict:
    """Copy a checkpoint ``owner`` can read into a new stopped session of ``owner``'s (named
    ``copy-<hex>``): the copy keeps the source's kind and name. Returns its path and session."""
    ref = parse_path(path, field="source_path")
    source = readable_session(runtime, owner, ref)
    directory = ref.directory(runtime.home)
    if not directory.exists():
        raise NotFound(f"source_path: checkpoint {ref.uri} not found")
    name = f"copy-{secrets.token_hex(6)}"
    session = Session(name, owner, source.base_model, dict(source.lora), status=SessionStatus.Stopped)
    target = CheckpointRef(name, ref.kind, ref.name)
    with atomic_dir(target.directory(runtime.home)) as tmp:
        shutil.copytree(directory, tmp, dirs_exist_ok=True)
        write_manifest(
            tmp, owner=owner, session=name, kind=ref.kind, name=ref.name, base_model=source.base_model
        )
    runtime.sessions[name] = session
    return {"path": target.uri, "session": session.summary()}


def remove_expired(runtime: Runtime, path: str, in_use: set[str]) -> bool:
    """Delete an expired checkpoint's files unless something samples from it (``in_use``, or a
    running request); whether it was deleted (a checkpoint already gone counts as deleted)."""
    ref = parse_path(path)
    if ref.uri in in_use:
        return False
    session = runtime.sessions.get(ref.session)
    host = runtime.hosts.get(session.base_model) if session is not None else None
    if host is not None and host.release_checkpoints([ref.uri]):
        return False  # a running request samples from it: the next sweep tries again
    ckpt.remove(ref, runtime.home)
    runtime.published.discard(ref.uri)
    return True


def storage(runtime: Runtime, owner: str | None) -> list[dict]:
    """Checkpoint bytes per session (of ``owner``, or of every key): one row per session with any."""
    rows = []
    for session in sorted(runtime.sessions.values(), key=lambda s: s.created):
        if owner is not None and session.owner != owner:
            continue
        refs = ckpt.saved(session.name, runtime.home)
        if not refs:
            continue
        size = sum(
            f.stat().st_size for ref in refs for f in ref.directory(runtime.home).rglob("*") if f.is_file()
        )
        rows.append(
            {"owner": session.owner, "session": session.name, "checkpoints": len(refs), "bytes": size}
        )
    return rows


def checkpoint_info(runtime: Runtime, owner: str, request) -> dict:
    """What a reader of checkpoint ``request.path`` may know of it (own or published): its
    session's name, base model and LoRA settings."""
    ref = parse_path(request.path)
    session = readable_session(runtime, owner, ref)
    if not ref.directory(runtime.home).exists():
        raise NotFound(f"checkpoint {ref.uri} not found")
    return {"name": session.name, "base_model": session.base_model, "lora": dict(session.lora)}
