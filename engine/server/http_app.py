"""The engine's HTTP app: FastAPI over a :class:`~sess.engine.server.managed_engine.ManagedEngine`.

Handlers only authenticate, read the envelope, enqueue and answer; the executor reads each op's
typed request before queueing it, and its one thread owns torch. The wire is small: ``POST
/api/call`` (control ops), ``POST /api/submit`` (queue an op, get its id), ``POST /api/wait``
(long-poll an op's result), ``POST /api/heartbeat``, checkpoint file downloads, ``GET /api/usage``,
checkpoint TTLs, publishing, copies, traces, storage and the audit log (:mod:`.lifecycle_routes`),
the OpenAI-compatible ``/v1`` routes (:mod:`.openai`) and the Tinker protocol under
``/api/v1`` (:mod:`.tinker`), all over the one engine. Bodies are JSON (arrays inside
are base64, see :mod:`sess.engine.protocol.types`); errors are ``{"error": {"message", "status"}}`` with
a 4xx for anything a client sent and a 5xx only for the engine's own failures.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from sess.engine.protocol.errors import InvalidRequest, NotFound, SessError
from sess.engine.runtime.memory.malloc_tuning import peak_resident_bytes, resident_bytes
from sess.engine.runtime.ops.table import OPS, Kind
from sess.engine.runtime.session_names import client_view, engine_name
from sess.engine.server.bodies import HttpError, read_json
from sess.engine.server.keys import KeyStore
from sess.engine.server.managed_engine import ManagedEngine
from sess.engine.server.settings import MAX_BODY_BYTES

log = logging.getLogger("sess.engine")
MAX_WAIT_S = 60.0
# Control ops a client may call; checkpoint_files answers with local paths, so it has its own routes.
CALLABLE = {name for name, op in OPS.items() if op.kind is Kind.CONTROL} - {"checkpoint_files"}


def json_response(content: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(content, separators=(",", ":")), status_code=status, media_type="application/json"
    )


def error_response(exc: SessError) -> Response:
    status = exc.status or 400
    response = json_response(
        {"error": {"message": str(exc), "status": status, "type": type(exc).__name__}}, status
    )
    retry_after = getattr(exc, "retry_after", None)  # a full queue: when to come back
    if retry_after is not None:
        response.headers["retry-after"] = str(retry_after)
    return response


def field(data: dict, name: str, types: type | tuple, *, required: bool = True, default: Any = None) -> Any:
    value = data.get(name, default)
    if value is None and not required:
        return default
    if (
        value is None
        or not isinstance(value, types)
        or (isinstance(value, bool) and bool not in _tuple(types))
    ):
        expected = " or ".join(t.__name__ for t in _tuple(types))
        raise InvalidRequest(f"{name}: expected {expected}, got {type(value).__name__}")
    return value


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def create_app(engine: ManagedEngine, keys: KeyStore, *, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="sess engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.keys = engine, keys

    def owner_of(request: Request) -> str:
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else request.headers.get("x-api-key")
        entry = keys.entry(key)
        if entry is None:
            raise HttpError(
                "api key: missing or unknown; pass api_key= or set SESS_API_KEY "
                "(the local engine's key is in $SESS_HOME/api_key)",
                status=401,
            )
        return entry["owner"]

    @app.middleware("http")
    async def errors_as_json(request: Request, call_next):
        try:
            return await call_next(request)
        except SessError as exc:
            return error_response(exc)
        except ClientDisconnect:  # one line, no traceback: a client that leaves is not an engine fault
            client = request.client.host if request.client else "?"
            log.warning(
                "%s %s from %s: the client left before its body was read",
                request.method,
                request.url.path,
                client,
            )
            return Response(status_code=400)  # no one is there to read it
        except Exception as exc:  # a handler bug answers 500 and the engine keeps serving
            log.exception("request %s failed", request.url.path)
            return error_response(SessError(f"internal error: {type(exc).__name__}: {exc}", status=500))

    @app.exception_handler(SessError)
    async def sess_error(request: Request, exc: SessError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_parameters(request: Request, exc: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'request'}: {e.get('msg', 'invalid')}"
            for e in exc.errors()
        )
        return error_response(InvalidRequest(problems or "invalid request parameters"))

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return error_response(NotFound(f"no route {request.method} {request.url.path}"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        return error_response(
            SessError(f"method {request.method} not allowed on {request.url.path}", status=405)
        )

    @app.get("/healthz")
    async def healthz():
        health = {"ok": True, "pid": os.getpid(), "idle_timeout": engine.idle_timeout}
        health["models"] = sorted(engine.runtime.hosts.copy())  # base models in memory (a pilot asks)
        memory = {
            "rss_bytes": resident_bytes(),
            "peak_rss_bytes": peak_resident_bytes(),
            "trimmed": engine.idled,  # idle(): free memory handed back
            "trim_after_s": engine.idle_after_s,
        }
        invariance = engine.runtime.batch_invariance()
        if engine.runtime.placement.world > 1:  # several ranks: how sampling spreads over them
            from sess.engine.runtime.distributed import logprob_spread, sample_spread

            ranks = engine.runtime.placement
            health["sampling_ranks"] = {
                **sample_spread.report(ranks),
                **logprob_spread.report(ranks),
            }
        return json_response({**health, **memory, "batch_invariant": invariance})

    @app.post("/api/call")
    async def call(request: Request):
        owner = owner_of(request)
        body = await read_json(request, max_body_bytes)
        name = field(body, "name", str)
        if name not in CALLABLE:
            raise InvalidRequest(f"name: unknown control operation {name!r}")
        args = field(body, "args", dict, required=False, default={})
        result = await run_in_threadpool(engine.call, owner, name, args)
        return json_response({"result": result})

    @app.post("/api/submit")
    async def submit(request: Request):
        owner = owner_of(request)
        body = await read_json(request, max_body_bytes)
        op_id = await run_in_threadpool(  # reading a large batch's arrays stays off the event loop
            engine.submit,
            owner,
            field(body, "name", str),
            field(body, "args", dict),
            session=field(body, "session", str, required=False),
            seq=field(body, "seq", int, required=False),
            client_token=field(body, "client_token", str, required=False),
        )
        return json_response({"op_id": op_id})

    @app.post("/api/wait")
    async def wait(request: Request):
        owner = owner_of(request)
        body = await read_json(request, max_body_bytes)
        timeout = field(body, "timeout", (int, float), required=False, default=30.0)
        # clamped before float(): an integer of 400 digits is valid JSON but overflows a float
        timeout = float(max(0.0, min(timeout, MAX_WAIT_S)))
        op = await engine.wait_async(owner, field(body, "op_id", str), timeout)
        if op is None:
            return json_response({"done": False})
        if op.error is not None:
            return error_response(op.error)
        return json_response({"done": True, "result": op.result})

    @app.post("/api/heartbeat")
    async def heartbeat(request: Request):
        owner = owner_of(request)
        body = await read_json(request, max_body_bytes)
        sessions = field(body, "sessions", list)
        engine.heartbeat(owner, [s for s in sessions if isinstance(s, str)])
        return json_response({"idle_timeout": engine.idle_timeout, "heartbeat_lapse": engine.heartbeat_lapse})

    @app.get("/api/checkpoints/files")
    async def checkpoint_files(request: Request, path: str):
        owner = owner_of(request)
        files = await run_in_threadpool(engine.call, owner, "checkpoint_files", {"path": path})
        return json_response({"files": [[rel, f.stat().st_size] for rel, f in files]})

    @app.get("/api/checkpoints/file")
    async def checkpoint_file(request: Request, path: str, file: str):
        owner = owner_of(request)
        files = dict(await run_in_threadpool(engine.call, owner, "checkpoint_files", {"path": path}))
        if file not in files:
            raise NotFound(f"file: {file!r} is not part of checkpoint {path}")
        return FileResponse(files[file], media_type="application/octet-stream")

    @app.get("/api/usage")
    async def usage(request: Request, name: str | None = None, by: str = "operation"):
        owner = owner_of(request)
        if by not in ("operation", "session", "key"):
            raise InvalidRequest(f"by: expected operation, session or key, got {by[:32]!r}")
        total = await run_in_threadpool(engine.call, owner, "get_usage", {"name": name})
        session = engine_name(engine.runtime, owner, name)  # the caller's own session of that name
        report = await run_in_threadpool(engine.billing.report, owner, session, by, total)
        return json_response(client_view(owner, report))

    @app.get("/api/prices")
    async def prices(request: Request):
        owner_of(request)
        table = engine.billing.prices
        return json_response({"prices": table.to_wire() if table else None})

    from sess.engine.server.lifecycle_routes import add_lifecycle_routes

    add_lifecycle_routes(app, engine.lifecycle, owner_of, read_json, json_response, max_body_bytes)
    from sess.engine.server.openai.routes import add_openai_routes

    add_openai_routes(app, engine, owner_of, read_json)
    from sess.engine.server.tinker.routes import add_tinker_routes

    add_tinker_routes(app, engine, keys, max_body_bytes)  # the Tinker protocol, under /api/v1
    return app
