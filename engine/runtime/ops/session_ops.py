"""Session ops: create (fresh or from a state checkpoint), stop, delete, list, usage, and the models.

Each op is a function ``(runtime, owner, request) -> wire dict`` over a typed request (see
:mod:`sess.engine.protocol.requests`), listed in :mod:`sess.engine.runtime.ops.table`. A key sees only its own sessions.
"""

from __future__ import annotations

import re
import secrets
import time

from sess.engine.protocol import requests as rq
from sess.engine.protocol.checkpoint_paths import check_name, parse_path
from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.types import SessionStatus, Usage
from sess.engine.runtime import session_names
from sess.engine.runtime.checkpoints.checkpoint_files import TOKENIZER_FILES, read_state, saved
from sess.engine.runtime.checkpoints.manifest import foreign_files
from sess.engine.runtime.models.catalog import CATALOG, context_window, list_models
from sess.engine.runtime.models.model_policy import OPERATOR, model_name
from sess.engine.runtime.ops import checkpoint_ops
from sess.engine.runtime.runtime import Runtime
from sess.engine.runtime.session import Session


def list_base_models(runtime: Runtime, owner: str, request: rq.NoArgs) -> list[str]:
    """The served models; for the operator also what else it has in memory (its own directories)."""
    loaded = set(runtime.hosts) if owner == OPERATOR else set()
    return sorted(set(list_models(runtime.home)) | loaded)


def model_windows(runtime: Runtime, owner: str, request: rq.NoArgs) -> dict[str, int | None]:
    """Each model of :func:`list_base_models` with its context window in tokens: a loaded model's
    from its config, else the catalog's (None where only loading the model would tell)."""
    windows = {}
    for name in list_base_models(runtime, owner, request):
        host = runtime.hosts.get(name)
        windows[name] = host.max_context if host is not None else context_window(name, runtime.home)
    return windows


def tokenizer_files(runtime: Runtime, owner: str, request: rq.TokenizerFiles) -> dict[str, str]:
    path = runtime.host(model_name(runtime.home, owner, request.base_model)).path
    return {n: (path / n).read_text() for n in TOKENIZER_FILES if (path / n).exists()}


def model_info(runtime: Runtime, owner: str, request: rq.ModelInfo) -> dict:
    """A base model as another front end (the Tinker routes) needs it: its served name for any
    spelling of it (:func:`.model_policy.model_name`), vocabulary size, context length, architecture,
    local directory (loaded if need be) and the public hub id of its tokenizer (None when there is none)."""
    name = model_name(runtime.home, owner, request.base_model)
    host = runtime.host(name)
    spec = CATALOG.get(name)
    return {
        "base_model": name,
        "tokenizer": spec.tokenizer if spec is not None else None,
        "vocab_size": host.vocab_size,
        "max_context": host.max_context,
        "arch": str(getattr(host.model.config, "model_type", "unknown")),
        "directory": str(host.path),
    }


def create_session(runtime: Runtime, owner: str, request: rq.CreateSession) -> dict:
    base_model = model_name(runtime.home, owner, request.base_model)
    given = check_name(request.name or default_name(base_model), "training_session_name")
    if runtime.find_session(owner, given) is not None:
        raise InvalidRequest(f"training_session_name: a session named {given!r} already exists", status=409)
    # a name another key holds, or whose files on disk no session holds (a lost registry) and whose
    # manifests do not say are the caller's: the new session gets an id of its own (session_names.py)
    name = session_names.new_id(runtime, owner, given)
    if name in runtime.sessions or foreign_files(runtime.home, name, owner):
        raise InvalidRequest(f"training_session_name: a session named {given!r} already exists", status=409)
    seed = secrets.randbits(31) if request.seed is None else request.seed
    lora = {
        "rank": request.rank,
        "alpha": request.alpha,
        "seed": seed,
        "train_mlp": request.train_mlp,
        "train_attn": request.train_attn,
        "train_unembed": request.train_unembed,
    }
    runtime.sampler.check_session(runtime, base_model, lora)  # refused now, not at its first sample
    session = Session(name, owner, base_model, lora, user_metadata=request.user_metadata)
    _add_adapter(runtime, session)
    runtime.sessions[name] = session
    return session.summary()


def _add_adapter(runtime: Runtime, session: Session) -> None:
    """A new adapter for ``session`` (initialised from its LoRA seed) and a fresh AdamW over it."""
    lora, host = session.lora, runtime.host(session.base_model)
    session.adapter = runtime.new_adapter_name()
    config = host.lora_config(
        lora["rank"], lora["alpha"], lora["train_attn"], lora["train_mlp"], lora["train_unembed"]
    )
    host.add_adapter(session.adapter, config, lora["seed"])
    session.params = host.adapter_params(session.adapter)
    runtime.placement.add_adapter(session, host)  # several ranks: 1/N of it on each (a followed op)
    session.new_optimizer()


def default_name(base_model: str) -> str:
    """``<model>-<6 hex>``: a hub id's name part, a local directory's last part, made name-safe."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", base_model.rstrip("/").rsplit("/", 1)[-1]).strip("-.")
    return f"{(stem or 'model')[:40]}-{secrets.token_hex(3)}"


def create_session_from_state(runtime: Runtime, owner: str, request: rq.CreateSessionFromState) -> dict:
    """A session whose adapter (and, ``with_optimizer``, AdamW state and step) come from a state
    checkpoint of one of ``owner``'s sessions. Named after the checkpoint's own session when that one
    is stopped, it is that session continued: the same name, record, usage and checkpoints (the
    registry keeps the resume as history); any other name makes a new session."""
    _, _, _, meta = read_state(checkpoint_ops.checkpoint_dir(runtime, owner, request.path))
    stopped = runtime.find_session(owner, request.name) if request.name else None
    if stopped is not None:
        return _continue(runtime, owner, stopped, request, meta)
    lora = meta["lora"]
    summary = create_session(
        runtime,
        owner,
        rq.CreateSession(
            base_model=meta["base_model"], name=request.name, user_metadata=request.user_metadata, **lora
        ),
    )
    load = rq.LoadState(session=summary["name"], path=request.path, with_optimizer=request.with_optimizer)
    try:
        checkpoint_ops.load_state(runtime, owner, load)
    except BaseException:
        delete_session(runtime, owner, rq.DeleteSession(name=summary["name"], stop_if_active=True))
        raise
    return runtime.sessions[summary["name"]].summary()


def _continue(
    runtime: Runtime, owner: str, session: Session, request: rq.CreateSessionFromState, meta: dict
) -> dict:
    """Stopped ``session`` running again from one of its own state checkpoints, at that step."""
    source = parse_path(request.path).session
    if session.live:
        raise InvalidRequest(
            f"training_session_name: session {session.name!r} is running already; attach to it "
            f"(get_training_client), or give another name for a new session from {request.path}",
            status=409,
        )
    if source != session.name:
        raise InvalidRequest(
            f"training_session_name: session {session.name!r} exists ({session.status.value}) and "
            f"continues only from its own checkpoints, not from {request.path}; give another name "
            "for a new session from it",
            status=409,
        )
    before = (session.status, session.step)
    session.lora, session.base_model = meta["lora"], meta["base_model"]
    _add_adapter(runtime, session)
    session.status = SessionStatus.Running
    load = rq.LoadState(session=session.name, path=request.path, with_optimizer=request.with_optimizer)
    try:
        checkpoint_ops.load_state(runtime, owner, load)
    except BaseException:
        stop_session(runtime, owner, rq.SessionName(name=session.name))
        session.status, session.step = before
        raise
    session.step = int(meta["step"])  # the count goes on from the checkpoint's step, weights-only too
    # unnamed saves end in a save counter: go on past the earlier lifetimes' so none is overwritten
    counters = [
        int(m[1]) for ref in saved(session.name, runtime.home) if (m := re.search(r"-(\d+)$", ref.name))
    ]
    session.saves = max([session.saves, *counters])
    session.saved_step = session.step if request.with_optimizer else None
    session.last_active = time.time()
    return session.summary()


def stop_session(runtime: Runtime, owner: str, request: rq.SessionName) -> dict:
    session = runtime.session(owner, request.name, live=False)
    if session.live:
        if session.base_model in runtime.batches:
            stopped = InvalidRequest(
                f"session {session.name!r} was stopped while this request was sampling from it", status=409
            )
            runtime.batches[session.base_model].fail_adapter(session.adapter, stopped)
        runtime.placement.forget_adapter(session.adapter)
        runtime.hosts[session.base_model].remove_adapter(session.adapter)
        session.optimizer, session.params, session.shard, session.flat = None, {}, None, None
        session.status = SessionStatus.Stopped
        if runtime.placement.leader:  # files are rank 0's; it tells the others
            checkpoint_ops.drop_transient_samplers(runtime, session)
    return session.summary()


def delete_session(runtime: Runtime, owner: str, request: rq.DeleteSession) -> dict:
    """Forget a session and delete its checkpoints, files included (a running one is refused
    unless ``stop_if_active``)."""
    session = runtime.session(owner, request.name, live=False)
    if session.live:
        if not request.stop_if_active:
            raise InvalidRequest(
                f"session {session.name!r} is running; stop it first or pass stop_if_active=True", status=409
            )
        stop_session(runtime, owner, rq.SessionName(name=session.name))
    del runtime.sessions[session.name]
    checkpoint_ops.delete_checkpoints(runtime, session)
    runtime.sampler.forget(session.name, runtime.batches)  # vLLM: its live weights exported
    return session.summary()


def list_sessions(runtime: Runtime, owner: str, request: rq.ListSessions) -> list[dict]:
    found = [
        s.summary()
        for s in sorted(runtime.sessions.values(), key=lambda s: s.created)
        if s.owner == owner
        and (request.name_contains is None or request.name_contains in s.name)
        and (request.status_equals is None or s.status.value == request.status_equals)
    ]
    return found[: request.max_results] if request.max_results else found


def session_info(runtime: Runtime, owner: str, request: rq.SessionName) -> dict:
    return runtime.session(owner, request.name, live=False).summary()


def get_usage(runtime: Runtime, owner: str, request: rq.GetUsage) -> dict:
    if request.name is not None:
        return runtime.session(owner, request.name, live=False).usage.to_wire()
    total = Usage()
    for session in runtime.sessions.values():
        if session.owner == owner:
            total = total.add(session.usage)
    return total.to_wire()


def noop(runtime: Runtime, owner: str, request: rq.Noop) -> dict:
    return {}
