"""Tinker routes of checkpoint lifecycles and operations, over :mod:`sess.engine.server.lifecycle`.

``PUT …/checkpoints/{kind}/{name}/ttl`` (``set_checkpoint_ttl_from_tinker_path``), ``POST`` and
``DELETE …/publish`` (``publish``/``unpublish_checkpoint_from_tinker_path``), ``POST /copy_weights``
(a copy in a new training run of the caller's, with its own TTL), ``GET
/sessions/{id}/trace_export`` (``export_session_trace``: ready at once, its URL a signed link to
the Chrome trace JSON of the session's ops), ``GET /audit`` and ``GET
/billing/usage/checkpoints/current`` (``AdminClient``'s audit log and checkpoint storage). A
published checkpoint of another key may be read (sampled, loaded, downloaded) by every key; a
change to it by anyone but its owner is a 403 naming it.
"""

from __future__ import annotations

from datetime import date, datetime, time, timezone

from fastapi import Request
from fastapi.responses import Response

from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.protocol.errors import InvalidRequest
from sess.engine.server.tinker import ids
from sess.engine.server.tinker.state import Tinker, field_of, json_response

# event_type -> the events' prefix; sess has no projects, teams or organizations to audit: none
AUDIT_SCOPES = {
    "all": "",
    "checkpoints": "checkpoint_",
    "projects": "project_",
    "teams": "team_",
    "organizations": "organization_",
}


def _iso(seconds: float | None) -> str | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def audit_entry(entry: dict) -> dict:
    """An audit row as the SDK's AuditLogEntry: who (``owner``) and what in ``event_details``."""
    details = {"owner": entry["owner"], **entry["details"]}
    path = details.get("path")
    tinker_path = None
    if isinstance(path, str):
        try:
            tinker_path = ids.to_tinker_path(path)
        except InvalidRequest:  # a transient sampler save has no tinker:// form
            tinker_path = None
    return {
        "timestamp": _iso(entry["time"]),
        "event": entry["event"],
        "event_details": {**details, "tinker_path": tinker_path} if tinker_path else details,
        "tinker_path": tinker_path,
        "model_id": ids.run_id(parse_path(path).session) if tinker_path else None,
    }


def add_routes(route, tinker: Tinker, sign, verify) -> None:
    lifecycle = tinker.engine.lifecycle

    def in_use() -> set[str]:
        """Checkpoints a sampler of an unfinished Tinker session samples: the TTL sweep keeps them."""
        held = set()
        for sampler in list(tinker.samplers.values()):
            session = tinker.sessions.get(sampler.id.split(":", 1)[0])
            if session is not None and not session.finished and "model_path" in sampler.target:
                held.add(sampler.target["model_path"])
        return held

    tinker.engine.checkpoint_users.append(in_use)

    def path_of(request: Request) -> str:
        params = request.path_params
        return ids.to_sess_path(
            f"tinker://{params['run_id']}/{params['kind']}/{params['name']}", "checkpoint_id"
        )

    async def thread(fn, *args):
        from starlette.concurrency import run_in_threadpool

        return await run_in_threadpool(fn, *args)

    @route("PUT", "/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def set_ttl(request: Request) -> Response:
        owner = tinker.owner(request)
        body = await tinker.json(request)
        if "ttl_seconds" not in body:
            raise InvalidRequest("ttl_seconds: missing; give seconds from now, or null to remove the expiry")
        await thread(lifecycle.set_ttl, owner, path_of(request), body["ttl_seconds"])
        return json_response({})

    async def publish(request: Request, public: bool) -> Response:
        owner = tinker.owner(request)
        await tinker.body(request)
        await thread(lifecycle.publish, owner, path_of(request), public)
        return json_response({})

    @route("POST", "/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def publish_checkpoint(request: Request) -> Response:
        return await publish(request, True)

    @route("DELETE", "/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def unpublish_checkpoint(request: Request) -> Response:
        return await publish(request, False)

    @route("POST", "/copy_weights")
    async def copy_weights(request: Request) -> Response:
        owner = tinker.owner(request)
        body = await tinker.json(request)
        if body.get("weights_access_token") is not None:
            raise InvalidRequest(
                "weights_access_token: access tokens are not used by this engine; publish the source "
                "checkpoint (publish_checkpoint_from_tinker_path) so every key can copy it"
            )
        source = ids.to_sess_path(field_of(body, "source_path", str), "source_path")
        project = field_of(body, "destination_project_id", str, None)
        if body.get("session_id") is not None or body.get("model_seq_id") is not None:
            raise InvalidRequest(
                "session_id, model_seq_id: a copy goes into a new training run here; give "
                "destination_project_id (or neither) instead"
            )
        row = await thread(lifecycle.copy, owner, source, body.get("ttl_seconds"))
        copied = parse_path(row["path"])
        tinker.engine.registry.tag_run(copied.session, owner, project, None)
        return json_response({"tinker_path": ids.to_tinker_path(row["path"])})

    @route("GET", "/sessions/{session_id}/trace_export")
    async def trace_export(request: Request) -> Response:
        owner = tinker.owner(request)
        names = sessions_of(owner, request.path_params["session_id"])
        await thread(lifecycle.trace, owner, names)  # another key's session: a 404 now
        token = sign(owner, "trace:" + request.path_params["session_id"])
        base = str(request.base_url).rstrip("/")
        return json_response({"status": "ready", "url": f"{base}/api/v1/trace_files/{token}"})

    @route("GET", "/trace_files/{token}")
    async def trace_file(request: Request) -> Response:
        owner, what = verify(request.path_params["token"])
        session_id = what.removeprefix("trace:")
        trace = await thread(lifecycle.trace, owner, sessions_of(owner, session_id))
        return json_response(trace)

    def sessions_of(owner: str, session_id: str) -> list[str]:
        """The sess sessions of a Tinker session id (its models), or the one a run id names."""
        if ids.is_session_id(session_id):
            return sorted(tinker.session(owner, session_id).models)
        return [ids.sess_name(session_id, "session_id")]

    @route("GET", "/audit")
    async def audit(request: Request) -> Response:
        owner = tinker.owner(request)
        scope = request.query_params.get("event_type", "all")
        if scope not in AUDIT_SCOPES:
            raise InvalidRequest(f"event_type: expected one of {', '.join(AUDIT_SCOPES)}, got {scope[:40]!r}")
        text = request.query_params.get("day")
        try:
            day = date.fromisoformat(text) if text else datetime.now(timezone.utc).date()
        except ValueError:
            raise InvalidRequest(f"day: expected a date (YYYY-MM-DD), got {text[:40]!r}") from None
        start = datetime.combine(day, time(0), timezone.utc).timestamp()
        entries = await thread(lifecycle.audit, owner, start, start + 86400)
        prefix = AUDIT_SCOPES[scope]
        return json_response({"entries": [audit_entry(e) for e in entries if e["event"].startswith(prefix)]})

    @route("GET", "/billing/usage/checkpoints/current")
    async def checkpoint_storage(request: Request) -> Response:
        owner = tinker.owner(request)
        project = request.query_params.get("project_id")
        rows = await thread(lifecycle.storage, owner)
        if project is not None:
            rows = [r for r in rows if r["project_id"] == project]
        groups: dict[tuple, dict] = {}
        for row in rows:  # the SDK's items: per project and owner, each with its sessions' bytes
            item = groups.setdefault(
                (row["project_id"], row["owner"]),
                {
                    "project_id": row["project_id"],
                    "org_user_urn": row["owner"],
                    "user_name": row["owner"],
                    "checkpoint_count": 0,
                    "size_bytes": 0,
                    "sessions": [],
                },
            )
            item["checkpoint_count"] += row["checkpoints"]
            item["size_bytes"] += row["bytes"]
            item["sessions"].append(
                {
                    "session": row["session"],
                    "training_run_id": ids.run_id(row["session"]),
                    "size_bytes": row["bytes"],
                }
            )
        data = [{**item, "size_gigabytes": item["size_bytes"] / 1e9} for item in groups.values()]
        return json_response({"effective_rate_usd_per_gigabyte_month": None, "data": data})
