"""Sampling ops: ``sample`` (joins its base model's continuous decode batch) and ``compute_logprobs``.

A target is a live session's current weights, a checkpoint (its adapter loaded once and kept, LRU
bounded) or a base model with no adapter. A sample request is checked at once and then finishes
from the decode loop: its callback runs on the executor thread when its last row is done. A request
with ``include_trainer_logprobs`` gets the trainer's logprobs of its sampled tokens there, before
it answers (:func:`add_trainer_logprobs`); without it, no extra pass. The engine's sampler (the
built-in decode batch or vLLM, :mod:`sess.engine.runtime.samplers`) makes and runs the request's job.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sess.engine.protocol import requests as rq
from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.types import SampleResponse, Usage
from sess.engine.runtime.batched_forward import prompt_logprobs
from sess.engine.runtime.checkpoints.checkpoint_lifecycle import readable_session
from sess.engine.runtime.models.model_host import ModelHost
from sess.engine.runtime.models.model_policy import model_name
from sess.engine.runtime.ops.checkpoint_ops import checkpoint_sampler
from sess.engine.runtime.prompt_scores import add_scores, keep_last_n, wants_scores
from sess.engine.runtime.runtime import Runtime
from sess.engine.runtime.session import Session

OnDone = Callable[[dict | None, BaseException | None, Usage], None]


def resolve_target(
    runtime: Runtime, owner: str, target: rq.Target
) -> tuple[ModelHost, str | None, Session | None]:
    """(host, adapter to sample through or None for the base model, session to account to or None)."""
    if target.session is not None:
        session = runtime.session(owner, target.session)
        return runtime.hosts[session.base_model], session.adapter, session
    if target.model_path is not None:
        ref = parse_path(target.model_path, field="model_path")
        # owner's, or another key's published one (its usage is the caller's: see usage.session_of)
        session = readable_session(runtime, owner, ref)
        host = runtime.host(session.base_model)
        adapter = checkpoint_sampler(runtime, host, ref)
        runtime.placement.share_samplers(host)  # several ranks: every rank holds it (sample_spread.py)
        return host, adapter, session
    return runtime.host(model_name(runtime.home, owner, target.base_model)), None, None


def start_sample(
    runtime: Runtime, owner: str, request: rq.SampleRequest, on_done: OnDone, progress=None
) -> None:
    """Check a sample request and add it to its base model's decode batch.

    Raises at once for bad input; later ``on_done(result_wire, error, usage)`` runs on the executor
    thread when the request's last row finishes, with the request's usage (:mod:`.usage`).
    ``progress`` hears each token as it is drawn and may cancel the request (:class:`SampleJob`);
    the vLLM sampler and rows decoded on other ranks report only at the end."""
    host, adapter, session = resolve_target(runtime, owner, request.target)
    params, prompt = request.sampling_params, request.prompt
    check_prompt(prompt, host.vocab_size)
    if request.target_prompt_logprobs is not None:
        ids = [t for row in request.target_prompt_logprobs for t in row if t != -1]
        check_prompt(ids, host.vocab_size, "target_prompt_logprobs")
    stop_ids = [s for s in params.stop if isinstance(s, int)] if isinstance(params.stop, list) else []
    check_prompt(stop_ids, host.vocab_size, "sampling_params.stop")
    check_window(len(prompt), params.max_tokens, host.max_context)

    def finished(sequences, error) -> None:
        response = SampleResponse(sequences=sequences, prompt_cache_hit_tokens=job.cached_tokens)
        try:
            if error is None and request.include_trainer_logprobs:
                job.seconds += add_trainer_logprobs(runtime, host, job.adapter, prompt, sequences)
            if error is None and wants_scores(request):
                started = time.perf_counter()
                with host.activate(job.adapter) as model:
                    add_scores(model, request, response, runtime.memory_budget)
                job.seconds += time.perf_counter() - started
        except Exception as exc:  # this request fails (the executor names an engine bug), not the step
            error = exc
        if error is not None:
            on_done(None, error, Usage(wall_time_s=job.seconds, operations=1))
            return
        if job.prompt_result is not None:
            logprobs, top = job.prompt_result
            last_n = request.prompt_logprobs_last_n
            response.prompt_logprobs = (
                keep_last_n(logprobs, last_n) if request.include_prompt_logprobs else None
            )
            response.topk_prompt_logprobs = keep_last_n(top, last_n)
        sampled = sum(len(s.tokens) for s in sequences)
        # the one place a sample's cached prompt tokens are counted: a part of its prompt's tokens
        usage = Usage(
            prefill_tokens=len(prompt),
            cached_prefill_tokens=job.cached_tokens,
            sampled_tokens=sampled,
            wall_time_s=job.seconds,
            operations=1,
        )
        on_done(response.to_wire(), None, usage)

    job = runtime.sampler.job(host, request, adapter, finished, progress)
    runtime.sampler.submit(runtime, host, request, job, session)


def add_trainer_logprobs(
    runtime: Runtime, host: ModelHost, adapter: str | None, prompt: list[int], sequences: list
) -> float:
    """Give each sampled sequence the trainer's logprobs of its tokens: one forward pass of prompt +
    tokens through the training path (:func:`prompt_logprobs`, as ``compute_logprobs``), through
    ``adapter`` as it is now. Runs on the executor thread as the request finishes, inside a decode
    step, where the weights are gathered already (several ranks). Returns the seconds it took."""
    started = time.perf_counter()
    with host.activate(adapter) as model:
        for sequence in sequences:
            if not sequence.tokens:
                sequence.trainer_logprobs = []
                continue
            logprobs, _ = prompt_logprobs(model, prompt + sequence.tokens, None, runtime.memory_budget)
            sequence.trainer_logprobs = logprobs[len(prompt) :]
    return time.perf_counter() - started


def compute_logprobs(runtime: Runtime, owner: str, request: rq.ComputeLogprobs) -> dict:
    """Each prompt token's logprob given the ones before it (the first is None)."""
    host, adapter, _ = resolve_target(runtime, owner, request.target)
    check_prompt(request.prompt, host.vocab_size)
    check_window(len(request.prompt), 0, host.max_context)
    runtime.full_weights()  # several ranks: loading a checkpoint's adapter may have dropped them
    with host.activate(adapter) as model:
        logprobs, _ = prompt_logprobs(model, request.prompt, None, runtime.memory_budget)
    return {"logprobs": keep_last_n(logprobs, request.prompt_logprobs_last_n)}


def check_prompt(prompt: list[int], vocab_size: int, where: str = "prompt") -> None:
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{where}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


def check_window(length: int, max_tokens: int, context: int) -> None:
    """Refuse a prompt of ``length`` tokens that, with ``max_tokens`` more, is over the model's
    context window of ``context`` tokens, naming the prompt's length."""
    if length > context:
        raise InvalidRequest(
            f"prompt: the prompt is too long: {length} tokens, over the model's context window of "
            f"{context} tokens; shorten it"
        )
    if length + max_tokens > context:
        raise InvalidRequest(
            f"sampling_params.max_tokens: a prompt of {length} tokens plus max_tokens {max_tokens} is "
            f"{length + max_tokens} tokens, over the model's context window of {context}; at most "
            f"{context - length} new tokens fit after this prompt"
        )
