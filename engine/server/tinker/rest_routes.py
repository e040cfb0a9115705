"""Tinker REST routes: training runs, checkpoints, weights info and downloads, sessions; and the
answer for every route this engine does not serve.

A training run is a sess session (a Tinker model, or a session the sess SDK made) and its
checkpoints are the session's ``state``, ``weights`` and ``merged`` checkpoints (:mod:`.ids`).
Downloads follow ``tinker checkpoint download``: export the weights (``save_weights_external``),
ask for ``external_weights_urls``, then fetch each file from a URL that carries a short-lived
signed token instead of the API key (the SDK fetches them with plain ``urllib``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from datetime import datetime, timezone
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import FileResponse, Response

from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.protocol.errors import InvalidRequest, NotFound
from sess.engine.server.tinker import ids
from sess.engine.server.tinker.state import Tinker, field_of, json_response

URL_TTL_S = 3600  # how long a download URL works
_SECRET = secrets.token_bytes(32)  # signs download URLs; a restarted engine's old URLs stop working
UNSUPPORTED = {
    "create_custom_loss": "custom losses run on the client: forward_backward_custom works with the default config",
    "retrieve_futures": "poll each future with retrieve_future",
    "join_sampling_session": "create a sampling client in each process",
    "cancel_future": "futures run to the end",
    "auth/token": "this engine takes API keys (tml-...), not JWTs",
}


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def _page(request: Request, items: list) -> tuple[list, dict]:
    try:
        limit = max(1, min(int(request.query_params.get("limit", 100)), 10_000))
        offset = max(0, int(request.query_params.get("offset", 0)))
    except ValueError:
        raise InvalidRequest("limit, offset: expected integers") from None
    return items[offset : offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


def _checkpoint(entry: dict) -> dict | None:
    ref = parse_path(entry["path"])
    kind = ids.TO_TINKER_KIND.get(ref.kind)
    if kind is None:  # transient sampler saves have no tinker:// path
        return None
    return {
        "checkpoint_id": f"{kind}/{ref.name}",
        "checkpoint_type": ids.CHECKPOINT_TYPE[kind],
        "time": _iso(entry["created"]),
        "tinker_path": ids.to_tinker_path(entry["path"]),
        "size_bytes": entry["bytes"],
        "public": bool(entry.get("public")),
        "user_metadata": entry.get("user_metadata"),
        "expires_at": None if entry.get("expires_at") is None else _iso(entry["expires_at"]),
    }


def sign_link(owner: str, path: str) -> str:
    payload = base64.urlsafe_b64encode(
        json.dumps([owner, path, int(time.time()) + URL_TTL_S]).encode()
    ).decode()
    mac = hmac.new(_SECRET, payload.encode(), hashlib.sha256).hexdigest()
    return f"{payload}.{mac}"


def verify_link(token: str) -> tuple[str, str]:
    payload, _, mac = token.partition(".")
    expected = hmac.new(_SECRET, payload.encode("utf-8", "replace"), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, mac.encode("ascii", "replace").decode()):
        raise NotFound("download link: not valid (expired with an engine restart, or altered)")
    owner, path, expires = json.loads(base64.urlsafe_b64decode(payload))  # signed by us: well formed
    if time.time() > expires:
        raise NotFound("download link: expired; ask for new external_weights_urls")
    return owner, path


def add_routes(route, tinker: Tinker) -> None:
    async def runs(owner: str) -> list[dict]:
        return await tinker.call(owner, "list_sessions", {})

    async def checkpoints(owner: str, name: str) -> list[dict]:
        found = await tinker.call(owner, "list_checkpoints", {"session": name})
        return [c for c in map(_checkpoint, found) if c is not None]

    async def training_run(owner: str, summary: dict, detailed: bool) -> dict:
        lora = summary.get("lora") or {}
        metadata = {k: v for k, v in (summary.get("user_metadata") or {}).items() if isinstance(v, str)}
        run = {
            "training_run_id": ids.run_id(summary["name"]),
            "base_model": tinker.model_names.get(summary["name"], summary["base_model"]),
            "model_owner": owner,
            "is_lora": True,
            "lora_rank": lora.get("rank"),
            "last_request_time": _iso(summary["last_active"]),
            "user_metadata": metadata,
        }
        if detailed:
            saved = await checkpoints(owner, summary["name"])
            for key, kind in (("last_checkpoint", "training"), ("last_sampler_checkpoint", "sampler")):
                run[key] = next((c for c in reversed(saved) if c["checkpoint_type"] == kind), None)
        return run

    @route("GET", "/training_runs")
    async def list_training_runs(request: Request) -> Response:
        owner = tinker.owner(request)
        scope = request.query_params.get("access_scope", "owned")
        if scope != "owned":
            raise InvalidRequest(
                f"access_scope: {scope[:40]!r} is not supported; this engine lists the runs a key owns "
                "(others' published checkpoints are read by their tinker:// paths)"
            )
        found = await runs(owner)
        project = request.query_params.get("project_id")
        if project is not None:
            tags = tinker.engine.registry.run_tags(owner)
            found = [s for s in found if tags.get(s["name"], {}).get("project_id") == project]
        page, cursor = _page(request, found)
        return json_response(
            {"training_runs": [await training_run(owner, s, False) for s in page], "cursor": cursor}
        )

    @route("GET", "/training_runs/{run_id}")
    async def get_training_run(request: Request) -> Response:
        owner = tinker.owner(request)
        name = ids.sess_name(request.path_params["run_id"], "training_run_id")
        summary = await tinker.call(owner, "session_info", {"name": name})
        return json_response(await training_run(owner, summary, True))

    @route("GET", "/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(request: Request) -> Response:
        owner = tinker.owner(request)
        name = ids.sess_name(request.path_params["run_id"], "training_run_id")
        return json_response({"checkpoints": await checkpoints(owner, name)})

    @route("GET", "/checkpoints")
    async def list_user_checkpoints(request: Request) -> Response:
        owner = tinker.owner(request)
        found = [c for s in await runs(owner) for c in await checkpoints(owner, s["name"])]
        page, cursor = _page(request, found)
        return json_response({"checkpoints": page, "cursor": cursor})

    def path_of(request: Request) -> str:
        params = request.path_params
        return ids.to_sess_path(
            f"tinker://{params['run_id']}/{params['kind']}/{params['name']}", "checkpoint_id"
        )

    @route("DELETE", "/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(request: Request) -> Response:
        owner = tinker.owner(request)
        await tinker.call(owner, "delete_checkpoint", {"path": path_of(request)})
        return json_response({})

    @route("POST", "/weights_info")
    async def weights_info(request: Request) -> Response:
        owner = tinker.owner(request)
        tinker_path = field_of(await tinker.json(request), "tinker_path", str)
        path = ids.to_sess_path(tinker_path, "tinker_path")
        await tinker.call(owner, "checkpoint_files", {"path": path})  # owner's, or published
        summary = await tinker.call(owner, "checkpoint_info", {"path": path})
        lora = summary.get("lora") or {}
        return json_response(
            {
                "base_model": tinker.model_names.get(summary["name"], summary["base_model"]),
                "is_lora": True,
                "lora_rank": lora.get("rank"),
                **{k: lora.get(k) for k in ("train_unembed", "train_mlp", "train_attn")},
            }
        )

    @route("GET", "/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
    async def external_weights_urls(request: Request) -> Response:
        owner = tinker.owner(request)
        path = path_of(request)
        files = await tinker.call(owner, "checkpoint_files", {"path": path})
        token = sign_link(owner, path)
        base = str(request.base_url).rstrip("/")
        urls = {rel: f"{base}/api/v1/checkpoint_files/{token}/{quote(rel)}" for rel, _ in files}
        return json_response({"urls": urls, "expires": _iso(time.time() + URL_TTL_S)})

    @route("GET", "/checkpoint_files/{token}/{file:path}")
    async def checkpoint_file(request: Request) -> Response:
        owner, path = verify_link(request.path_params["token"])
        files = dict(await tinker.call(owner, "checkpoint_files", {"path": path}))
        wanted = request.path_params["file"]
        if wanted not in files:
            raise NotFound(f"file: {wanted[:200]!r} is not part of this checkpoint")
        return FileResponse(files[wanted], media_type="application/octet-stream")

    @route("GET", "/sessions")
    async def list_sessions(request: Request) -> Response:
        owner = tinker.owner(request)
        mine = [s.id for s in tinker.sessions.values() if s.owner == owner]
        page, _ = _page(request, mine)
        return json_response({"sessions": page})

    @route("GET", "/sessions/{session_id}")
    async def get_session(request: Request) -> Response:
        session = tinker.session(tinker.owner(request), request.path_params["session_id"])
        runs_ = sorted(ids.run_id(name) for name in session.models)
        return json_response(
            {
                "training_run_ids": runs_,
                "sampler_ids": sorted(session.samplers),
                "user_metadata": session.user_metadata,
                "display_name": session.display_name,
            }
        )

    for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
        route(method, "/{rest:path}")(unsupported)


async def unsupported(request: Request) -> Response:
    rest = request.path_params.get("rest", "")
    why = next(
        (why for name, why in UNSUPPORTED.items() if rest == name or rest.startswith(name + "/")), None
    )
    detail = f"{request.method} /api/v1/{rest[:200]} is not supported by this sess engine"
    return json_response({"detail": f"{detail}: {why}" if why else detail}, 400, {"x-should-retry": "false"})
