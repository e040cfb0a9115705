"""Checkpoint ops of the runtime: save sampler weights (PEFT or merged), save and load state.

A mixin of :class:`sess.engine.runtime.Runtime`, kept apart so each file reads in one sitting.
Paths are ``sess://<session>/<kind>/<name>``; a checkpoint of another key's session is not found.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import checkpoints as ckpt
from .paths import remove_dir
from .types import InvalidRequest, NotFound

if TYPE_CHECKING:
    from .runtime import Session


class CheckpointOps:
    def _checkpoint_dir(self, owner: str, path: str) -> Path:
        ref = ckpt.parse_path(path)
        self.session(owner, ref.session, live=False)  # another key's checkpoint is not found
        directory = ref.directory(self.home)
        if not directory.exists():
            raise NotFound(f"checkpoint {ref.uri} not found")
        return directory

    def checkpoint_files(self, owner: str, path: str) -> list[tuple[str, Path]]:
        directory = self._checkpoint_dir(owner, path)
        return [(str(f.relative_to(directory)), f) for f in sorted(directory.rglob("*")) if f.is_file()]

    def list_checkpoints(self, owner: str, session: str) -> list[dict]:
        self.session(owner, session, live=False)
        found = []
        for ref in ckpt.saved(session, self.home):
            directory = ref.directory(self.home)
            size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
            found.append(
                {"path": ref.uri, "kind": ref.kind, "created": directory.stat().st_mtime, "bytes": size}
            )
        return found

    def _ref(self, session: Session, kind: str, name: str | None) -> ckpt.CheckpointRef:
        session.saves += 1
        name = ckpt.check_name(name, "name") if name else f"step{session.step:06d}-{session.saves:03d}"
        return ckpt.CheckpointRef(session.name, kind, name)

    def save_weights(
        self,
        owner: str,
        session: str,
        name: str | None = None,
        merge: bool = False,
        transient: bool = False,
    ) -> dict:
        """Save the session's adapter for sampling (``merge``: as a merged model too).

        ``transient`` (unnamed, unmerged only): a ``sampler`` save, which the engine loads for
        sampling at once and deletes once it is older than the session's newest
        :data:`~.checkpoints.KEEP_SAMPLERS`; ``released`` lists the paths deleted now."""
        started = time.perf_counter()
        if not isinstance(transient, bool):
            raise InvalidRequest(f"transient: expected true or false, got {transient!r}")
        if transient and (name is not None or merge):
            raise InvalidRequest("transient: a transient sampler save takes no name and no merge")
        session = self.session(owner, session)
        host = self.hosts[session.base_model]
        ref = self._ref(session, "sampler" if transient else "merged" if merge else "weights", name)
        state, config = host.get_state(session.adapter), host.adapter_config(session.adapter)
        if merge:
            merged, untie = host.merged_state(session.adapter)
            model_config = host.peft.get_base_model().config
            if untie:
                model_config = replace_config(model_config, tie_word_embeddings=False)
            ckpt.save_merged(ref, self.home, model_config, merged, host.path, state, config)
        else:
            ckpt.save_weights(ref, self.home, state, config)
        host.forget_checkpoint(ref.uri)  # a name saved again must not serve stale weights
        result = {"path": ref.uri}
        if transient:
            host.checkpoint_adapter(ref.uri, state, config)  # its sampler needs no read from disk
            result["released"] = self._release_samplers(session, host)
        self._account(session, started)
        return result

    def _release_samplers(self, session: Session, host) -> list[str]:
        """Delete the session's transient sampler saves beyond the newest KEEP_SAMPLERS, except
        those a request samples from (they go at a later save)."""
        older = ckpt.saved(session.name, self.home, "sampler")[: -ckpt.KEEP_SAMPLERS]
        in_use = host.release_checkpoints([ref.uri for ref in older])
        released = [ref for ref in older if ref.uri not in in_use]
        for ref in released:
            ckpt.remove(ref, self.home)
        return [ref.uri for ref in released]

    def _checkpoint_sampler(self, host, ref: ckpt.CheckpointRef) -> str:
        """The adapter serving checkpoint ``ref`` for sampling, loaded from disk if need be."""
        if ref.uri in host.checkpoint_adapters:
            return host.checkpoint_adapters[ref.uri]
        try:
            directory = ckpt.adapter_dir(ref, self.home)
        except NotFound:
            if ref.kind != "sampler":
                raise
            raise NotFound(
                f"model_path: {ref.uri} was a transient sampler save; the engine keeps a session's "
                f"newest {ckpt.KEEP_SAMPLERS} and deleted it. Keep weights with "
                "save_weights_for_sampler or save_weights_and_get_sampling_client(name=...)"
            ) from None
        state, config = ckpt.read_adapter(directory)
        return host.checkpoint_adapter(ref.uri, state, config)

    def _delete_checkpoints(self, session: Session) -> None:
        """A deleted session's checkpoints: out of memory (unless a request samples from one) and
        off the disk."""
        host = self.hosts.get(session.base_model)
        if host is not None:
            prefix = f"sess://{session.name}/"
            host.release_checkpoints([uri for uri in host.checkpoint_adapters if uri.startswith(prefix)])
        remove_dir(self.home / "checkpoints" / session.name)

    def save_state(self, owner: str, session: str, name: str | None = None) -> dict:
        started = time.perf_counter()
        session = self.session(owner, session)
        host = self.hosts[session.base_model]
        ref = self._ref(session, "state", name)
        moments, steps = {}, {}
        for key, param in _canonical(session.params, session.adapter).items():
            state = session.optimizer.state.get(param, {})
            if state:
                moments[f"{key}.exp_avg"], moments[f"{key}.exp_avg_sq"] = (
                    state["exp_avg"],
                    state["exp_avg_sq"],
                )
                steps[key] = float(state["step"])
        meta = {
            "base_model": session.base_model,
            "lora": session.lora,
            "step": session.step,
            "param_steps": steps,
            "format": 1,
        }
        ckpt.save_state(
            ref,
            self.home,
            host.get_state(session.adapter),
            host.adapter_config(session.adapter),
            moments,
            meta,
        )
        self._account(session, started)
        return {"path": ref.uri}

    def load_state(self, owner: str, session: str, path: str, with_optimizer: bool = False) -> dict:
        session = self.session(owner, session)
        host = self.hosts[session.base_model]
        adapter_state, _, moments, meta = ckpt.read_state(self._checkpoint_dir(owner, path))
        if meta["base_model"] != session.base_model or meta["lora"]["rank"] != session.lora["rank"]:
            raise InvalidRequest(
                f"path: {path} was saved from {meta['base_model']} rank {meta['lora']['rank']}, "
                f"this session is {session.base_model} rank {session.lora['rank']}"
            )
        try:
            host.set_state(session.adapter, adapter_state)
        except ValueError as exc:
            raise InvalidRequest(f"path: {exc}") from None
        session.optimizer = torch.optim.AdamW(list(session.params.values()), lr=1e-4, foreach=False)
        if with_optimizer:
            for key, param in _canonical(session.params, session.adapter).items():
                if key in meta["param_steps"]:
                    session.optimizer.state[param] = {
                        "step": torch.tensor(meta["param_steps"][key]),
                        "exp_avg": moments[f"{key}.exp_avg"].to(param.device).clone(),
                        "exp_avg_sq": moments[f"{key}.exp_avg_sq"].to(param.device).clone(),
                    }
            session.step = int(meta["step"])
        for param in session.params.values():
            param.grad = None
        return {"path": path}


def replace_config(config, **changes):
    config = type(config).from_dict(config.to_dict())
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def _canonical(params: dict[str, torch.nn.Parameter], adapter: str) -> dict[str, torch.nn.Parameter]:
    """Parameter names without the adapter name, the same for any session of one layout."""
    return {name.replace(f".{adapter}.", "."): p for name, p in params.items()}
