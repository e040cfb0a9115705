"""Checkpoint lifecycles and operations records over the registry: TTLs and their sweep, publishing,
copies, checkpoint metadata, storage per key and session, session traces and the audit log.

A checkpoint may carry a TTL (``ttl_seconds``, :data:`MIN_TTL_S` to :data:`MAX_TTL_S`): its
``expires_at`` is kept in the registry, listed with it, set or cleared later, and a periodic sweep
(every :data:`SWEEP_S` seconds, on the executor thread) deletes expired checkpoints, files and
registry rows, except those something still samples from: a running request, or a sampler a
front end holds (:attr:`ManagedEngine.checkpoint_users`); those go at the first sweep after their
release. Publishing makes a checkpoint readable by every key (:mod:`sess.engine.runtime.checkpoints.checkpoint_lifecycle`);
the published set is restored from the registry when the engine starts. Every change here, and
every session created, resumed or deleted, is an audit entry (``<resource>_<action>``).
A session's trace is Chrome trace JSON (what Perfetto and chrome://tracing open): one complete
slice per op, from its submit to its end, with its queue wait, run time and tokens as arguments.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.protocol.errors import InvalidRequest, NotFound
from sess.engine.protocol.requests import MAX_TTL_S, MIN_TTL_S, check_checkpoint_metadata
from sess.engine.runtime import session_names
from sess.engine.runtime.checkpoints import checkpoint_lifecycle as lc
from sess.engine.server.keys import LOCAL_OWNER

if TYPE_CHECKING:
    from sess.engine.server.managed_engine import ManagedEngine

log = logging.getLogger("sess.engine")
# ttl_seconds bounds (sdk/requests.py): 1 s to ten years. Tinker's service takes 1 hour at least;
# an engine of one's own may expire checkpoints sooner.
SWEEP_S = float(os.environ.get("SESS_CHECKPOINT_SWEEP_S", "60"))


def check_ttl(value: Any, field: str = "ttl_seconds") -> int | None:
    """A TTL in seconds, or None for none; anything else is a 400 naming ``field``."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(
            f"{field}: expected an integer number of seconds or null, got {type(value).__name__}"
        )
    if not MIN_TTL_S <= value <= MAX_TTL_S:
        raise InvalidRequest(
            f"{field}: {value} is out of range; expected {MIN_TTL_S} to {MAX_TTL_S} seconds (10 years), "
            "or null for no expiry"
        )
    return value


def check_metadata(value: Any, field: str = "user_metadata") -> dict[str, str] | None:
    """String keys to string values (at most MAX_METADATA, 1 KiB each), or None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field}: expected an object of strings, got {type(value).__name__}")
    check_checkpoint_metadata(value)
    return dict(value)


class Lifecycle:
    def __init__(self, engine: ManagedEngine):
        self.engine, self.registry = engine, engine.registry
        engine.runtime.published.update(r["path"] for r in self.registry.checkpoint_rows(public=True))

    def _run(self, fn, owner: str = ""):
        return self.engine.run(fn, owner=owner)

    def _row(self, owner: str, path: str) -> dict:
        """The registry row of ``owner``'s checkpoint ``path`` (made if the registry lacks one)."""
        ref = parse_path(path)
        row = self.registry.checkpoint(ref.uri)
        if row is None:
            self.registry.add_checkpoint(ref.uri, ref.session, owner, ref.kind)
            row = self.registry.checkpoint(ref.uri)
        return row

    # changes only the owner makes --------------------------------------------------------------
    def set_ttl(self, owner: str, path: str, ttl_seconds: Any) -> dict:
        """Expire ``path`` ``ttl_seconds`` from now, or never (None). Returns its row."""
        ttl = check_ttl(ttl_seconds)
        path = session_names.engine_path(self.engine.runtime, owner, path)
        self._run(lambda runtime: lc.owned_dir(runtime, owner, path), owner)
        ref = parse_path(path)
        self._row(owner, ref.uri)
        expires_at = None if ttl is None else time.time() + ttl
        self.registry.update_checkpoint(ref.uri, expires_at=expires_at)
        self.registry.add_audit(owner, "checkpoint_ttl_set", path=ref.uri, ttl_seconds=ttl)
        return session_names.client_view(owner, self.registry.checkpoint(ref.uri))

    def publish(self, owner: str, path: str, public: bool) -> dict:
        """Make ``path`` readable by every key (``public``) or its owner's alone again."""
        path = session_names.engine_path(self.engine.runtime, owner, path)

        def change(runtime) -> None:
            lc.owned_dir(runtime, owner, path)
            (runtime.published.add if public else runtime.published.discard)(parse_path(path).uri)

        self._run(change, owner)
        ref = parse_path(path)
        self._row(owner, ref.uri)
        self.registry.update_checkpoint(ref.uri, public=int(public))
        self.registry.add_audit(
            owner, "checkpoint_published" if public else "checkpoint_unpublished", path=ref.uri
        )
        return session_names.client_view(owner, self.registry.checkpoint(ref.uri))

    def copy(self, owner: str, path: str, ttl_seconds: Any = None) -> dict:
        """A copy of a checkpoint ``owner`` can read, in a new stopped session of ``owner``'s."""
        ttl = check_ttl(ttl_seconds)
        path = session_names.engine_path(self.engine.runtime, owner, path)
        copied = self._run(lambda runtime: lc.copy_checkpoint(runtime, owner, path), owner)
        summary, ref = copied["session"], parse_path(copied["path"])
        self.registry.save_session(summary, owner)
        expires_at = None if ttl is None else time.time() + ttl
        source = self.registry.checkpoint(parse_path(path).uri) or {}
        self.registry.add_checkpoint(
            ref.uri,
            ref.session,
            owner,
            ref.kind,
            expires_at=expires_at,
            user_metadata=source.get("user_metadata"),
        )
        self.registry.add_audit(owner, "checkpoint_copied", path=ref.uri, source=parse_path(path).uri)
        return session_names.client_view(owner, self.registry.checkpoint(ref.uri))

    # what the engine records on its own --------------------------------------------------------
    def saved(self, op) -> None:
        """A save op's TTL and metadata, into its new checkpoint's row (the row was just added)."""
        request, path = op.request, op.result["path"]
        ttl, metadata = getattr(request, "ttl_seconds", None), getattr(request, "user_metadata", None)
        if ttl is not None or metadata is not None:
            expires_at = None if ttl is None else time.time() + ttl
            self.registry.update_checkpoint(path, expires_at=expires_at, user_metadata=metadata)

    def describe(self, owner: str, found: list[dict]) -> list[dict]:
        """A list_checkpoints answer with each checkpoint's ``expires_at``, ``user_metadata`` and
        ``public`` from the registry."""
        described = []
        for entry in found:
            row = self.registry.checkpoint(entry["path"]) or {}
            described.append(
                {
                    **entry,
                    "expires_at": row.get("expires_at"),
                    "user_metadata": row.get("user_metadata"),
                    "public": bool(row.get("public")),
                }
            )
        return described

    def sweep(self) -> list[str]:
        """Delete expired checkpoints nothing samples from; the paths deleted."""
        expired = self.registry.checkpoint_rows(expired_before=time.time())
        if not expired:
            return []
        in_use: set[str] = set()
        for users in self.engine.checkpoint_users:
            try:
                in_use |= users()
            except Exception:  # a front end's hook failing must not stop the sweep
                log.exception("asking which checkpoints are in use failed")

        def remove(runtime) -> list[str]:
            removed = []
            for row in expired:
                try:
                    if lc.remove_expired(runtime, row["path"], in_use):
                        removed.append(row["path"])
                except Exception:  # one checkpoint failing must not keep the others forever
                    log.exception("deleting expired checkpoint %s failed", row["path"])
            return removed

        removed = self._run(remove)
        for path in removed:
            row = next(r for r in expired if r["path"] == path)
            self.registry.remove_checkpoint(path)
            self.registry.add_audit(
                row["owner"], "checkpoint_expired", path=path, expires_at=row["expires_at"]
            )
        return removed

    # reports -----------------------------------------------------------------------------------
    def sees_all(self, owner: str) -> bool:
        """The engine's own key (owner ``local``, the operator's) sees every key's storage and audit."""
        return owner == LOCAL_OWNER

    def storage(self, owner: str) -> list[dict]:
        """Checkpoint bytes per key and session (the caller's, or every key's for the operator)."""
        scope = None if self.sees_all(owner) else owner
        rows = self._run(lambda runtime: lc.storage(runtime, scope), owner)
        tags = {}
        for row in rows:
            if row["owner"] not in tags:
                tags[row["owner"]] = self.registry.run_tags(row["owner"])
            row["project_id"] = tags[row["owner"]].get(row["session"], {}).get("project_id")
        return rows if self.sees_all(owner) else session_names.client_view(owner, rows)

    def audit(self, owner: str, start: float = 0.0, end: float = float("inf")) -> list[dict]:
        if self.sees_all(owner):
            return self.registry.audit(start, end, None)
        return session_names.client_view(owner, self.registry.audit(start, end, owner))

    def trace(self, owner: str, sessions: list[str]) -> dict:
        """Chrome trace JSON of ``owner``'s ``sessions``' ops: one ``X`` slice per op (submit to
        end), one track per session."""
        events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "sess engine"}}]
        for tid, name in enumerate(sessions, start=1):
            session = self.engine.runtime.find_session(owner, name)
            if session is None:
                raise NotFound(f"session: {name!r} not found")
            events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}})
            for op in self.registry.operations(session.name):
                run_s, queue_s = float(op["wall_time_s"] or 0.0), float(op.get("queue_s") or 0.0)
                start = float(op["finished"]) - run_s - queue_s
                events.append(
                    {
                        "name": op["name"],
                        "cat": "op" if op["ok"] else "op,failed",
                        "ph": "X",
                        "ts": round(start * 1e6, 1),
                        "dur": round((queue_s + run_s) * 1e6, 1),
                        "pid": 1,
                        "tid": tid,
                        "args": {
                            "op_id": op["id"],
                            "queue_wait_s": queue_s,
                            "run_s": run_s,
                            "prefill_tokens": op["prefill_tokens"] or 0,
                            "sampled_tokens": op["sampled_tokens"] or 0,
                            "training_tokens": op["training_tokens"] or 0,
                            "error": op["error"],
                        },
                    }
                )
        return {"traceEvents": events, "displayTimeUnit": "ms"}
