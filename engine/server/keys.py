"""API keys of an engine: ``keys.json`` in the engine home (0600) holds salted hashes, never keys.

A key is ``tml-<id>-<secret>``: the ``tml-`` prefix the tinker SDK requires of a key, so one key
works for both SDKs; ``<id>`` names it in ``sess engine keys list|revoke``; the secret is 32
random bytes. The file keeps, per key, its id, owner, a random salt and ``sha256(salt + key)``,
so a leaked file lets no one in. The runtime scopes every session and checkpoint by owner: a key
sees only what its owner made. The local engine creates one key for the user of the home (owner
``local``) and writes it to ``api_key`` (0600, the key itself), which the SDK reads when no key is
given. A running engine rereads ``keys.json`` whenever it changes, so a revoked key is refused at
its next request and a changed budget holds from the next submit. A key may carry a ``budget``
(an amount in the engine's price-table currency, kept as a decimal string) or a ``token_budget``
(tokens, for an engine without prices), checked by :mod:`.billing`. Every key added, revoked or
given a budget is an entry in the registry's audit log. Every change is a read-modify-write under an
exclusive ``fcntl`` lock on ``keys.json.lock`` (across processes: concurrent ``sess engine keys add``
keep every key), written to a temp file, fsynced and renamed into place. A file from before hashing (plaintext ``key`` fields) is rewritten with hashes
the first time it is read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from sess.engine.protocol.home import LOCAL_KEY_FILE, atomic_write_bytes, sess_home
from sess.engine.protocol.prices import parse_amount

KEYS_FILE = "keys.json"
LOCK_FILE = "keys.json.lock"  # held while keys.json is read, changed and written back
LOCAL_OWNER = "local"
PREFIX = "tml-"  # what the tinker SDK requires of a key (tinker/lib/_auth_token_provider.py)


def _write_private(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data)
    os.chmod(path, 0o600)


def _digest(salt: str, key: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + key.encode("utf-8", "surrogatepass")).hexdigest()


def _hashed(key: str, **fields) -> dict:
    salt = secrets.token_hex(16)
    return {**fields, "salt": salt, "sha256": _digest(salt, key)}


def _key_id(key: str) -> str | None:
    """The id a ``tml-<id>-<secret>`` key carries (older keys carry none)."""
    if key.startswith(PREFIX) and len(key) > 13 and key[12] == "-":
        return key[4:12]
    return None


def budget_fields(budget, token_budget) -> dict:
    """``budget``/``token_budget`` as a key stores them; ValueError naming the bad one."""
    fields = {"budget": None, "token_budget": None}
    if budget is not None:
        fields["budget"] = str(parse_amount(budget, "budget"))
    if token_budget is not None:
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 0:
            raise ValueError(
                f"token_budget: expected a whole number of tokens, 0 or more, got {token_budget!r}"
            )
        fields["token_budget"] = token_budget
    return fields


def new_key() -> tuple[str, str]:
    """(id, key) of a new key."""
    key_id = secrets.token_hex(4)
    return key_id, f"{PREFIX}{key_id}-{secrets.token_urlsafe(32)}"


class KeyStore:
    """Keys of one home; :meth:`entry` maps a presented key to its entry (owner, ...) or None."""

    def __init__(self, home: str | os.PathLike | None = None):
        self.home = sess_home(home)
        self.path = self.home / KEYS_FILE
        self._version: tuple | None = None
        self._keys: dict[str, dict] = {}
        self._thread_lock = threading.RLock()
        self._held = False

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the home's key lock (reentrant within this store) and reread keys.json under it."""
        with self._thread_lock:
            if self._held:
                yield
                return
            self.home.mkdir(parents=True, exist_ok=True)
            with open(self.home / LOCK_FILE, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                self._held, self._version = True, None  # another process may have written
                try:
                    yield
                finally:
                    self._held = False

    def load(self) -> dict[str, dict]:
        """id -> entry (``id``, ``owner``, ``created``, ``max_sessions``, ``salt``, ``sha256``)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._keys, self._version = {}, None
            return self._keys
        version = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if version != self._version:
            entries = json.loads(self.path.read_text()).get("keys", [])
            if any("key" in e for e in entries):
                with self._locked():
                    return self._migrate()
            self._keys, self._version = {e["id"]: e for e in entries}, version
        return self._keys

    def _migrate(self) -> dict[str, dict]:
        """Replace plaintext keys (a file from before hashing) with salted hashes, in place on disk."""
        stat = self.path.stat()
        entries = json.loads(self.path.read_text()).get("keys", [])
        migrated = []
        for entry in entries:
            if "key" in entry:
                key = entry.pop("key")
                entry = _hashed(key, id=_key_id(key) or secrets.token_hex(4), **entry)
            migrated.append(entry)
        if migrated != entries:
            self._save(migrated)
            stat = self.path.stat()
        self._keys = {e["id"]: e for e in migrated}
        self._version = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        return self._keys

    def _save(self, entries) -> None:
        _write_private(self.path, json.dumps({"version": 2, "keys": list(entries)}, indent=1).encode())
        self._version = None

    def add(
        self,
        owner: str | None = None,
        *,
        max_sessions: int | None = None,
        local: bool = False,
        budget=None,
        token_budget: int | None = None,
    ) -> dict:
        """Create a key; the returned entry carries the key itself under ``key`` (shown once)."""
        if max_sessions is not None and max_sessions < 1:
            raise ValueError(
                f"max_sessions: expected at least 1 live session for the key, got {max_sessions}"
            )
        budgets = budget_fields(budget, token_budget)
        key_id, key = new_key()
        entry = _hashed(
            key,
            id=key_id,
            owner=owner or f"user-{secrets.token_hex(4)}",
            created=time.time(),
            max_sessions=max_sessions,
            local=local,
            **budgets,
        )
        with self._locked():
            keys = dict(self.load())
            keys[key_id] = entry
            self._save(keys.values())
        self._audit("key_created", entry)
        return {**entry, "key": key}

    def find(self, key_or_id: str) -> dict | None:
        """The entry of a key named by its id or by the key itself, or None."""
        return self.load().get(key_or_id) or self.entry(key_or_id)

    def set_budget(self, key_or_id: str, budget=None, token_budget: int | None = None) -> dict | None:
        """Give a key a new budget (both None: none); the updated entry, or None if no such key."""
        fields = budget_fields(budget, token_budget)
        with self._locked():
            entry = self.find(key_or_id)
            if entry is None:
                return None
            keys = dict(self.load())
            keys[entry["id"]] = {**entry, **fields}
            self._save(keys.values())
        self._audit("key_budget_set", keys[entry["id"]])
        return keys[entry["id"]]

    def revoke(self, key_or_id: str) -> dict | None:
        """Remove a key, named by its id or by the key itself; the removed entry, or None."""
        with self._locked():
            keys = dict(self.load())
            entry = self.find(key_or_id)
            if entry is None:
                return None
            del keys[entry["id"]]
            self._save(keys.values())
        self._audit("key_revoked", entry)
        return entry

    def _audit(self, event: str, entry: dict) -> None:
        """A key change in the registry's audit log (made by the home's operator, owner ``local``)."""
        from sess.engine.server.sqlite_registry import Registry

        registry = Registry(self.home)
        try:
            fields = ("id", "owner", "budget", "token_budget", "max_sessions")
            registry.add_audit(LOCAL_OWNER, event, **{k: entry.get(k) for k in fields})
        finally:
            registry.close()

    def entry(self, key: str | None) -> dict | None:
        if not key or not isinstance(key, str) or len(key) > 512:
            return None
        keys = self.load()
        key_id = _key_id(key)
        candidates = [keys[key_id]] if key_id in keys else [] if key_id else list(keys.values())
        for entry in candidates:
            if hmac.compare_digest(_digest(entry["salt"], key), entry["sha256"]):
                return entry
        return None

    def ensure_local_key(self) -> str:
        """The home's own key (owner ``local``), created with its 0600 ``api_key`` file if missing;
        a local key from before ``tml-`` keys is replaced, so the local key works for both SDKs."""
        local_file = self.home / LOCAL_KEY_FILE
        if local_file.exists():
            key = local_file.read_text().strip()
            if key.startswith(PREFIX) and self.entry(key) is not None:
                return key
            if self.entry(key) is not None:
                self.revoke(key)
        key = self.add(LOCAL_OWNER, local=True)["key"]
        _write_private(local_file, key.encode())
        return key
