"""Who decodes sample requests: the engine's own continuous decode batch, or vLLM.

The runtime holds one :class:`Sampler`, chosen when it starts (:class:`~.runtime.Runtime`): a
:class:`BuiltinSampler` by default, or the :class:`~sess.engine.runtime.vllm.sampler.VllmSampler`
of an engine started with ``--sampler vllm``. The sampling and session ops call its methods and
never ask which sampler it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.sampling.decode_batch import SampleJob
from sess.engine.sampling.token_choice import StopChecker

if TYPE_CHECKING:
    from sess.engine.protocol import requests as rq
    from sess.engine.runtime.models.model_host import ModelHost
    from sess.engine.runtime.runtime import Runtime
    from sess.engine.runtime.session import Session

OnRows = Callable[[list | None, BaseException | None], None]  # SampleJob.on_done


class Sampler(Protocol):
    """What the ops ask of the engine's sampler."""

    def check_session(self, runtime: Runtime, base_model: str, lora: dict) -> None:
        """Refuse, at its creation, a session with LoRA settings ``lora`` this sampler cannot sample."""
        ...

    def job(
        self, host: ModelHost, request: rq.SampleRequest, adapter: str | None, on_done: OnRows, progress: Any
    ) -> SampleJob:
        """The job of a checked sample request through ``adapter`` (None: the base model)."""
        ...

    def submit(
        self,
        runtime: Runtime,
        host: ModelHost,
        request: rq.SampleRequest,
        job: SampleJob,
        session: Session | None,
    ) -> None:
        """Start ``job``: it finishes from the executor's decode loop (``runtime.batches``).
        ``session`` is the one the request is accounted to (None: the base model)."""
        ...

    def forget(self, session: str, batches: dict) -> None:
        """Session ``session`` was deleted."""
        ...

    def close(self) -> None:
        """The engine stops."""
        ...


class BuiltinSampler:
    """The engine's own sampler: each base model's continuous decode batch
    (:class:`~sess.engine.sampling.decode_batch.DecodeBatch`), which streams tokens as they are
    drawn and returns prompt logprobs from its prefill."""

    def check_session(self, runtime: Runtime, base_model: str, lora: dict) -> None:
        pass  # it samples any adapter the engine trains

    def job(
        self, host: ModelHost, request: rq.SampleRequest, adapter: str | None, on_done: OnRows, progress: Any
    ) -> SampleJob:
        params = request.sampling_params
        wants_prompt = request.include_prompt_logprobs or request.topk_prompt_logprobs
        return SampleJob(
            prompt=request.prompt,
            num_samples=request.num_samples,
            params=params,
            adapter=adapter,
            stopper=StopChecker(params.stop, host.eos_ids, host.tokenizer.decode),
            on_done=on_done,
            prompt_logprobs=(request.topk_prompt_logprobs or -1) if wants_prompt else 0,
            target=target_wire(request.target, host.name),
            progress=progress,
        )

    def submit(
        self,
        runtime: Runtime,
        host: ModelHost,
        request: rq.SampleRequest,
        job: SampleJob,
        session: Session | None,
    ) -> None:
        batch = runtime.batch(host)
        runtime.placement.spread_decoding(
            batch, host.name
        )  # several ranks decode: distributed/sample_spread.py
        batch.submit(job)

    def forget(self, session: str, batches: dict) -> None:
        pass  # nothing of a session outlives it here

    def close(self) -> None:
        pass


def target_wire(target: rq.Target, base_model: str) -> dict:
    """The request's target as another rank finds it: a session by name, a checkpoint by its path."""
    if target.session is not None:
        return {"session": target.session}
    if target.model_path is not None:
        return {"model_path": parse_path(target.model_path, field="model_path").uri}
    return {"base_model": base_model}
