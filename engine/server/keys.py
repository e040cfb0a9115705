"""API keys of an engine: ``keys.json`` in the engine home (0600), each key mapped to an owner id.

The runtime scopes every session and checkpoint by owner, so a key sees only what its owner made.
The local engine creates one key for the user of the home (owner ``local``) and writes it to
``api_key`` (0600), which the SDK reads when no key is given. ``sess engine keys add`` adds more;
a running engine rereads the file when it changes.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import time
from pathlib import Path

from sess.engine.sdk.home import LOCAL_KEY_FILE, atomic_write_bytes, sess_home

KEYS_FILE = "keys.json"
LOCAL_OWNER = "local"


def _write_private(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data)
    os.chmod(path, 0o600)


def new_key() -> str:
    return "sess-" + secrets.token_urlsafe(24)


class KeyStore:
    """Keys of one home; :meth:`owner` maps a presented key to its owner id (or None)."""

    def __init__(self, home: str | os.PathLike | None = None):
        self.home = sess_home(home)
        self.path = self.home / KEYS_FILE
        self._mtime: float | None = None
        self._keys: dict[str, dict] = {}

    def load(self) -> dict[str, dict]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            self._keys, self._mtime = {}, None
            return self._keys
        if mtime != self._mtime:
            entries = json.loads(self.path.read_text()).get("keys", [])
            self._keys, self._mtime = {e["key"]: e for e in entries}, mtime
        return self._keys

    def _save(self, keys: dict[str, dict]) -> None:
        _write_private(self.path, json.dumps({"keys": list(keys.values())}, indent=1).encode())
        self._mtime = None

    def add(
        self, owner: str | None = None, *, max_sessions: int | None = None, key: str | None = None
    ) -> dict:
        keys = dict(self.load())
        entry = {
            "key": key or new_key(),
            "owner": owner or f"user-{secrets.token_hex(4)}",
            "created": time.time(),
            "max_sessions": max_sessions,
        }
        keys[entry["key"]] = entry
        self._save(keys)
        return entry

    def entry(self, key: str | None) -> dict | None:
        if not key:
            return None
        for known, entry in self.load().items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return entry
        return None

    def ensure_local_key(self) -> str:
        """The home's own key (owner ``local``), created with its 0600 ``api_key`` file if missing."""
        local_file = self.home / LOCAL_KEY_FILE
        if local_file.exists():
            key = local_file.read_text().strip()
            if self.entry(key) is not None:
                return key
        key = self.add(LOCAL_OWNER, key=new_key())["key"]
        _write_private(local_file, key.encode())
        return key
