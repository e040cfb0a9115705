"""The SDK: ServiceClient -> TrainingClient -> SamplingClient, as API.md specifies.

Each method that talks to the engine returns an :class:`APIFuture` at once (and has an ``_async``
twin that returns the same future from a coroutine, so ``await (await tc.forward_backward_async(...))``
gives the result). A TrainingClient stamps a sequence number on each of its ops at call time; the
engine runs them in that order. Inputs are checked here before anything leaves the client.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .futures import APIFuture, Submitter
from .losses import check_data, check_loss_fn
from .transport import InProcessTransport, Transport, shared_engine
from .types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    InvalidRequest,
    LoadStateResponse,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveStateResponse,
    SaveWeightsResponse,
    TrainingSessionSummary,
    Usage,
)

CustomLoss = Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


def _asyncify(*names: str):
    """Add ``name_async`` coroutine twins that return the future of ``name``."""

    def decorate(cls):
        for name in names:

            def make(method_name):
                async def twin(self, *args, **kwargs):
                    return getattr(self, method_name)(*args, **kwargs)

                twin.__name__ = f"{method_name}_async"
                twin.__doc__ = f"Coroutine twin of :meth:`{method_name}`; awaits to its APIFuture."
                return twin

            setattr(cls, f"{name}_async", make(name))
        return cls

    return decorate


class ServiceClient:
    """Entry point: finds or starts an engine and creates training and sampling clients."""

    def __init__(
        self, url: str | None = None, api_key: str | None = None, *, home: str | os.PathLike | None = None
    ):
        url = url or os.environ.get("SESS_ENGINE_URL") or "local"
        api_key = api_key or os.environ.get("SESS_API_KEY")
        if url == "local":  # the engine of SESS_HOME, started in the background if none runs
            from .local import ensure_local_engine

            url = ensure_local_engine(home)
        self.url = url
        if url == "inproc":
            self.transport: Transport = InProcessTransport(shared_engine(home), owner=api_key or "local")
        else:
            from .http_transport import HttpTransport

            self.transport = HttpTransport(url, api_key=api_key, home=home)
        self._submitter = Submitter(self.transport)
        self._tokenizers: dict[str, Any] = {}
        self._tokenizer_lock = threading.Lock()

    # models and sessions ---------------------------------------------------------------------------
    def list_base_models(self) -> list[str]:
        return self.transport.call("list_base_models")

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
        summary = self.transport.call(
            "create_session",
            {
                "base_model": base_model,
                "name": training_session_name,
                "rank": rank,
                "alpha": alpha,
                "seed": seed,
                "train_mlp": train_mlp,
                "train_attn": train_attn,
                "train_unembed": train_unembed,
                "user_metadata": user_metadata,
            },
        )
        return TrainingClient(self, summary["name"], summary["base_model"], next_seq=1)

    def create_training_client_from_state(
        self, path: str, *, training_session_name: str | None = None
    ) -> TrainingClient:
        """A new session whose adapter starts from the weights of a state checkpoint (fresh optimizer)."""
        return self._from_state(path, training_session_name, with_optimizer=False)

    def create_training_client_from_state_with_optimizer(
        self, path: str, *, training_session_name: str | None = None
    ) -> TrainingClient:
        """A new session that continues a state checkpoint: weights, AdamW moments and step count."""
        return self._from_state(path, training_session_name, with_optimizer=True)

    def _from_state(self, path: str, name: str | None, *, with_optimizer: bool) -> TrainingClient:
        summary = self.transport.call(
            "create_session_from_state", {"path": path, "name": name, "with_optimizer": with_optimizer}
        )
        return TrainingClient(self, summary["name"], summary["base_model"], next_seq=1)

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient:
        if (model_path is None) == (base_model is None):
            raise InvalidRequest("create_sampling_client: give exactly one of model_path or base_model")
        if model_path is not None:
            info = self.transport.call("session_info", {"name": _session_of(model_path)})
            return SamplingClient(self, {"model_path": model_path}, info["base_model"])
        if base_model not in self.list_base_models():
            raise InvalidRequest(f"base_model: unknown model {base_model!r}; see list_base_models()")
        return SamplingClient(self, {"base_model": base_model}, base_model)

    def get_training_client(self, training_session_name: str) -> TrainingClient:
        """Re-attach to a live session (its sequence numbers continue where they are)."""
        info = self.transport.call("session_info", {"name": training_session_name})
        if info["status"] != "Running":
            raise InvalidRequest(
                f"session {training_session_name!r} is {info['status']}; resume it to continue"
            )
        return TrainingClient(self, info["name"], info["base_model"], next_seq=info["next_seq"])

    def list_sessions(
        self,
        *,
        name_contains: str | None = None,
        status_equals: str | None = None,
        max_results: int | None = None,
    ) -> list[TrainingSessionSummary]:
        status = getattr(status_equals, "value", status_equals)
        wire = self.transport.call(
            "list_sessions",
            {"name_contains": name_contains, "status_equals": status, "max_results": max_results},
        )
        return [TrainingSessionSummary.from_wire(s) for s in wire]

    def stop_session(self, name: str) -> TrainingSessionSummary:
        return TrainingSessionSummary.from_wire(self.transport.call("stop_session", {"name": name}))

    def delete_session(self, name: str, *, stop_if_active: bool = False) -> TrainingSessionSummary:
        """Forget a session and delete its checkpoints, files included; download any you want to
        keep first. A running session is refused unless ``stop_if_active``."""
        wire = self.transport.call("delete_session", {"name": name, "stop_if_active": stop_if_active})
        return TrainingSessionSummary.from_wire(wire)

    def get_usage(self, name: str | None = None) -> Usage:
        return Usage.from_wire(self.transport.call("get_usage", {"name": name}))

    def list_checkpoints(self, name: str) -> list[dict]:
        return self.transport.call("list_checkpoints", {"session": name})

    def download_checkpoint(self, path: str, dest_dir: str | os.PathLike) -> Path:
        """Copy a sess:// checkpoint's files into ``dest_dir`` (created) and return that directory."""
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        return self.transport.download(path, dest)

    def get_tokenizer(self, base_model: str):
        from transformers import AutoTokenizer

        with self._tokenizer_lock:
            if base_model not in self._tokenizers:
                files = self.transport.call("tokenizer_files", {"base_model": base_model})
                directory = Path(tempfile.mkdtemp(prefix="sess-tokenizer-"))
                for name, text in files.items():
                    (directory / name).write_text(text)
                self._tokenizers[base_model] = AutoTokenizer.from_pretrained(directory)
            return self._tokenizers[base_model]

    def close(self) -> None:
        self._submitter.close()
        self.transport.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _session_of(model_path: str) -> str:
    from .checkpoints import parse_path

    return parse_path(model_path, field="model_path").session


def to_datums(data: Any) -> list[Datum]:
    """Accept a list of Datum, one token-id list, or a list of token-id lists (-> cross_entropy, weight 1)."""
    if isinstance(data, Datum):
        return [data]
    if isinstance(data, list | tuple) and data and all(isinstance(t, int | np.integer) for t in data):
        data = [data]
    if not isinstance(data, list | tuple) or not data:
        raise InvalidRequest("data: expected a non-empty list of Datum or of token-id lists")
    datums = []
    for i, item in enumerate(data):
        if isinstance(item, Datum):
            datums.append(item)
        elif isinstance(item, list | tuple | ModelInput):
            tokens = item.to_ints() if isinstance(item, ModelInput) else [int(t) for t in item]
            if len(tokens) < 2:
                raise InvalidRequest(f"data[{i}]: a token list needs at least 2 tokens to predict one")
            datums.append(
                Datum(
                    model_input=ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.array(tokens[1:]),
                        "weights": np.ones(len(tokens) - 1, np.float32),
                    },
                )
            )
        else:
            raise InvalidRequest(f"data[{i}]: expected a Datum or a token-id list, got {type(item).__name__}")
    return datums


@_asyncify(
    "forward",
    "forward_backward",
    "forward_backward_custom",
    "optim_step",
    "save_weights_for_sampler",
    "save_state",
    "load_state",
    "load_state_with_optimizer",
)
class TrainingClient:
    """A live training session: its LoRA adapter and optimizer live on the engine."""

    def __init__(self, service: ServiceClient, name: str, base_model: str, *, next_seq: int):
        self.service = service
        self.name = name
        self.training_session_name = name
        self.base_model = base_model
        self._seq = next_seq - 1
        self._lock = threading.Lock()

    @property
    def current_sequence_number(self) -> int:
        return self._seq

    def _ordered(self, name: str, args: dict, convert: Callable) -> APIFuture:
        with self._lock:  # stamping and queueing under one lock keeps sequence numbers in send order
            self._seq += 1
            return self.service._submitter.submit(
                name, args, convert, session=self.name, seq=self._seq, client_token=uuid.uuid4().hex
            )

    def get_tokenizer(self):
        return self.service.get_tokenizer(self.base_model)

    def forward(
        self, data, loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._training_op("forward", data, loss_fn, loss_fn_config)

    def forward_backward(
        self, data, loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._training_op("forward_backward", data, loss_fn, loss_fn_config)

    def _training_op(self, op: str, data, loss_fn, loss_fn_config) -> APIFuture[ForwardBackwardOutput]:
        datums = to_datums(data)
        loss_fn, _ = check_loss_fn(loss_fn, loss_fn_config)
        check_data(datums, loss_fn)
        args = {"data": [d.to_wire() for d in datums], "loss_fn": loss_fn, "loss_fn_config": loss_fn_config}
        return self._ordered(op, args, ForwardBackwardOutput.from_wire)

    def forward_backward_custom(self, data, loss_fn: CustomLoss) -> APIFuture[ForwardBackwardOutput]:
        """Run ``loss_fn(data, logprobs)`` here, on logprobs from an engine forward pass, then send its
        gradient back as the per-token weights of a cross-entropy pass (same gradients, one round trip more)."""
        datums = to_datums(data)
        check_data(datums, "cross_entropy", require_targets=False)
        probe = [
            Datum(
                d.model_input,
                {
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    "weights": np.zeros(d.model_input.length, np.float32),
                },
            )
            for d in datums
        ]
        with self._lock:  # reserve two consecutive sequence numbers: forward now, backward later
            forward_seq, backward_seq = self._seq + 1, self._seq + 2
            self._seq += 2
            forward = self.service._submitter.submit(
                "forward",
                {"data": [d.to_wire() for d in probe], "loss_fn": "cross_entropy"},
                ForwardBackwardOutput.from_wire,
                session=self.name,
                seq=forward_seq,
                client_token=uuid.uuid4().hex,
            )
        outer: APIFuture[ForwardBackwardOutput] = APIFuture()

        def after_forward(done: APIFuture) -> None:
            try:
                output = done.result()
                logprobs = [o["logprobs"].to_torch().float().requires_grad_() for o in output.loss_fn_outputs]
                loss, metrics = loss_fn(datums, logprobs)
                loss.backward()
                weights = [
                    (-lp.grad if lp.grad is not None else torch.zeros_like(lp)).detach() for lp in logprobs
                ]
            except BaseException as exc:
                self.service._submitter.submit("noop", {}, lambda r: r, session=self.name, seq=backward_seq)
                outer._future.set_exception(exc)
                return
            backward_data = [
                Datum(
                    d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": w.numpy()}
                )
                for d, w in zip(datums, weights)
            ]
            backward = self.service._submitter.submit(
                "forward_backward",
                {"data": [d.to_wire() for d in backward_data], "loss_fn": "cross_entropy"},
                ForwardBackwardOutput.from_wire,
                session=self.name,
                seq=backward_seq,
                client_token=uuid.uuid4().hex,
            )

            def finish(b: APIFuture) -> None:
                error = b.exception()
                if error is not None:
                    outer._future.set_exception(error)
                else:
                    result_metrics = {
                        "loss:sum": float(loss.detach()),
                        **{k: float(v) for k, v in metrics.items()},
                    }
                    outer._future.set_result(ForwardBackwardOutput(output.loss_fn_outputs, result_metrics))

            backward.add_done_callback(finish)

        forward.add_done_callback(after_forward)
        return outer

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        adam_params = adam_params or AdamParams()
        adam_params.validate()
        return self._ordered(
            "optim_step", {"adam_params": adam_params.to_wire()}, OptimStepResponse.from_wire
        )

    def save_weights_for_sampler(
        self, description: str = "", merge_weights: bool = False, *, name: str | None = None
    ) -> APIFuture[SaveWeightsResponse]:
        return self._ordered(
            "save_weights", {"name": name, "merge": merge_weights}, SaveWeightsResponse.from_wire
        )

    def save_state(self, description: str = "", *, name: str | None = None) -> APIFuture[SaveStateResponse]:
        return self._ordered("save_state", {"name": name}, SaveStateResponse.from_wire)

    def load_state(self, path: str) -> APIFuture[LoadStateResponse]:
        """Load a state checkpoint's weights; the optimizer starts fresh."""
        return self._ordered(
            "load_state", {"path": path, "with_optimizer": False}, LoadStateResponse.from_wire
        )

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadStateResponse]:
        return self._ordered(
            "load_state", {"path": path, "with_optimizer": True}, LoadStateResponse.from_wire
        )

    def save_weights_and_get_sampling_client(
        self, description: str = "", merge_weights: bool = False, *, name: str | None = None
    ) -> SamplingClient:
        """Save the current weights and return a sampler of them (waits for the save).

        Without ``name`` or ``merge_weights`` the save is transient, ``sess://<session>/sampler/...``:
        the engine keeps the session's newest three such saves and deletes older ones no request is
        sampling from, so a loop that publishes a sampler every step does not fill the disk. Give a
        ``name`` (or use :meth:`save_weights_for_sampler`) to keep the weights."""
        if name is None and not merge_weights:
            future = self._ordered(
                "save_weights",
                {"name": None, "merge": False, "transient": True},
                SaveWeightsResponse.from_wire,
            )
        else:
            future = self.save_weights_for_sampler(description, merge_weights, name=name)
        return SamplingClient(self.service, {"model_path": future.result().path}, self.base_model)

    def create_sampling_client(self, model_path: str | None = None) -> SamplingClient:
        """A sampler of ``model_path``, or (None) of this session's current weights as they change."""
        target = {"model_path": model_path} if model_path else {"session": self.name}
        return SamplingClient(self.service, target, self.base_model)

    def stop(self) -> None:
        self.service.transport.call("stop_session", {"name": self.name})

    def delete(self) -> None:
        self.service.transport.call("delete_session", {"name": self.name, "stop_if_active": True})

    def __enter__(self) -> TrainingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<TrainingClient {self.name} on {self.base_model}>"


@_asyncify("sample", "compute_logprobs")
class SamplingClient:
    """Samples from a checkpoint, a live session's weights, or the base model (adapter off)."""

    def __init__(self, service: ServiceClient, target: dict, base_model: str):
        self.service = service
        self.target = target
        self.base_model = base_model
        self.model_path = target.get("model_path")

    def get_tokenizer(self):
        return self.service.get_tokenizer(self.base_model)

    def _prompt(self, prompt) -> list[int]:
        if isinstance(prompt, ModelInput):
            return prompt.to_ints()
        if isinstance(prompt, str):
            return list(self.get_tokenizer().encode(prompt))
        if isinstance(prompt, Sequence) and all(isinstance(t, int | np.integer) for t in prompt):
            return [int(t) for t in prompt]
        raise InvalidRequest("prompt: expected a ModelInput, a list of token ids or a string")

    def sample(
        self,
        prompt,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        *,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int | None = None,
    ) -> APIFuture[SampleResponse]:
        params = sampling_params or SamplingParams()
        params.validate()
        if not isinstance(num_samples, int) or num_samples < 1:
            raise InvalidRequest(f"num_samples: expected a positive integer, got {num_samples!r}")
        args = {
            "target": self.target,
            "prompt": self._prompt(prompt),
            "num_samples": num_samples,
            "sampling_params": params.to_wire(),
            "include_prompt_logprobs": include_prompt_logprobs,
            "topk_prompt_logprobs": topk_prompt_logprobs,
        }
        return self.service._submitter.submit("sample", args, SampleResponse.from_wire)

    def compute_logprobs(self, prompt) -> APIFuture[list[float | None]]:
        args = {"target": self.target, "prompt": self._prompt(prompt)}
        return self.service._submitter.submit("compute_logprobs", args, lambda r: r["logprobs"])

    def stop(self) -> None:
        """Release this client; checkpoints it sampled from stay on the engine."""

    def __repr__(self) -> str:
        return f"<SamplingClient {self.target}>"
