"""What the Tinker front end keeps, and its plumbing to the engine: keys, bodies, ops, futures.

:class:`Tinker` holds the Tinker sessions (each a client's ``ServiceClient``, with the models and
samplers it made), the sampling sessions, the futures (:mod:`.futures`) and what it learned about
base models. Everything it runs goes through the executor's public methods (``submit``, ``wait``,
``call``, ``heartbeat``) with the typed requests of :mod:`sess.engine.protocol.requests`; a model is a
sess session and a checkpoint a ``sess://`` path (:mod:`.ids`), so the engine's ordering,
ownership, registry and checkpoint files serve both protocols. Sessions and samplers live in
memory: after an engine restart a client makes new ones (the cookbook's resume does), while
models and checkpoints, being sess sessions and files, are still there.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from sess.engine.protocol.errors import InvalidRequest, NotFound, SessError
from sess.engine.runtime.models.model_policy import model_name
from sess.engine.server.billing import Busy, OverBudget
from sess.engine.server.bodies import parse_json, read_body
from sess.engine.server.keys import KeyStore
from sess.engine.server.managed_engine import ManagedEngine
from sess.engine.server.tinker import ids
from sess.engine.server.tinker.request_futures import Answer, Futures
from sess.engine.server.tinker.sequence_records import SequenceRecords, bound_key

log = logging.getLogger("sess.engine")
_MISSING = object()
# statuses the SDK retries for minutes (408, 409, 429, 5xx) or treats as a billing pause (402) are
# never used for a client's mistake: those answer 400 (see the protocol notes in routes.py). A key over
# its budget (402: the SDK pauses and re-sends until it is raised) and a full queue (429 with
# Retry-After: it waits and re-sends) are what those statuses mean, and pass through.
PASS_THROUGH = {400, 401, 403, 404, 410, 413, 422}


@dataclass
class TinkerSession:
    id: str
    owner: str
    user_metadata: dict
    project_id: str | None = None  # the training runs it makes are listed under this project
    display_name: str | None = None
    created: float = field(default_factory=time.time)
    finished: bool = False
    models: set[str] = field(default_factory=set)  # sess session names
    samplers: set[str] = field(default_factory=set)


@dataclass
class Sampler:
    id: str
    owner: str
    target: dict  # a sess sampling target: {"model_path": sess://...} or {"base_model": name}
    session: str | None  # the sess session whose weights it samples; None: a base model
    model_path: str | None = None  # as the client named it (tinker://...)
    inflight: bool = False  # kind="inflight": follows each newer inflight save of its session


def json_response(data: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(
        json.dumps(data, separators=(",", ":")),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def error_response(exc: BaseException) -> Response:
    if isinstance(exc, OverBudget | Busy):
        retry_after = getattr(exc, "retry_after", None)
        headers = {"retry-after": str(retry_after), "x-should-retry": "true"} if retry_after else None
        return json_response({"detail": str(exc)}, exc.status, headers)
    if isinstance(exc, SessError):
        status = exc.status or 400
        status = status if status in PASS_THROUGH else 500 if status >= 500 else 400
        return json_response(
            {"detail": str(exc)}, status, {"x-should-retry": "false"} if status < 500 else None
        )
    log.error("tinker route failed", exc_info=exc)
    return json_response({"detail": f"internal error: {type(exc).__name__}: {exc}"}, 500)


def answer_response(answer: Answer) -> Response:
    return Response(answer.body, media_type=answer.media_type)


def failure(exc: BaseException) -> Answer:
    """A failed future's answer: ``category`` user for the client's mistakes, server for the engine's."""
    if not isinstance(exc, SessError):
        log.error("tinker future failed", exc_info=exc)
    status = exc.status if isinstance(exc, SessError) and exc.status else 500
    return Answer.of({"error": str(exc), "category": "user" if status < 500 else "server"})


def field_of(body: dict, name: str, kind: type | tuple, default: Any = _MISSING) -> Any:
    """``body[name]`` checked against ``kind`` (an int is never a bool); absent or null is ``default``."""
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise InvalidRequest(f"{name}: missing")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise InvalidRequest(f"{name}: expected {expected}, got {type(value).__name__}")
    return value


class Tinker:
    def __init__(self, engine: ManagedEngine, keys: KeyStore, max_body_bytes: int):
        self.engine, self.keys, self.max_body_bytes = engine, keys, max_body_bytes
        self.futures = Futures()
        self.sessions: dict[str, TinkerSession] = {}
        self.samplers: dict[str, Sampler] = {}
        self.model_names: dict[str, str] = {}  # sess session -> the base model as its client named it
        self.records: dict[str, SequenceRecords] = {}  # Tinker session -> its recorded sequences
        self._facts: dict[str, dict] = {}
        self._model_facts: dict[tuple[str, str], dict] = {}

    # requests ------------------------------------------------------------------------------------
    def owner(self, request: Request) -> str:
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else request.headers.get("x-api-key")
        entry = self.keys.entry(key)
        if entry is None:
            raise SessError(
                "api key: missing, unknown or revoked; pass api_key= or set TINKER_API_KEY to a key of "
                "this engine (sess engine keys add prints one)",
                status=401,
            )
        return entry["owner"]

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.max_body_bytes)

    async def json(self, request: Request) -> dict:
        return parse_json(await self.body(request))

    # the engine ----------------------------------------------------------------------------------
    async def call(self, owner: str, name: str, args: dict) -> Any:
        return await run_in_threadpool(self.engine.call, owner, name, args)

    async def submit(
        self, owner: str, name: str, args: dict, *, session: str | None = None, seq: int | None = None
    ) -> str:
        """Queue an op; a request the engine refuses on reading it is raised here (a 400 at once),
        its sequence number still used up so the session's later ops run."""
        op_id = await run_in_threadpool(  # refused for budget or a full queue: the SDK re-sends this seq
            self.engine.submit, owner, name, args, session=session, seq=seq, hold_seq=True
        )
        op = self.engine.wait(owner, op_id, 0)
        # only a refusal on reading: an op that already ran and failed answers through its future
        if op is not None and op.refused and op.error is not None and (op.error.status or 400) < 500:
            raise op.error
        return op_id

    async def skip(self, owner: str, session: str, seq: int) -> None:
        """Use up ``seq`` of ``session`` for an op refused before it reached the engine."""
        try:
            await self.submit(owner, "noop", {}, session=session, seq=seq)
        except SessError:
            pass  # not the owner's, or already used: nothing waits for it then

    def op_future(self, owner: str, op_id: str, convert: Callable[[Any], Answer]) -> str:
        async def work() -> Answer:
            while (op := await self.engine.wait_async(owner, op_id, 60.0)) is None:
                pass
            if op.error is not None:
                return failure(op.error)
            return convert(op.result)

        return self.task_future(owner, work())

    def task_future(self, owner: str, work: Awaitable[Answer]) -> str:
        async def guarded() -> Answer:
            try:
                return await work
            except Exception as exc:  # the future fails; the engine keeps serving
                return failure(exc)

        return self.futures.start(
            owner, guarded(), lambda: f"{self.engine.queued()} operations queued on the engine"
        )

    async def facts(self, owner: str, base_model: str) -> dict:
        """Canonical name, vocabulary, context and directory of a base model (loaded if need be);
        a name ``owner`` may not use is refused before any cache (:func:`.model_policy.model_name`)."""
        base_model = model_name(self.engine.runtime.home, owner, base_model)
        if base_model not in self._facts:
            facts = await self.call(owner, "model_info", {"base_model": base_model})
            self._facts[base_model] = self._facts[facts["base_model"]] = facts
        return self._facts[base_model]

    async def model(self, owner: str, model_id: Any, field: str = "model_id") -> tuple[str, dict, dict]:
        """(sess session name, its summary, its base model's facts) of one of ``owner``'s models."""
        name = ids.sess_name(model_id, field)
        summary = await self.call(owner, "session_info", {"name": name})
        return name, summary, await self.facts(owner, summary["base_model"])

    async def model_facts(self, owner: str, name: str) -> dict:
        """:meth:`facts` of a model's base model, remembered per (owner, model): every training op and
        sample request checks its tokens against the vocabulary, and asking the executor each time
        would put a control op between decode steps for every one of them."""
        if (owner, name) not in self._model_facts:
            self._model_facts[(owner, name)] = (await self.model(owner, name))[2]
        return self._model_facts[(owner, name)]

    async def readable_checkpoint(self, owner: str, path: str) -> str:
        """Check that ``owner`` may read checkpoint ``path`` (its own, or a published one) and
        return its session, whose base model's facts :meth:`model_facts` then knows (another key's
        session is not ``owner``'s to look up)."""
        info = await self.call(owner, "checkpoint_info", {"path": path})
        if (owner, info["name"]) not in self._model_facts:
            self._model_facts[(owner, info["name"])] = await self.facts(owner, info["base_model"])
        return info["name"]

    async def sampler_base_model(self, owner: str, sampler: Sampler) -> str:
        """The base model of what ``sampler`` samples, as its client names it (:meth:`client_model_name`);
        a sampler of another key's published checkpoint gets it from the checkpoint."""
        if sampler.session is None:
            return sampler.target["base_model"]
        if self.engine.runtime.find_session(owner, sampler.session) is None:
            info = await self.call(owner, "checkpoint_info", {"path": sampler.target["model_path"]})
            facts = await self.facts(owner, info["base_model"])
            return self.client_model_name(info["name"], {"base_model": info["base_model"]}, facts)
        name, summary, facts = await self.model(owner, sampler.session)
        return self.client_model_name(name, summary, facts)

    def client_model_name(self, name: str, summary: dict, facts: dict) -> str:
        """The base model as the client named it; a bare catalog name becomes the engine's directory
        of it, which ``AutoTokenizer.from_pretrained`` loads (a client on another machine names
        its model by a path or hub id of its own, and gets that back)."""
        given = self.model_names.get(name, summary["base_model"])
        return given if "/" in given else facts["directory"]

    def tokenizer_id(self, name: str, summary: dict, facts: dict) -> str:
        """What the SDK's ``get_tokenizer`` loads (``AutoTokenizer.from_pretrained``): the path or
        hub id the client named its model by; for a bare catalog name, the public hub id of its
        tokenizer, loadable on any machine, else (a random tiny model) the engine's directory."""
        given = self.model_names.get(name, summary["base_model"])
        if "/" in given:
            return given
        return facts.get("tokenizer") or facts["directory"]

    # sessions and samplers -----------------------------------------------------------------------
    def session(self, owner: str, session_id: Any, field: str = "session_id") -> TinkerSession:
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.owner != owner:
            raise NotFound(f"{field}: no session {str(session_id)[:80]!r} (unknown, or the engine restarted)")
        return session

    def sampler(self, owner: str, sampler_id: Any) -> Sampler:
        sampler = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if sampler is None or sampler.owner != owner:
            raise NotFound(
                f"sampling_session_id: no sampling session {str(sampler_id)[:80]!r} "
                "(unknown, or the engine restarted; create a new sampling client)"
            )
        return sampler

    def records_of(self, owner: str, session_id: str | None, create: bool = False) -> SequenceRecords | None:
        """The recorded sequences of ``owner``'s Tinker session ``session_id`` (made if ``create``)."""
        for other, kept in list(self.records.items()):  # an exited client's records go after their day
            if other != session_id and kept.stale():  # not one whose samples are still running
                del self.records[other]
        session = self.sessions.get(session_id) if session_id else None
        if session is None or session.owner != owner or session.finished:
            return None
        if create:  # a sample request records into it when its samples are done
            self.records.setdefault(session_id, SequenceRecords()).touch()
        return self.records.get(session_id)

    def bound_records(self, owner: str) -> None:
        """Keep ``owner``'s recorded sequences, over all its sessions, within the key's bound."""
        mine = [
            r for sid, r in self.records.items() if sid in self.sessions and self.sessions[sid].owner == owner
        ]
        bound_key(mine)

    def add_sampler(self, sampler: Sampler) -> None:
        self.samplers[sampler.id] = sampler
        session = self.sessions.get(sampler.id.split(":", 1)[0])
        if session is not None and session.owner == sampler.owner:
            session.samplers.add(sampler.id)

    async def once(self, key: tuple, make: Callable[[], Awaitable[Any]]) -> Any:
        return await self.futures.once(key, make)
