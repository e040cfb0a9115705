"""The Tinker REST routes under ``/api/v1``: client config, sessions, futures, health; and the mount.

What the routes answer follows what the ``tinker`` SDK (0.34 to 0.38) reads: JSON with the fields its
pydantic models require, protobuf for ``ForwardBackwardOutput`` and ``SampleResponse``, and
errors as ``{"detail": ...}`` with statuses the SDK does not retry (400, 401, 404, 410, 413, 422;
never 402, 408, 409, 429 or 5xx for a client's mistake, which it would retry for minutes), plus
``x-should-retry: false``. ``/client/config`` is where every SDK client starts, so an SDK outside
the tested range is refused there, at once, with the range it needs. Training ops are in
:mod:`.training_routes`, sampling in :mod:`.sampling_routes`, runs and checkpoints in
:mod:`.rest_routes`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from sess.engine.protocol.errors import InvalidRequest, SessError
from sess.engine.server.keys import KeyStore
from sess.engine.server.managed_engine import ManagedEngine
from sess.engine.server.tinker import fields, ids
from sess.engine.server.tinker.state import (
    Tinker,
    TinkerSession,
    answer_response,
    error_response,
    field_of,
    json_response,
)

PREFIX = "/api/v1"
# tinker SDK versions this engine speaks: >= 0.34, < 0.39, what tinker-cookbook 0.5.x accepts. Their
# wire is one: the same routes, protobuf schema and JSON models, except fields that later versions add
# and this engine does not need or answers with defaults (``retrieve_future``'s
# ``retrieved_request_ids`` from 0.36, ``save_weights_for_sampler``'s ``kind`` from 0.38, the client
# config's ``custom_loss_server_side`` from 0.36 and ``create_model_via_load_weights`` before 0.38, both
# off here), and routes this engine does not serve (``create_custom_loss``, ``sessions/search`` and
# the checkpoint ``archive`` URL).
TESTED_SDK = ((0, 34), (0, 39))
SDK_RANGE = "tinker>=0.34,<0.39"
# What the SDK may configure (types/client_config_response.py). Plain httpx instead of pyqwest, whole
# forward_backward chunks sent in order, no zstd request bodies, no JWT exchange, no server-side
# custom losses: each is a code path this engine does not need.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "create_model_via_load_weights": False,  # read by 0.34-0.36; ignored by later SDKs
    "sample_join_sampling_session": False,
}

Handler = Callable[[Request], Awaitable[Response]]


def guarded(handler: Handler) -> Handler:
    """Errors as ``{"detail"}`` answers; a handler bug is a 500 and the engine keeps serving."""

    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            return error_response(exc)

    return run


def sdk_version_error(version: object) -> str | None:
    """Why an SDK of ``version`` is refused, or None when it is in the tested range."""
    version = version if isinstance(version, str) else None
    match = re.match(r"^(\d+)\.(\d+)", version or "")
    if match and TESTED_SDK[0] <= (int(match.group(1)), int(match.group(2))) < TESTED_SDK[1]:
        return None
    return (
        f"tinker SDK {(version or '(version not sent)')[:40]} is not supported by this sess engine, which speaks "
        f"the protocol of {SDK_RANGE} (tested with 0.34.0 to 0.38.0): pip install 'tinker==0.38.0'"
    )


def add_tinker_routes(app: FastAPI, engine: ManagedEngine, keys: KeyStore, max_body_bytes: int) -> Tinker:
    """Mount the Tinker protocol on ``app`` under ``/api/v1``, over the same engine as sess's routes."""
    from sess.engine.server.tinker import (
        billing_routes,
        lifecycle_routes,
        rest_routes,
        sampling_routes,
        training_routes,
    )

    tinker = Tinker(engine, keys, max_body_bytes)

    def route(method: str, path: str):
        def register(handler: Handler) -> Handler:
            app.add_api_route(PREFIX + path, guarded(handler), methods=[method], include_in_schema=False)
            return handler

        return register

    add_core_routes(route, tinker)
    training_routes.add_routes(route, tinker)
    sampling_routes.add_routes(route, tinker)
    billing_routes.add_routes(route, tinker)
    lifecycle_routes.add_routes(route, tinker, rest_routes.sign_link, rest_routes.verify_link)
    rest_routes.add_routes(route, tinker)  # last: it ends with the catch-all for unknown routes
    return tinker


def add_core_routes(route, tinker: Tinker) -> None:
    @route("POST", "/client/config")
    async def client_config(request: Request) -> Response:
        tinker.owner(request)
        body = await tinker.json(request)
        version = body.get("sdk_version") or request.headers.get("x-stainless-package-version")
        problem = sdk_version_error(version)
        if problem:
            return json_response({"detail": problem}, 400, {"x-should-retry": "false"})
        return json_response(CLIENT_CONFIG)

    @route("POST", "/client/dynamic_config")
    async def dynamic_config(request: Request) -> Response:
        tinker.owner(request)
        return json_response({"sample_cancel_enabled": False})

    @route("POST", "/create_session")
    async def create_session(request: Request) -> Response:
        owner = tinker.owner(request)
        body = await tinker.json(request)
        fields.check_refused("CreateSessionRequest", body)  # tags (TINKER_TAGS): not kept here
        metadata = field_of(body, "user_metadata", dict, {})
        project_id = field_of(body, "project_id", str, None)
        display_name = field_of(body, "display_name", str, None)
        problem = sdk_version_error(body.get("sdk_version")) if "sdk_version" in body else None
        if problem:
            raise InvalidRequest(problem)

        async def make() -> dict:
            session = TinkerSession(ids.new_session_id(), owner, metadata, project_id, display_name)
            tinker.sessions[session.id] = session
            return {"session_id": session.id, "type": "create_session"}

        key = request.headers.get("x-idempotency-key")
        answer = await (tinker.once((owner, "session", key), make) if key else make())
        return json_response(answer)

    @route("POST", "/session_heartbeat")
    async def heartbeat(request: Request) -> Response:
        owner = tinker.owner(request)
        session = tinker.session(owner, field_of(await tinker.json(request), "session_id", str))
        if session.finished:
            return json_response({"detail": f"session {session.id} has finished"}, 410)
        tinker.engine.heartbeat(owner, sorted(session.models))
        return json_response({"type": "session_heartbeat"})

    @route("POST", "/sessions/{session_id}/finish")
    async def finish(request: Request) -> Response:
        owner = tinker.owner(request)
        session = tinker.session(owner, request.path_params["session_id"])
        if not session.finished:  # a finish is first-wins; its models stop, their checkpoints stay
            session.finished = True
            tinker.records.pop(session.id, None)  # its recorded sequences go with it
            for name in sorted(session.models):
                try:
                    await tinker.call(owner, "stop_session", {"name": name})
                except SessError:
                    pass
        return json_response({})

    @route("POST", "/telemetry")
    async def telemetry(request: Request) -> Response:
        tinker.owner(request)
        await tinker.body(request)  # read and dropped: the engine keeps its own usage records
        return json_response({"status": "accepted"})

    @route("POST", "/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        owner = tinker.owner(request)
        body = await tinker.json(request)
        try:  # hold the poll until 15 s before the client's read timeout (the SDK sends 45 s)
            hold = float(request.headers.get("x-stainless-read-timeout", "45")) - 15
        except ValueError:
            hold = 30.0
        answer = await tinker.futures.retrieve(owner, field_of(body, "request_id", str), hold)
        return answer_response(answer)

    @route("GET", "/healthz")
    async def healthz(request: Request) -> Response:
        return json_response({"status": "ok"})

    @route("GET", "/get_server_capabilities")
    async def capabilities(request: Request) -> Response:
        owner = tinker.owner(request)
        windows = await tinker.call(owner, "model_windows", {})
        models = [
            {"model_name": m, "max_context_length": n, "trainable": True, "sampleable": True}
            for m, n in windows.items()
        ]
        return json_response({"supported_models": models})
