"""The engine and the session a run uses: the service client its config names, the training session
it opens (fresh, reused by name, or restored from a saved state), and what a finished run says about
the engine it leaves behind (still running, or stopped because the run started it)."""

from __future__ import annotations

import os
import secrets

from omegaconf import DictConfig

from sess.engine import ServiceClient
from sess.engine.sdk.local_engine import engine_info, memory_text, stop_engine

from .records import RunRecord


def service_client(engine_cfg) -> ServiceClient:
    if engine_cfg.kind == "inprocess":
        return ServiceClient("inproc")
    if engine_cfg.kind == "remote":
        return ServiceClient(engine_cfg.url, engine_cfg.api_key)
    return ServiceClient()  # local: the engine of SESS_HOME


def local_engine(cfg: DictConfig) -> dict | None:
    """The running local engine a run with ``cfg`` uses ({url, pid, rss_bytes, ...}), if any."""
    if cfg.engine.kind != "local" or os.environ.get("SESS_ENGINE_URL"):
        return None
    return engine_info()


def engine_note(cfg: DictConfig, was_running: bool, reached: bool = True) -> str:
    """What a finished run says about the engine it used: still running (and its memory, and how to
    stop it), or stopped because this run started it and ``engine.keep`` is false. Of a remote engine
    the run could not reach (``reached`` false) it says nothing: it does not know."""
    if cfg.engine.kind == "inprocess":
        return ""
    if cfg.engine.kind == "remote" or os.environ.get("SESS_ENGINE_URL"):
        if not reached:
            return ""
        return f"the engine at {cfg.engine.url or os.environ.get('SESS_ENGINE_URL')} keeps running"
    info = engine_info()
    if info is None:
        return "the local engine is not running"
    if not was_running and not cfg.engine.keep:
        stop_engine()
        return f"stopped the local engine this run started (pid {info['pid']}; engine.keep=false)"
    memory = f"; {memory_text(info)}" if info.get("rss_bytes") else ""
    return (
        f"the local engine {info['url']} (pid {info['pid']}) is still running{memory}; the next run "
        f"reuses it. It stops sessions idle for {info['idle_timeout']:.0f} s but keeps the process: "
        "stop it with `sess engine down`, or run with engine.keep=false"
    )


def open_session(svc: ServiceClient, cfg: DictConfig, record: RunRecord, resume_from: str | None):
    # Run folders are unique per runs_dir only; one engine serves many folders, so add a tag.
    tag = secrets.token_hex(2)
    if resume_from is not None:
        name = f"{record.path.name}-r{len(record.meta.get('resumes', []))}-{tag}"
        return svc.create_training_client_from_state_with_optimizer(resume_from, training_session_name=name)
    name = str(cfg.session or f"{record.path.name}-{tag}")
    if cfg.session:
        same = [s for s in svc.list_sessions(name_contains=name) if s.name == name]
        if same and same[0].status.value == "Running":
            return svc.get_training_client(name)
        if same:
            raise ValueError(
                f"session {name!r} is {same[0].status.value}; a run needs a new name or a Running session "
                f"(`sess resume {name}` continues it)"
            )
    lora = cfg.model.lora
    return svc.create_lora_training_client(
        cfg.model.base_model,
        rank=lora.rank,
        alpha=lora.alpha,
        training_session_name=name,
        seed=int(cfg.seed),
        train_attn=lora.train_attn,
        train_mlp=lora.train_mlp,
        train_unembed=lora.train_unembed,
        user_metadata={"run_dir": str(record.path)},
    )
