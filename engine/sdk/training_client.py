"""``TrainingClient``: a live training session; its LoRA adapter and AdamW state live on the engine.

Each method that talks to the engine returns an :class:`~.futures.APIFuture` at once (and has an
``_async`` twin). The client stamps a sequence number on each op at call time; the engine runs a
session's ops in that order, so ``optim_step`` queued right after ``forward_backward`` applies its
gradients. ``forward_backward_custom`` runs a loss written in torch here, on the client, and is the
only method that imports torch.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from sess.engine.protocol import requests as rq
from sess.engine.protocol.errors import InvalidRequest, SessError
from sess.engine.protocol.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadStateResponse,
    LossFunction,
    ModelInput,
    OptimStepResponse,
    SaveStateResponse,
    SaveWeightsResponse,
)
from sess.engine.sdk.checkpoint_admin import needs_server
from sess.engine.sdk.futures import APIFuture, with_async_twins
from sess.engine.sdk.sampling_client import SamplingClient

if TYPE_CHECKING:
    import torch

    from sess.engine.sdk.service_client import ServiceClient

CustomLoss = Callable[[list[Datum], list["torch.Tensor"]], tuple["torch.Tensor", dict[str, float]]]


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


@with_async_twins(
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
        """The sequence number this client stamps on its next ordered op.

        Returns:
            An int; the engine runs a session's ordered ops in this order."""
        return self._seq

    def reserve_sequence_number(self) -> int:
        """Take the session's next sequence number for an op sent by other means (a raw HTTP
        request); this client's own later ops come after it, so that op must reach the engine for
        them to run."""
        with self._lock:
            self._seq += 1
            return self._seq

    def noop(self) -> APIFuture[dict]:
        """An ordered op that does nothing: its answer says every earlier op of the session ran
        (and its round trip is the engine's overhead per op)."""
        return self._ordered("noop", rq.Noop(session=self.name), lambda result: result)

    def _ordered(self, name: str, request: rq.SessionOp, convert: Callable) -> APIFuture:
        request.check()
        with self._lock:  # stamping and queueing under one lock keeps sequence numbers in send order
            self._seq += 1
            return self._send(name, request, convert, self._seq)

    def _send(self, name: str, request: rq.SessionOp, convert: Callable, seq: int) -> APIFuture:
        return self.service.submitter.submit(
            name, request.to_wire(), convert, session=self.name, seq=seq, client_token=uuid.uuid4().hex
        )

    def get_tokenizer(self):
        """The session's base model tokenizer (see :meth:`ServiceClient.get_tokenizer`).

        Returns:
            A ``transformers`` tokenizer."""
        return self.service.get_tokenizer(self.base_model)

    def forward(
        self, data, loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Per-token logprobs of ``data`` under the current weights, and the loss's metrics.

        Args:
            data: datums (or lists of token ids, scored as cross-entropy on every token).
            loss_fn: a built-in loss: ``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``,
                ``dro`` or ``gspo``.
            loss_fn_config: the loss's options (``clip_low_threshold``, ``beta``, ...); None: defaults.

        Returns:
            A future of a :class:`ForwardBackwardOutput`: per-datum logprobs and ``metrics["loss:sum"]``."""
        return self._training_op("forward", data, loss_fn, loss_fn_config)

    def forward_backward(
        self, data, loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """:meth:`forward`, and the loss's gradients added to the adapter's (token-sum losses).

        Args:
            data: datums (or lists of token ids, trained as cross-entropy on every token).
            loss_fn: a built-in loss, as for :meth:`forward`.
            loss_fn_config: the loss's options; None: defaults.

        Returns:
            A future of a :class:`ForwardBackwardOutput`; the gradients wait for :meth:`optim_step`."""
        return self._training_op("forward_backward", data, loss_fn, loss_fn_config)

    def _training_op(self, op: str, data, loss_fn, loss_fn_config) -> APIFuture[ForwardBackwardOutput]:
        loss_fn = loss_fn.value if isinstance(loss_fn, LossFunction) else loss_fn
        request = rq.ForwardRequest(
            session=self.name, data=to_datums(data), loss_fn=loss_fn, loss_fn_config=loss_fn_config
        )
        return self._ordered(op, request, ForwardBackwardOutput.from_wire)

    def forward_backward_custom(self, data, loss_fn: CustomLoss) -> APIFuture[ForwardBackwardOutput]:
        """Run ``loss_fn(data, logprobs)`` here, on logprobs from an engine forward pass, then send its
        gradient back as the per-token weights of a cross-entropy pass (same gradients, one round trip more).

        Args:
            data: datums.
            loss_fn: ``(data, logprobs) -> (loss, metrics)`` on torch tensors, one logprobs tensor per datum.

        Returns:
            A future of a :class:`ForwardBackwardOutput` with the custom loss's metrics."""
        import torch

        datums = to_datums(data)
        probe = [
            Datum(
                d.model_input,
                {
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    "weights": np.zeros(d.model_input.length, np.float32),
                }
                if "target_tokens" in d.loss_fn_inputs
                else {},
            )
            for d in datums
        ]
        forward_request = rq.ForwardRequest(session=self.name, data=probe)
        forward_request.check()
        with self._lock:  # reserve two consecutive sequence numbers: forward now, backward later
            forward_seq, backward_seq = self._seq + 1, self._seq + 2
            self._seq += 2
            forward = self._send("forward", forward_request, ForwardBackwardOutput.from_wire, forward_seq)
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
                self._send("noop", rq.Noop(session=self.name), lambda r: r, backward_seq)
                outer.set_exception(exc)
                return
            backward_data = [
                Datum(
                    d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": w.numpy()}
                )
                for d, w in zip(datums, weights)
            ]
            backward_request = rq.ForwardRequest(session=self.name, data=backward_data)
            backward = self._send(
                "forward_backward", backward_request, ForwardBackwardOutput.from_wire, backward_seq
            )

            def finish(b: APIFuture) -> None:
                error = b.exception()
                if error is not None:
                    outer.set_exception(error)
                    return
                result_metrics = {
                    "loss:sum": float(loss.detach()),
                    **{k: float(v) for k, v in metrics.items()},
                }
                outer.set_result(ForwardBackwardOutput(output.loss_fn_outputs, result_metrics))

            backward.add_done_callback(finish)

        forward.add_done_callback(after_forward)
        return outer

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradients with AdamW and clear them.

        Args:
            adam_params: learning rate, betas, eps, weight decay and gradient clipping; None: defaults.

        Returns:
            A future of an :class:`OptimStepResponse` (``metrics["grad_norm"]``)."""
        request = rq.OptimStep(session=self.name, adam_params=adam_params or AdamParams())
        return self._ordered("optim_step", request, OptimStepResponse.from_wire)

    def save_weights_for_sampler(
        self,
        description: str = "",
        merge_weights: bool = False,
        *,
        name: str | None = None,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """Save the adapter's weights for sampling (and download), kept until deleted or expired.

        Args:
            description: kept with the checkpoint.
            merge_weights: also save the base model with the adapter merged in.
            name: the checkpoint's name; None: one derived from the step.
            ttl_seconds: delete it this many seconds from now (1 s to 10 years); None: never.
            user_metadata: strings to strings, listed with it (``list_checkpoints``).

        Returns:
            A future of a :class:`SaveWeightsResponse` with its ``sess://<session>/sampler/<name>`` path."""
        self._lifecycle_fields(ttl_seconds, user_metadata)
        request = rq.SaveWeights(
            session=self.name,
            name=name,
            merge=merge_weights,
            ttl_seconds=ttl_seconds,
            user_metadata=user_metadata,
        )
        return self._ordered("save_weights", request, SaveWeightsResponse.from_wire)

    def save_state(
        self,
        description: str = "",
        *,
        name: str | None = None,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveStateResponse]:
        """Save everything needed to continue training: weights, AdamW moments, step count.

        Args:
            description: kept with the checkpoint.
            name: the checkpoint's name; None: one derived from the step.
            ttl_seconds: delete it this many seconds from now (1 s to 10 years); None: never.
            user_metadata: strings to strings, listed with it (``list_checkpoints``).

        Returns:
            A future of a :class:`SaveStateResponse` with its ``sess://<session>/state/<name>`` path."""
        self._lifecycle_fields(ttl_seconds, user_metadata)
        request = rq.SaveState(
            session=self.name, name=name, ttl_seconds=ttl_seconds, user_metadata=user_metadata
        )
        return self._ordered("save_state", request, SaveStateResponse.from_wire)

    def _lifecycle_fields(self, ttl_seconds, user_metadata) -> None:
        """A TTL or metadata is kept by an engine server's registry: refused for the in-process engine."""
        for field, value in (("ttl_seconds", ttl_seconds), ("user_metadata", user_metadata)):
            if value is not None:
                needs_server(self.service.transport, field)

    def load_state(self, path: str) -> APIFuture[LoadStateResponse]:
        """Load a state checkpoint's weights; the optimizer starts fresh.

        Args:
            path: a ``sess://<session>/state/<name>`` checkpoint of the same base model and rank.

        Returns:
            A future of a :class:`LoadStateResponse`."""
        request = rq.LoadState(session=self.name, path=path, with_optimizer=False)
        return self._ordered("load_state", request, LoadStateResponse.from_wire)

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadStateResponse]:
        """Load a state checkpoint's weights and AdamW moments and step count.

        Args:
            path: a ``sess://<session>/state/<name>`` checkpoint of the same base model and rank.

        Returns:
            A future of a :class:`LoadStateResponse`."""
        request = rq.LoadState(session=self.name, path=path, with_optimizer=True)
        return self._ordered("load_state", request, LoadStateResponse.from_wire)

    def save_weights_and_get_sampling_client(
        self, description: str = "", merge_weights: bool = False, *, name: str | None = None
    ) -> SamplingClient:
        """Save the current weights and return a sampler of them (waits for the save).

        Without ``name`` or ``merge_weights`` the save is transient, ``sess://<session>/sampler/...``:
        the engine keeps the session's newest three such saves and deletes older ones no request is
        sampling from, so a loop that publishes a sampler every step does not fill the disk. Give a
        ``name`` (or use :meth:`save_weights_for_sampler`) to keep the weights.

        Args:
            description: kept with a named checkpoint.
            merge_weights: also save the base model with the adapter merged in (a kept save).
            name: keep the save under this name.

        Returns:
            A :class:`SamplingClient` of the saved weights."""
        if name is None and not merge_weights:
            request = rq.SaveWeights(session=self.name, transient=True)
            future = self._ordered("save_weights", request, SaveWeightsResponse.from_wire)
        else:
            future = self.save_weights_for_sampler(description, merge_weights, name=name)
        return SamplingClient(self.service, rq.Target(model_path=future.result().path), self.base_model)

    def create_sampling_client(self, model_path: str | None = None) -> SamplingClient:
        """A sampler of ``model_path``, or (None) of this session's current weights as they change.

        Args:
            model_path: a ``sess://`` checkpoint; None: the session's live weights.

        Returns:
            A :class:`SamplingClient`."""
        target = rq.Target(model_path=model_path) if model_path else rq.Target(session=self.name)
        return SamplingClient(self.service, target, self.base_model)

    def stop(self) -> None:
        """Stop the session once every op this client sent has run; its unsaved training is saved
        first (:meth:`ServiceClient.stop_session`).

        Returns:
            None."""
        self._settle()
        self.service.stop_session(self.name)

    def delete(self) -> None:
        """Delete the session and its checkpoints (:meth:`ServiceClient.delete_session`), once
        every op this client sent has run.

        Returns:
            None."""
        self._settle()
        self.service.delete_session(self.name, stop_if_active=True)

    def _settle(self) -> None:
        """Wait until the session's earlier ops have run: a stop is not one of its ordered ops, and
        would otherwise overtake those still on their way or queued (a last ``optim_step`` whose
        future nobody read). Their errors stay with their futures."""
        try:
            self.noop().result()
        except SessError:  # a session that cannot run ops: the stop or delete answers for it
            pass

    def __enter__(self) -> TrainingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<TrainingClient {self.name} on {self.base_model}>"
