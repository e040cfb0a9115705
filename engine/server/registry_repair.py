"""``sess engine repair``: rebuild a lost registry's sessions and checkpoints from the manifests.

Each checkpoint directory carries its manifest (:mod:`sess.engine.runtime.checkpoints.manifest`):
its owner's digest, session, kind, name and base model. Repair moves an unreadable or empty
``registry.db`` aside (``registry.db.broken-<time>``, with its ``-wal``/``-shm``), opens a fresh
one, and registers every checkpoint whose owner digest matches an owner of the home's keys, under
that owner, each session ``Stopped`` (resumable from its state checkpoints). What it cannot rebuild
it says: checkpoints of owners no key has (kept on disk, unregistered, so no key can read them),
directories without a manifest, and usage and spend, which no manifest records (the backup the
engine takes at each start, ``registry.db.bak``, has them). A session or checkpoint the registry
still has is left as it is. A home whose checkpoints predate manifests gets them at each engine
start from the registry (:func:`label_unlabelled`), while the registry still knows their owners.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

from sess.engine.protocol.checkpoint_paths import CheckpointRef
from sess.engine.protocol.home import sess_home
from sess.engine.runtime.checkpoints.manifest import (
    checkpoint_dirs,
    owner_digest,
    read_manifest,
    write_manifest,
)
from sess.engine.server import registry_guard
from sess.engine.server.keys import LOCAL_OWNER, KeyStore
from sess.engine.server.sqlite_registry import Registry


def repair(home: str | os.PathLike | None = None) -> list[str]:
    """Rebuild ``home``'s registry from its checkpoints' manifests; returns what was done, one line each.
    The engine of the home must not be running."""
    home = sess_home(home)
    lines = []
    aside = _move_aside(home)
    if aside is not None:
        lines.append(f"moved the {aside[1]} registry aside to {aside[0]}")
    owners = {owner_digest(entry["owner"]): entry["owner"] for entry in KeyStore(home).load().values()}
    owners.setdefault(owner_digest(LOCAL_OWNER), LOCAL_OWNER)
    found: dict[tuple[str, str], list[tuple[Path, dict]]] = defaultdict(list)
    unowned, unlabelled = [], []
    for directory in checkpoint_dirs(home):
        manifest = read_manifest(directory)
        where = directory.relative_to(home / "checkpoints").parts  # (session, kind, name)
        if manifest is None or (manifest["session"], manifest["kind"], manifest["name"]) != where:
            unlabelled.append(directory)
        elif manifest["owner_sha256"] not in owners:
            unowned.append(directory)
        else:
            found[(owners[manifest["owner_sha256"]], where[0])].append((directory, manifest))
    registry = Registry(home)
    try:
        restored, registered, clashes = _register(registry, found)
        registry.add_audit(None, "registry_repair", sessions=restored, checkpoints=registered)
    finally:
        registry.close()
    lines.append(f"restored {restored} sessions and {registered} checkpoints from their manifests")
    for owner, session in clashes:
        lines.append(
            f"session {session!r}: the registry has it under another owner; {owner}'s files left unregistered"
        )
    if unowned:
        lines.append(
            f"{len(unowned)} checkpoint directories belong to owners no key of this home has: kept on "
            "disk, not registered (add a key for the owner with `sess engine keys add --owner` and repair again)"
        )
    if unlabelled:
        lines.append(
            f"{len(unlabelled)} checkpoint directories have no manifest (e.g. {unlabelled[0]}): kept "
            "on disk, not registered"
        )
    backup_path = home / registry_guard.BACKUP_FILE
    lines.append(
        "usage and spend were not rebuilt (no manifest records them)"
        + (f"; the backup {backup_path} has them" if backup_path.is_file() else "")
    )
    return lines


def _move_aside(home: Path) -> tuple[Path, str] | None:
    """Rename a registry that is there but unusable (with its WAL files); (new path, what was wrong)."""
    path = home / registry_guard.REGISTRY_FILE
    wrong = registry_guard.state(home)
    if wrong is None or not path.exists() or wrong == "empty (no sessions)":
        return None
    aside = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.replace(f"{path}{suffix}", f"{aside}{suffix}")
    return aside, wrong


def _register(registry: Registry, found: dict) -> tuple[int, int, list[tuple[str, str]]]:
    """Register the found checkpoints (and their sessions, where the registry lacks them)."""
    sessions = {row["name"]: row for row in registry.sessions()}
    known = {row["path"] for row in registry.checkpoint_rows()}
    restored = registered = 0
    clashes = []
    for (owner, session), items in sorted(found.items()):
        row = sessions.get(session)
        if row is not None and row["owner"] != owner:
            clashes.append((owner, session))
            continue
        items.sort(key=lambda item: item[1].get("created") or 0)
        if row is None:
            registry.save_session(_summary(session, items), owner)
            restored += 1
        for directory, manifest in items:
            ref = CheckpointRef(session, manifest["kind"], manifest["name"])
            if ref.uri in known:
                continue
            registry.add_checkpoint(ref.uri, session, owner, ref.kind)
            registry.update_checkpoint(ref.uri, created=manifest.get("created") or directory.stat().st_mtime)
            registered += 1
    return restored, registered, clashes


def _summary(session: str, items: list[tuple[Path, dict]]) -> dict:
    """A stopped session's row from its checkpoints: base model, LoRA and step of its newest state."""
    created = [manifest.get("created") or directory.stat().st_mtime for directory, manifest in items]
    lora, step = {}, 0
    for directory, manifest in items:
        if manifest["kind"] == "state" and (directory / "state.json").is_file():
            meta = json.loads((directory / "state.json").read_text())
            lora, step = meta.get("lora") or {}, int(meta.get("step") or 0)
    if not lora:  # no state checkpoint: the rank and alpha of an adapter's config
        config_path = (
            items[-1][0] / ("adapter" if items[-1][1]["kind"] == "merged" else "") / "adapter_config.json"
        )
        if config_path.is_file():
            config = json.loads(config_path.read_text())
            lora = {"rank": config.get("r"), "alpha": config.get("lora_alpha")}
    return {
        "name": session,
        "base_model": items[-1][1]["base_model"],
        "status": "Stopped",
        "created": min(created),
        "last_active": max(created),
        "step": step,
        "lora": lora,
        "user_metadata": None,
        "usage": {},
    }


def label_unlabelled(registry: Registry, home: Path) -> int:
    """Write a manifest into each checkpoint directory of a registered session that has none (a
    checkpoint from before manifests), from the session's registry row; how many were written."""
    sessions = {row["name"]: row for row in registry.sessions()}
    written = 0
    for directory in checkpoint_dirs(home):
        session, kind, name = directory.relative_to(home / "checkpoints").parts
        row = sessions.get(session)
        if row is None or read_manifest(directory) is not None:
            continue
        write_manifest(
            directory, owner=row["owner"], session=session, kind=kind, name=name, base_model=row["base_model"]
        )
        written += 1
    return written
