"""Checkpoint ops: save sampler weights (PEFT or merged), save and load state, list and fetch files.

Paths are ``sess://<session>/<kind>/<name>``; a checkpoint of another key's session is not found.
Transient ``sampler`` saves (``save_weights_and_get_sampling_client`` without a name) are loaded
for sampling at once and leave memory when a newer one comes (loaded again from disk if asked for,
however many newer ones exist); their files live as long as their session: they are deleted when
it stops. On an engine of several ranks every change to the set of checkpoint adapters held for
sampling goes to the other ranks (:meth:`sess.engine.runtime.placement.Placement.share_samplers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from sess.engine.protocol import requests as rq
from sess.engine.protocol.checkpoint_paths import CheckpointRef, check_name, parse_path
from sess.engine.protocol.errors import InvalidRequest, NotFound, SessError
from sess.engine.protocol.home import remove_dir
from sess.engine.runtime.checkpoints import checkpoint_files as ckpt
from sess.engine.runtime.checkpoints.checkpoint_lifecycle import owned_dir, readable_session
from sess.engine.runtime.models.model_host import ModelHost
from sess.engine.runtime.runtime import Runtime
from sess.engine.runtime.session import Session, adamw_step_dtype


def checkpoint_dir(runtime: Runtime, owner: str, path: str) -> Path:
    """The directory of checkpoint ``path`` for reading: ``owner``'s own, or a published one
    (NotFound for another key's private checkpoint)."""
    ref = parse_path(path)
    readable_session(runtime, owner, ref)
    directory = ref.directory(runtime.home)
    if not directory.exists():
        raise NotFound(f"checkpoint {ref.uri} not found")
    return directory


def checkpoint_files(runtime: Runtime, owner: str, request: rq.CheckpointPath) -> list[tuple[str, Path]]:
    return ckpt.files(checkpoint_dir(runtime, owner, request.path))


def list_checkpoints(runtime: Runtime, owner: str, request: rq.ListCheckpoints) -> list[dict]:
    runtime.session(owner, request.session, live=False)
    found = []
    for ref in ckpt.saved(request.session, runtime.home):
        directory = ref.directory(runtime.home)
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        found.append({"path": ref.uri, "kind": ref.kind, "created": directory.stat().st_mtime, "bytes": size})
    return found


def delete_checkpoint(runtime: Runtime, owner: str, request: rq.DeleteCheckpoint) -> dict:
    """Delete one of ``owner``'s checkpoints (out of memory too, unless a request samples from it)."""
    ref = parse_path(request.path)
    owned_dir(runtime, owner, request.path)
    host = runtime.hosts.get(runtime.session(owner, ref.session, live=False).base_model)
    if host is not None:
        host.release_checkpoints([ref.uri])
    ckpt.remove(ref, runtime.home)
    _share(runtime, host)
    return {"path": ref.uri}


def _share(runtime: Runtime, host: ModelHost) -> None:
    """Several ranks: the others hold the checkpoint adapters this rank holds now."""
    runtime.placement.share_samplers(host)


def _new_ref(session: Session, kind: str, name: str | None) -> CheckpointRef:
    session.saves += 1
    name = check_name(name, "name") if name else f"step{session.step:06d}-{session.saves:03d}"
    return CheckpointRef(session.name, kind, name)


def save_weights(runtime: Runtime, owner: str, request: rq.SaveWeights) -> dict:
    """Save the session's adapter for sampling (``merge``: as a merged model too).

    ``transient`` (unnamed, unmerged only): a ``sampler`` save, which the engine loads for sampling
    at once (the older ones leave memory, not the disk); ``released`` lists transient saves deleted
    now (none: they go when their session stops)."""
    session = runtime.session(owner, request.session)
    host = runtime.hosts[session.base_model]
    kind = "sampler" if request.transient else "merged" if request.merge else "weights"
    ref = _new_ref(session, kind, request.name)
    whole = whole_adapter(runtime, session, merge=request.merge)
    config = host.adapter_config(session.adapter)
    if request.merge:
        model_config = host.peft.get_base_model().config
        if whole.untie:
            model_config = _replace_config(model_config, tie_word_embeddings=False)
        ckpt.save_merged(
            ref,
            runtime.home,
            model_config,
            whole.merged,
            host.path,
            whole.state,
            config,
            owner=session.owner,
            base_model=session.base_model,
        )
    else:
        ckpt.save_weights(
            ref, runtime.home, whole.state, config, owner=session.owner, base_model=session.base_model
        )
    host.forget_checkpoint(ref.uri)  # a name saved again must not serve stale weights
    result = {"path": ref.uri}
    if request.transient:
        host.checkpoint_adapter(ref.uri, whole.state, config)  # its sampler needs no read from disk
        older = [r.uri for r in ckpt.saved(session.name, runtime.home, "sampler") if r.uri != ref.uri]
        host.release_checkpoints(older)  # from memory: one still sampled from stays until a later save
        result["released"] = []
    _share(runtime, host)
    return result


@dataclass
class WholeAdapter:
    """A session's adapter as files hold it: PEFT-keyed weights; AdamW moments and steps under the
    layout's own names (``optimizer``); the merged model's state (``merge``)."""

    state: dict[str, torch.Tensor]
    moments: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)
    merged: dict[str, torch.Tensor] | None = None
    untie: bool = False


def whole_adapter(runtime: Runtime, session: Session, *, optimizer: bool = False, merge: bool = False):
    """``session``'s adapter in whole tensors (:class:`WholeAdapter`). On an engine of several ranks
    each rank holds a shard: rank 0 announces the gather, every rank runs this (followers from
    their loop, :mod:`sess.engine.runtime.distributed.follower`) and joins each tensor's all-gather in the same order."""
    host = runtime.hosts[session.base_model]
    with runtime.placement.collecting(session, optimizer=optimizer, merge=merge) as full:
        return _whole_adapter(session, host, optimizer, merge, full)


def _whole_adapter(session: Session, host: ModelHost, optimizer: bool, merge: bool, full) -> WholeAdapter:
    """``full`` makes a tensor whole (several ranks: a DTensor's all-gather, in the same order on
    every rank; one rank: the tensor itself)."""
    # the merge first, while the adapter is gathered: reading a state dict (as get_state does) gives
    # FSDP2's LoRA modules their shards back
    merged, untie = host.merged_state(session.adapter, full) if merge else (None, False)
    whole = WholeAdapter({key: full(value) for key, value in host.get_state(session.adapter).items()})
    whole.merged, whole.untie = merged, untie
    if optimizer:  # each parameter's AdamW state
        for key, param in _canonical(session.params, session.adapter).items():
            state = session.optimizer.state.get(param, {})
            if state and float(state["step"]) > 0:  # a parameter never stepped has no state to save
                whole.moments[f"{key}.exp_avg"] = full(state["exp_avg"])
                whole.moments[f"{key}.exp_avg_sq"] = full(state["exp_avg_sq"])
                whole.steps[key] = float(state["step"])
    return whole


def drop_transient_samplers(runtime: Runtime, session: Session) -> list[str]:
    """A session that stops: its transient sampler saves leave the disk, and memory too but for one
    a request still samples from (that request finishes from memory; the adapter goes with a later
    release). Returns the paths deleted."""
    refs = ckpt.saved(session.name, runtime.home, "sampler")
    host = runtime.hosts.get(session.base_model)
    if host is not None:
        host.release_checkpoints([r.uri for r in refs])
        _share(runtime, host)
    for ref in refs:
        ckpt.remove(ref, runtime.home)
    return [ref.uri for ref in refs]


def checkpoint_sampler(runtime: Runtime, host: ModelHost, ref: CheckpointRef) -> str:
    """The adapter serving checkpoint ``ref`` for sampling, loaded from disk if need be."""
    if ref.uri in host.checkpoint_adapters:
        return host.checkpoint_adapters[ref.uri]
    try:
        directory = ckpt.adapter_dir(ref, runtime.home)
    except NotFound:
        if ref.kind != "sampler":
            raise
        raise NotFound(
            f"model_path: {ref.uri} was a transient sampler save, kept while its session lives; "
            "the session has stopped, so it is gone. Keep weights beyond a session with "
            "save_weights_for_sampler or save_weights_and_get_sampling_client(name=...)"
        ) from None
    state, config = ckpt.read_adapter(directory)
    return host.checkpoint_adapter(ref.uri, state, config)


def delete_checkpoints(runtime: Runtime, session: Session) -> None:
    """A deleted session's checkpoints: out of memory (unless a request samples from one) and off
    the disk."""
    host = runtime.hosts.get(session.base_model)
    if host is not None:
        prefix = f"sess://{session.name}/"
        host.release_checkpoints([uri for uri in host.checkpoint_adapters if uri.startswith(prefix)])
        _share(runtime, host)
    remove_dir(runtime.home / "checkpoints" / session.name)


def save_state(runtime: Runtime, owner: str, request: rq.SaveState) -> dict:
    session = runtime.session(owner, request.session)
    host = runtime.hosts[session.base_model]
    ref = _new_ref(session, "state", request.name)
    whole = whole_adapter(runtime, session, optimizer=True)
    meta = {
        "base_model": session.base_model,
        "lora": session.lora,
        "step": session.step,
        "param_steps": whole.steps,
        "format": 1,
    }
    config = host.adapter_config(session.adapter)
    ckpt.save_state(ref, runtime.home, whole.state, config, whole.moments, meta, owner=session.owner)
    session.saved_step = session.step
    return {"path": ref.uri}


def save_unsaved_state(runtime: Runtime, owner: str, name: str, reason: str) -> str | None:
    """Before live session ``name`` stops: save its state, AdamW included, under
    ``<reason>-step<N>-<k>``, unless it saved its state at its current step already (a state it
    was resumed from is another session's). The path saved, or None: a stop keeps the training for
    ``sess resume``."""
    session = runtime.find_session(owner, name)
    if session is None or not session.live or session.saved_step == session.step:
        return None
    saved = rq.SaveState(session=name, name=f"{reason}-step{session.step:06d}-{session.saves + 1:03d}")
    return save_state(runtime, owner, saved)["path"]


def save_before_stop(runtime: Runtime, owner: str, name: str) -> str | None:
    """:func:`save_unsaved_state` for a ``stop``: a save that fails (a full disk) keeps the session
    live and says so."""
    try:
        return save_unsaved_state(runtime, owner, name, "stop")
    except OSError as exc:
        raise SessError(
            f"session {name!r}: saving its state before it stops failed ({exc}), so it was not "
            "stopped; make room and stop it again, or delete it",
            status=507,
        ) from None


def load_state(runtime: Runtime, owner: str, request: rq.LoadState) -> dict:
    session = runtime.session(owner, request.session)
    host = runtime.hosts[session.base_model]
    adapter_state, _, moments, meta = ckpt.read_state(checkpoint_dir(runtime, owner, request.path))
    if meta["base_model"] != session.base_model or meta["lora"]["rank"] != session.lora["rank"]:
        raise InvalidRequest(
            f"path: {request.path} was saved from {meta['base_model']} rank {meta['lora']['rank']}, "
            f"this session is {session.base_model} rank {session.lora['rank']}"
        )
    if session.shard is not None:  # several ranks: every rank reads the files and loads its shards
        adapter_state = session.shard.parts(adapter_state, _canonical(session.params, session.adapter))
    try:
        host.set_state(session.adapter, adapter_state)
    except ValueError as exc:
        raise InvalidRequest(f"path: {exc}") from None
    session.new_optimizer()
    if request.with_optimizer:
        _load_moments(session, moments, meta)
        session.step = int(meta["step"])
    for param in session.trainable():
        param.grad = None
    return {"path": request.path}


def _load_moments(session: Session, moments: dict[str, torch.Tensor], meta: dict) -> None:
    """AdamW's state from a checkpoint: each parameter's, or with several ranks its shards."""
    canonical = _canonical(session.params, session.adapter)
    saved = [key for key in canonical if key in meta["param_steps"]]
    for key in saved:
        param, step = canonical[key], meta["param_steps"][key]
        if session.shard is None:  # into the flat buffers new_optimizer made (Session.flat)
            state = session.optimizer.state[param]
            state["step"] = torch.tensor(step, dtype=state["step"].dtype)
            state["exp_avg"].copy_(moments[f"{key}.exp_avg"])
            state["exp_avg_sq"].copy_(moments[f"{key}.exp_avg_sq"])
        else:  # as AdamW makes it at a parameter's first step, sharded as the parameter
            session.optimizer.state[param] = {
                "step": torch.tensor(step, dtype=adamw_step_dtype()),
                "exp_avg": session.shard.mine(moments[f"{key}.exp_avg"], param),
                "exp_avg_sq": session.shard.mine(moments[f"{key}.exp_avg_sq"], param),
            }


def _replace_config(config, **changes):
    config = type(config).from_dict(config.to_dict())
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def _canonical(params: dict[str, torch.nn.Parameter], adapter: str) -> dict[str, torch.nn.Parameter]:
    """Parameter names without the adapter name, the same for any session of one layout."""
    return {name.replace(f".{adapter}.", "."): p for name, p in params.items()}
