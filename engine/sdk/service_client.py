"""The SDK's entry point: ``ServiceClient`` finds or starts an engine and makes the other clients.

``ServiceClient()`` talks to the local engine of ``SESS_HOME`` (started in the background when none
runs), ``ServiceClient("http://host:port", api_key=...)`` to a remote one, and
``ServiceClient("inproc")`` to an engine inside this Python process. ``SESS_ENGINE_URL`` and
``SESS_API_KEY`` fill in what is not given. Inputs are checked here, with the same typed requests
the engine reads (:mod:`.requests`), before anything leaves the client.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from sess.engine.protocol import requests as rq
from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.types import SessionStatus, TrainingSessionSummary, Usage
from sess.engine.sdk.checkpoint_admin import CheckpointAdmin
from sess.engine.sdk.futures import Submitter
from sess.engine.sdk.http_transport import HttpTransport
from sess.engine.sdk.local_engine import engine_gone_probe, ensure_local_engine
from sess.engine.sdk.sampling_client import SamplingClient
from sess.engine.sdk.training_client import TrainingClient
from sess.engine.sdk.transport import Transport, in_process_transport

# transformers resolves its names lazily (``_LazyModule``), and two threads resolving
# ``AutoTokenizer`` at once can fail with "cannot import name 'AutoTokenizer'"; every tokenizer the SDK
# loads goes through ``load_tokenizer``, which imports and loads under this one process-wide lock.
_TRANSFORMERS_LOCK = threading.Lock()


def load_tokenizer(directory: str | os.PathLike):
    """``AutoTokenizer.from_pretrained(directory)``, safe to call from any thread at any time."""
    with _TRANSFORMERS_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)


class ServiceClient(CheckpointAdmin):
    """Entry point: finds or starts an engine and creates training and sampling clients; checkpoint
    TTLs, publishing, copies, traces, storage and the audit log are :class:`.CheckpointAdmin`'s."""

    def __init__(
        self, url: str | None = None, api_key: str | None = None, *, home: str | os.PathLike | None = None
    ):
        url = url or os.environ.get("SESS_ENGINE_URL") or "local"
        api_key = api_key or os.environ.get("SESS_API_KEY")
        gone = None
        if url == "local":  # the engine of SESS_HOME, started in the background if none runs
            url = ensure_local_engine(home)
            gone = engine_gone_probe(home)
        self.url = url
        if url == "inproc":
            self.transport: Transport = in_process_transport(home, owner=api_key or "local")
        else:
            self.transport = HttpTransport(url, api_key=api_key, home=home, gone=gone)
        self.submitter = Submitter(self.transport)  # sends this client's ops and its sessions' in call order
        self._tokenizers: dict[str, Any] = {}
        self._tokenizer_lock = threading.Lock()

    def _call(self, name: str, request: rq.Request) -> Any:
        request.check()
        return self.transport.call(name, request.to_wire())

    # models and sessions ---------------------------------------------------------------------------
    def list_base_models(self) -> list[str]:
        """The base models this engine can load.

        Returns:
            Their names (``smollm2-135m``, ``tiny-llama``, ...), for ``create_lora_training_client``."""
        return self._call("list_base_models", rq.NoArgs())

    def get_context_windows(self) -> dict[str, int | None]:
        """Each base model's context window: the most tokens a sequence (prompt and answer) may hold.

        Returns:
            ``{name: tokens}`` for every model of :meth:`list_base_models`; None where the engine
            would know only by loading the model (a hub id it has not loaded)."""
        return self._call("model_windows", rq.NoArgs())

    def create_lora_training_client(
        self,
        base_model: str,
        *,
        rank: int = 32,
        alpha: float = 64,
        training_session_name: str | None = None,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict | None = None,
    ) -> TrainingClient:
        """Start a training session: a fresh LoRA adapter on ``base_model``.

        Args:
            base_model: a name from :meth:`list_base_models`.
            rank: the LoRA rank.
            alpha: the LoRA alpha (the update is scaled by ``alpha / rank``).
            training_session_name: the session's name; None: the engine picks one.
            seed: seeds the adapter's initialisation (None: random).
            train_mlp: wrap the MLP projections.
            train_attn: wrap the attention projections.
            train_unembed: wrap the output layer.
            user_metadata: kept with the session and shown by ``list_sessions``.

        Returns:
            A :class:`TrainingClient` of the new, running session."""
        request = rq.CreateSession(
            base_model=base_model,
            name=training_session_name,
            rank=rank,
            alpha=alpha,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
            user_metadata=user_metadata,
        )
        summary = self._call("create_session", request)
        return TrainingClient(self, summary["name"], summary["base_model"], next_seq=1)

    def create_training_client_from_state(
        self, path: str, *, training_session_name: str | None = None
    ) -> TrainingClient:
        """A session whose adapter starts from the weights of a state checkpoint (fresh optimizer).

        Args:
            path: a ``sess://SESSION/state/NAME`` checkpoint of one of this key's sessions.
            training_session_name: the session's name (None: the engine picks one from the model's
                name). SESSION's own name, while SESSION is stopped, continues SESSION itself.

        Returns:
            A :class:`TrainingClient` of the session."""
        return self._from_state(path, training_session_name, with_optimizer=False)

    def create_training_client_from_state_with_optimizer(
        self, path: str, *, training_session_name: str | None = None
    ) -> TrainingClient:
        """A session that continues a state checkpoint: weights, AdamW moments and step count.

        Args:
            path: a ``sess://SESSION/state/NAME`` checkpoint of one of this key's sessions.
            training_session_name: the session's name (None: the engine picks one from the model's
                name). SESSION's own name, while SESSION is stopped, continues SESSION itself: the
                same name, usage and checkpoints (what ``sess resume SESSION`` does).

        Returns:
            A :class:`TrainingClient` of the session, whose next ``optim_step`` continues the old one."""
        return self._from_state(path, training_session_name, with_optimizer=True)

    def _from_state(self, path: str, name: str | None, *, with_optimizer: bool) -> TrainingClient:
        request = rq.CreateSessionFromState(path=path, name=name, with_optimizer=with_optimizer)
        summary = self._call("create_session_from_state", request)
        return TrainingClient(self, summary["name"], summary["base_model"], next_seq=1)

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient:
        """A sampler of saved adapter weights or of a bare base model.

        Args:
            model_path: a ``sess://<session>/sampler/<name>`` (or state) checkpoint.
            base_model: a name from :meth:`list_base_models`, sampled without an adapter; given
                with ``model_path``, it must be that checkpoint's base model (then the checkpoint
                is sampled).

        Returns:
            A :class:`SamplingClient`."""
        if model_path is None and base_model is None:
            raise InvalidRequest("create_sampling_client: give model_path or base_model")
        if model_path is not None:
            parse_path(model_path, field="model_path")
            info = self._call("checkpoint_info", rq.CheckpointPath(path=model_path))  # own, or published
            if base_model is not None:
                named = self._call("model_info", rq.ModelInfo(base_model=base_model))["base_model"]
                if named != info["base_model"]:
                    raise InvalidRequest(
                        f"base_model, model_path: base_model {base_model!r} is not the base model of "
                        f"model_path {model_path!r} ({info['base_model']}); give the checkpoint's or omit it"
                    )
            return SamplingClient(self, rq.Target(model_path=model_path), info["base_model"])
        if base_model not in self.list_base_models():
            raise InvalidRequest(f"base_model: unknown model {base_model!r}; see list_base_models()")
        return SamplingClient(self, rq.Target(base_model=base_model), base_model)

    def get_training_client(self, training_session_name: str) -> TrainingClient:
        """Re-attach to a live session (its sequence numbers continue where they are).

        Args:
            training_session_name: the name of a Running session of this key.

        Returns:
            A :class:`TrainingClient` whose ops queue behind the session's earlier ones."""
        info = self._call("session_info", rq.SessionName(name=training_session_name))
        if info["status"] != SessionStatus.Running.value:
            raise InvalidRequest(
                f"session {training_session_name!r} is {info['status']}; resume it to continue "
                f"(sess resume {training_session_name}, or create_training_client_from_state_with_optimizer"
                f"(path, training_session_name={training_session_name!r}))"
            )
        return TrainingClient(self, info["name"], info["base_model"], next_seq=info["next_seq"])

    def list_sessions(
        self,
        *,
        name_contains: str | None = None,
        status_equals: str | SessionStatus | None = None,
        max_results: int | None = None,
    ) -> list[TrainingSessionSummary]:
        """The sessions of this key, oldest first.

        Args:
            name_contains: only sessions whose name contains this.
            status_equals: only sessions in this status (``Running``, ``Stopped``, ...).
            max_results: at most this many.

        Returns:
            One :class:`TrainingSessionSummary` per session."""
        status = status_equals.value if isinstance(status_equals, SessionStatus) else status_equals
        request = rq.ListSessions(name_contains=name_contains, status_equals=status, max_results=max_results)
        return [TrainingSessionSummary.from_wire(s) for s in self._call("list_sessions", request)]

    def stop_session(self, name: str) -> TrainingSessionSummary:
        """Stop a session and free its memory. If it trained since its last ``save_state``, the
        engine saves its state first (``sess://NAME/state/stop-step...``), so ``sess resume`` continues it.

        Args:
            name: the session.

        Returns:
            Its :class:`TrainingSessionSummary`, now stopped."""
        return TrainingSessionSummary.from_wire(self._call("stop_session", rq.SessionName(name=name)))

    def delete_session(self, name: str, *, stop_if_active: bool = False) -> TrainingSessionSummary:
        """Forget a session and delete its checkpoints, files included; download any you want to
        keep first. A running session is refused unless ``stop_if_active``.

        Args:
            name: the session.
            stop_if_active: stop a running session first instead of refusing.

        Returns:
            Its last :class:`TrainingSessionSummary`."""
        request = rq.DeleteSession(name=name, stop_if_active=stop_if_active)
        return TrainingSessionSummary.from_wire(self._call("delete_session", request))

    def get_usage(self, name: str | None = None) -> Usage:
        """What a session (or all of this key's sessions) has used: operations, tokens, seconds.

        Args:
            name: the session; None: every session of this key, summed.

        Returns:
            A :class:`Usage`."""
        return Usage.from_wire(self._call("get_usage", rq.GetUsage(name=name)))

    def list_checkpoints(self, name: str) -> list[dict]:
        """A session's checkpoints.

        Args:
            name: the session.

        Returns:
            One dict per checkpoint: its ``sess://`` ``path``, ``kind``, ``created`` (a Unix time),
            ``bytes``, and from an engine server ``expires_at`` (a Unix time, or None: kept until
            deleted), ``user_metadata`` and ``public``."""
        return self._call("list_checkpoints", rq.ListCheckpoints(session=name))

    def download_checkpoint(self, path: str, dest_dir: str | os.PathLike) -> Path:
        """Copy a sess:// checkpoint's files into ``dest_dir`` (created) and return that directory.

        Args:
            path: a ``sess://<session>/<kind>/<name>`` checkpoint.
            dest_dir: where its files go (safetensors and the adapter config).

        Returns:
            ``dest_dir`` as a :class:`~pathlib.Path`."""
        parse_path(path)
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        return self.transport.download(path, dest)

    def get_tokenizer(self, base_model: str):
        """The base model's tokenizer (a ``transformers`` tokenizer, built from the engine's files).

        Safe to call from many threads at once: each model's tokenizer is built once per client.

        Args:
            base_model: a name from :meth:`list_base_models`.

        Returns:
            The tokenizer, cached per base model by this client."""
        with self._tokenizer_lock:
            if base_model not in self._tokenizers:
                files = self._call("tokenizer_files", rq.TokenizerFiles(base_model=base_model))
                # the tokenizer reads its files once, at load: they need not outlive it
                with tempfile.TemporaryDirectory(prefix="sess-tokenizer-") as directory:
                    for name, text in files.items():
                        (Path(directory) / Path(name).name).write_text(text)
                    self._tokenizers[base_model] = load_tokenizer(directory)
            return self._tokenizers[base_model]

    def close(self) -> None:
        """Close the connection to the engine (an in-process engine keeps running for other clients).

        Returns:
            None."""
        self.submitter.close()
        self.transport.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
