"""The ServiceClient's checkpoint lifecycle and operations methods: TTLs, publishing, copies,
session traces, storage and the audit log.

They are kept by the engine server's registry, so they need an engine server (the local engine of
``SESS_HOME``, or a remote one); the in-process engine (``ServiceClient("inproc")``) keeps no
registry and refuses them, naming what was asked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.requests import MAX_TTL_S, MIN_TTL_S
from sess.engine.sdk.http_transport import HttpTransport


def check_ttl(ttl_seconds: Any, field: str = "ttl_seconds") -> None:
    if ttl_seconds is None:
        return
    if not isinstance(ttl_seconds, int) or isinstance(ttl_seconds, bool):
        raise InvalidRequest(f"{field}: expected an int of seconds or None, got {type(ttl_seconds).__name__}")
    if not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise InvalidRequest(
            f"{field}: {ttl_seconds} is out of range; expected {MIN_TTL_S} to {MAX_TTL_S} seconds (10 years)"
        )


def needs_server(transport: Any, what: str) -> HttpTransport:
    """The HTTP transport, or a refusal naming ``what`` for the in-process engine."""
    if not isinstance(transport, HttpTransport):
        raise InvalidRequest(
            f"{what}: the in-process engine keeps no registry; use an engine server "
            "(ServiceClient() starts the local one)"
        )
    return transport


class CheckpointAdmin:
    """Mixed into :class:`~sess.engine.sdk.service_client.ServiceClient` (``self.transport``)."""

    transport: Any

    def _registry(self, what: str, method: str, route: str, body: dict | None = None, **params) -> Any:
        http = needs_server(self.transport, what)
        query = {k: v for k, v in params.items() if v is not None}
        return http.request(method, route, body, idempotent=True, params=query).json()

    def set_checkpoint_ttl(self, path: str, ttl_seconds: int | None) -> dict:
        """Expire checkpoint ``path`` ``ttl_seconds`` from now (None: keep it until deleted).

        The engine deletes an expired checkpoint, files and all, at its next sweep, unless something
        still samples from it (then at the first sweep after).

        Args:
            path: one of your ``sess://`` checkpoints.
            ttl_seconds: 1 s to 10 years, or None to clear the expiry.

        Returns:
            The checkpoint's record: ``path``, ``expires_at`` (Unix time or None), ``user_metadata``, ``public``."""
        parse_path(path)
        check_ttl(ttl_seconds)
        body = {"path": path, "ttl_seconds": ttl_seconds}
        return self._registry("ttl_seconds", "POST", "/api/checkpoints/ttl", body)

    def publish_checkpoint(self, path: str) -> dict:
        """Let every key on the engine read ``path`` (sample, load, download); changing or deleting
        it stays yours.

        Args:
            path: one of your ``sess://`` checkpoints.

        Returns:
            The checkpoint's record, ``public`` True."""
        parse_path(path)
        return self._registry("publish", "POST", "/api/checkpoints/publish", {"path": path, "public": True})

    def unpublish_checkpoint(self, path: str) -> dict:
        """Make a published checkpoint yours alone again.

        Args:
            path: one of your ``sess://`` checkpoints.

        Returns:
            The checkpoint's record, ``public`` False."""
        parse_path(path)
        return self._registry("publish", "POST", "/api/checkpoints/publish", {"path": path, "public": False})

    def copy_checkpoint(self, path: str, *, ttl_seconds: int | None = None) -> str:
        """Copy a checkpoint you can read (yours, or a published one) into a new stopped session of
        yours; the copy has its own TTL and is yours to change.

        Args:
            path: a ``sess://`` checkpoint.
            ttl_seconds: the copy's TTL (1 s to 10 years), or None to keep it until deleted.

        Returns:
            The copy's ``sess://`` path."""
        parse_path(path)
        check_ttl(ttl_seconds)
        body = {"path": path, "ttl_seconds": ttl_seconds}
        return self._registry("copy_checkpoint", "POST", "/api/checkpoints/copy", body)["path"]

    def export_trace(self, session: str, path: str | os.PathLike | None = None) -> dict:
        """A session's ops as a Chrome trace (what https://ui.perfetto.dev opens): one slice per op,
        from its submit to its end, with ``queue_wait_s``, ``run_s`` and its token counts.

        Args:
            session: one of your sessions.
            path: also write the trace there as JSON.

        Returns:
            The trace (``{"traceEvents": [...]}``)."""
        trace = self._registry("session", "GET", "/api/trace", session=session)
        if path is not None:
            Path(path).write_text(json.dumps(trace))
        return trace

    def storage_usage(self) -> list[dict]:
        """Checkpoint bytes per session: ``owner``, ``session``, ``checkpoints``, ``bytes``,
        ``project_id`` (every key's for the engine's own key, otherwise yours)."""
        return self._registry("storage", "GET", "/api/storage")["sessions"]

    def audit_log(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """The audit log (every key's for the engine's own key, otherwise yours): ``time``,
        ``owner`` (who), ``event`` (``session_created``, ``checkpoint_published``, ``key_revoked``,
        ...) and its ``details``, oldest first, between Unix times ``start`` and ``end``."""
        return self._registry("audit", "GET", "/api/audit", start=start, end=end)["entries"]
