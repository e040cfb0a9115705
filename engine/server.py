"""The engine server: FastAPI over a :class:`~sess.engine.managed.ManagedEngine`.

Handlers only authenticate, validate the envelope, enqueue and answer; the one executor thread owns
torch. The wire is small: ``POST /api/call`` (control ops), ``POST /api/submit`` (queue an op, get
its id), ``POST /api/wait`` (long-poll an op's result), ``POST /api/heartbeat``, checkpoint file
downloads, ``GET /api/usage`` and the OpenAI-compatible ``/v1`` routes. Bodies are JSON (arrays
inside are base64, see ``types.py``); errors are ``{"error": {"message", "status"}}`` with a 4xx/5xx.

Run it with ``sess engine up`` or ``python -m sess.engine.server --home DIR --port N``.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool

from .keys import KeyStore
from .managed import ManagedEngine
from .paths import atomic_write_bytes, sess_home
from .service import CONTROL_OPS
from .types import InvalidRequest, NotFound, SessError

log = logging.getLogger("sess.engine")
ENGINE_FILE = "engine.json"
MAX_BODY_BYTES = int(os.environ.get("SESS_MAX_BODY_BYTES", 256 << 20))
MAX_WAIT_S = 60.0
# Control ops a client may call; checkpoint_files answers with local paths, so it has its own routes.
CALLABLE = CONTROL_OPS - {"checkpoint_files"}


class HttpError(SessError):
    pass


def json_response(content: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(content, separators=(",", ":")), status_code=status, media_type="application/json"
    )


def error_response(exc: SessError) -> Response:
    status = exc.status or 400
    return json_response(
        {"error": {"message": str(exc), "status": status, "type": type(exc).__name__}}, status
    )


async def read_json(request: Request, max_bytes: int = MAX_BODY_BYTES) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HttpError(f"body: {int(declared)} bytes is over the limit of {max_bytes}", status=413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise HttpError(f"body: over the limit of {max_bytes} bytes", status=413)
    try:
        data = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body: malformed JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"body: expected a JSON object, got {type(data).__name__}")
    return data


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
        except Exception as exc:  # a handler bug answers 500 and the engine keeps serving
            log.exception("request %s failed", request.url.path)
            return error_response(SessError(f"internal error: {type(exc).__name__}: {exc}", status=500))

    @app.exception_handler(SessError)
    async def sess_error(request: Request, exc: SessError):
        return error_response(exc)

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
        return json_response({"ok": True, "pid": os.getpid(), "idle_timeout": engine.idle_timeout})

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
        op_id = engine.submit(
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
        timeout = min(float(field(body, "timeout", (int, float), required=False, default=30.0)), MAX_WAIT_S)
        op = await engine.wait_async(owner, field(body, "op_id", str), max(0.0, timeout))
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
        return json_response({"idle_timeout": engine.idle_timeout})

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
    async def usage(request: Request, name: str | None = None):
        owner = owner_of(request)
        total = await run_in_threadpool(engine.call, owner, "get_usage", {"name": name})
        by_op = engine.registry.usage_by_operation(owner, name)
        return json_response({"session": name, "usage": total, "operations": by_op})

    from .openai_api import add_openai_routes

    add_openai_routes(app, engine, owner_of, read_json)
    return app


# process ---------------------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only when it is explicit; without
    # it a response's header and body writes wait ~40 ms on the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(
    home: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "cpu",
    idle_timeout: float = 600.0,
    max_sessions: int = 8,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> None:
    """Run an engine in this process until SIGINT/SIGTERM; writes ``engine.json`` into the home."""
    import uvicorn

    home = sess_home(home)
    keys = KeyStore(home)
    if not is_loopback(host) and not keys.load():
        raise SystemExit(
            f"refusing to listen on {host} without API keys: add one first (sess engine keys add --home {home})"
        )
    keys.ensure_local_key()
    sock = bind(host, port)
    port = sock.getsockname()[1]
    engine = ManagedEngine(
        home,
        device,
        idle_timeout=idle_timeout,
        max_sessions=max_sessions,
        session_limits=lambda owner: next(
            (e.get("max_sessions") for e in keys.load().values() if e["owner"] == owner), None
        ),
    )
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    info = {
        "url": f"http://{url_host}:{port}",
        "pid": os.getpid(),
        "host": host,
        "port": port,
        "started": time.time(),
    }
    atomic_write_bytes(home / ENGINE_FILE, json.dumps(info).encode())
    app = create_app(engine, keys, max_body_bytes=max_body_bytes)
    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_keep_alive=120,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
    )
    server = uvicorn.Server(config)
    print(f"sess engine serving {info['url']} (home {home}, pid {os.getpid()})", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        try:
            if json.loads((home / ENGINE_FILE).read_text()).get("pid") == os.getpid():
                (home / ENGINE_FILE).unlink()
        except (OSError, ValueError):
            pass
        engine.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sess.engine.server", description=__doc__.splitlines()[0])
    parser.add_argument("--home", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("SESS_PORT", 0)))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--idle-timeout", type=float, default=600.0)
    parser.add_argument("--max-sessions", type=int, default=8, help="live sessions per key")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)  # uvicorn re-raises it after a graceful shutdown
    try:
        serve(
            args.home,
            args.host,
            args.port,
            args.device,
            args.idle_timeout,
            args.max_sessions,
            args.max_body_bytes,
        )
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
