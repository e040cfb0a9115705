"""The sess routes of checkpoint lifecycles and operations (:mod:`.lifecycle`).

``POST /api/checkpoints/ttl`` ``{path, ttl_seconds}`` (null clears it), ``POST
/api/checkpoints/publish`` ``{path, public}``, ``POST /api/checkpoints/copy`` ``{path,
ttl_seconds}``: each answers the checkpoint's row (``path``, ``expires_at``, ``user_metadata``,
``public``, ...). ``GET /api/trace?session=NAME`` answers the session's Chrome trace JSON, ``GET
/api/storage`` checkpoint bytes per key and session, ``GET /api/audit?start=&end=`` the audit log.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from sess.engine.protocol.errors import InvalidRequest
from sess.engine.server.lifecycle import Lifecycle


def _field(body: dict, name: str, kinds: tuple, *, required: bool = True):
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise InvalidRequest(f"{name}: expected {expected}, got {type(value).__name__}")
    return value


def _seconds(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise InvalidRequest(f"{name}: expected a Unix time in seconds, got {raw[:40]!r}") from None


def add_lifecycle_routes(app: FastAPI, lifecycle: Lifecycle, owner_of, read_json, json_response, max_body):
    async def body_of(request: Request) -> dict:
        return await read_json(request, max_body)

    @app.post("/api/checkpoints/ttl")
    async def set_ttl(request: Request):
        owner = owner_of(request)
        body = await body_of(request)
        path = _field(body, "path", (str,))
        if "ttl_seconds" not in body:
            raise InvalidRequest("ttl_seconds: missing; give seconds from now, or null to keep it for good")
        row = await run_in_threadpool(lifecycle.set_ttl, owner, path, body["ttl_seconds"])
        return json_response(row)

    @app.post("/api/checkpoints/publish")
    async def publish(request: Request):
        owner = owner_of(request)
        body = await body_of(request)
        path, public = _field(body, "path", (str,)), _field(body, "public", (bool,))
        return json_response(await run_in_threadpool(lifecycle.publish, owner, path, public))

    @app.post("/api/checkpoints/copy")
    async def copy(request: Request):
        owner = owner_of(request)
        body = await body_of(request)
        path = _field(body, "path", (str,))
        return json_response(await run_in_threadpool(lifecycle.copy, owner, path, body.get("ttl_seconds")))

    @app.get("/api/trace")
    async def trace(request: Request, session: str):
        owner = owner_of(request)
        return json_response(await run_in_threadpool(lifecycle.trace, owner, [session]))

    @app.get("/api/storage")
    async def storage(request: Request):
        owner = owner_of(request)
        return json_response({"sessions": await run_in_threadpool(lifecycle.storage, owner)})

    @app.get("/api/audit")
    async def audit(request: Request):
        owner = owner_of(request)
        start, end = _seconds(request, "start", 0.0), _seconds(request, "end", float("inf"))
        return json_response({"entries": await run_in_threadpool(lifecycle.audit, owner, start, end)})
