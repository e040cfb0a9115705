"""The routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

A request is read into a plan (:mod:`.requests`, every field checked against :mod:`.fields`), its
model resolved (:func:`resolve_model`), its prompts tokenized and checked against the model's context,
and each prompt becomes one ordinary ``sample`` op, all submitted before any is awaited so they join
one decode batch; they are bounded and accounted like any other op, and the ``usage`` block counts the
same prompt and sampled tokens. An echo with ``max_tokens: 0`` is a ``compute_logprobs`` op instead.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from sess.engine.protocol.errors import InvalidRequest, NotFound, SessError
from sess.engine.protocol.requests import Target
from sess.engine.protocol.types import SessionStatus
from sess.engine.runtime.models.catalog import list_models
from sess.engine.runtime.ops.sampling_ops import check_prompt, resolve_target
from sess.engine.runtime.session_names import client_view, engine_name, engine_path
from sess.engine.server.openai import live, streaming
from sess.engine.server.openai.answers import answer, choices_of, usage_block
from sess.engine.server.openai.requests import Plan, read_plan
from sess.engine.server.settings import MAX_BODY_BYTES

SAMPLE_TIMEOUT_S = 600.0
# a body past this cannot be a prompt the engine's models hold (1024 prompts of 4,096 token ids fit)
MAX_OPENAI_BODY_BYTES = min(MAX_BODY_BYTES, 32 << 20)
# the engine's names for what an OpenAI client sent, as its error messages start with them
CLIENT_NAMES = {"num_samples:": "n:", "sampling_params.": ""}


def resolve_model(engine, owner: str, model: str) -> dict:
    """The sample op's target for an OpenAI ``model``: a sess:// checkpoint, a live session of this key,
    or a base model of the catalog."""
    if model.startswith("sess://"):  # the caller's own checkpoint (session_names.py), or a published one
        return {"model_path": engine_path(engine.runtime, owner, model)}
    if engine.runtime.find_session(owner, model) is not None:
        return {"session": model}
    if model in list_models(engine.runtime.home):
        return {"base_model": model}
    raise NotFound(f"model: {model!r} is not a live session, a checkpoint or a base model of this key")


def _prepare(engine, owner: str, target: dict, plan: Plan):
    """On the executor: the tokenizer and each prompt as token ids, checked against the model."""

    def run(runtime):
        host, _, _ = resolve_target(runtime, owner, Target.from_wire(target, "model"))
        tokenizer = host.tokenizer
        prompts = []
        for i, prompt in enumerate(plan.prompts):
            where = f"prompt[{i}]" if len(plan.prompts) > 1 else "prompt"
            if plan.chat:
                try:
                    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
                except Exception as exc:  # the model's template refuses these messages (jinja raises)
                    raise InvalidRequest(f"messages: the model's chat template refused them: {exc}") from None
                ids, where = list(tokenizer.encode(text, add_special_tokens=False)), "messages"
            elif isinstance(prompt, str):
                ids = list(tokenizer.encode(prompt))
            else:
                ids = prompt
                check_prompt(ids, host.vocab_size, where)
            room = host.max_context - (0 if plan.max_tokens == 0 else 1)
            if len(ids) > room:
                raise InvalidRequest(
                    f"{where}: {len(ids)} tokens is over the model's context of {host.max_context} tokens"
                    + ("" if plan.max_tokens == 0 else ", leaving no room to sample")
                )
            if plan.echo and plan.logprobs is not None and len(ids) < 2 and plan.max_tokens == 0:
                raise InvalidRequest(
                    f"{where}: a prompt of one token has no logprobs to echo; sample a token"
                )
            prompts.append(ids)
        return tokenizer, prompts

    return engine.run(run, owner=owner)


def _as_sent(exc: SessError) -> SessError:
    """``exc`` with the engine's field names replaced by the ones the OpenAI client sent."""
    message = str(exc)
    for ours, theirs in CLIENT_NAMES.items():
        if message.startswith(ours):
            return type(exc)(theirs + message[len(ours) :], status=exc.status)
    return exc


def _op(target: dict, plan: Plan, ids: list[int]) -> tuple[str, dict]:
    if plan.max_tokens == 0:
        return "compute_logprobs", {"target": target, "prompt": ids}
    k, scores_prompt = plan.logprobs, plan.echo and plan.logprobs is not None and len(ids) > 1
    return "sample", {
        "target": target,
        "prompt": ids,
        "num_samples": plan.n,
        "sampling_params": plan.params.to_wire(),
        "include_prompt_logprobs": scores_prompt,
        "topk_prompt_logprobs": k if scores_prompt and k else None,
        "topk_sample_logprobs": k or None,
    }


def _submit(
    engine, owner: str, target: dict, plan: Plan, prompts: list[list[int]], progresses=None
) -> list[str]:
    """One op per prompt, all submitted before any is awaited (so they share decode steps)."""
    try:
        return [
            engine.submit(owner, *_op(target, plan, ids), progress=progresses[i] if progresses else None)
            for i, ids in enumerate(prompts)
        ]
    except SessError as exc:
        raise _as_sent(exc) from None


async def _wait(engine, owner: str, op_ids: list[str]) -> list[dict]:
    """The ops' results in prompt order, or the first one's error."""
    ops = await asyncio.gather(*(engine.wait_async(owner, op_id, SAMPLE_TIMEOUT_S) for op_id in op_ids))
    for op in ops:
        if op is None:
            raise SessError("sample: timed out inside the engine", status=504)
        if op.error is not None:
            raise _as_sent(op.error)
    return [op.result for op in ops]


def _one_token_prompt_result(ids: list[int], result: dict) -> dict:
    """A one-token prompt has no prompt logprobs from the engine; its echo shows the token, logprob null."""
    return {**result, "prompt_logprobs": [None] * len(ids), "topk_prompt_logprobs": None}


def add_openai_routes(app: FastAPI, engine, owner_of, read_json) -> None:
    @app.get("/v1/models")
    async def models(request: Request):
        owner = owner_of(request)
        sessions = await run_in_threadpool(engine.call, owner, "list_sessions", {})
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "sess"}
            for name in list_models(engine.runtime.home)
        ]
        data += [
            {"id": s["name"], "object": "model", "created": int(s["created"]), "owned_by": owner}
            for s in sessions
            if s["status"] == SessionStatus.Running.value
        ]
        data += [
            {
                "id": client_view(owner, c["path"]),
                "object": "model",
                "created": int(c["created"]),
                "owned_by": owner,
            }
            for s in sessions
            for c in engine.registry.checkpoints(engine_name(engine.runtime, owner, s["name"]))
            if c["kind"] in ("weights", "merged")
        ]
        return {"object": "list", "data": data}

    async def complete(request: Request, chat: bool):
        owner = owner_of(request)
        body = await read_json(request, MAX_OPENAI_BODY_BYTES)
        try:
            plan = read_plan(body, chat)
            target = resolve_model(engine, owner, plan.model)
            tokenizer, prompts = await run_in_threadpool(_prepare, engine, owner, target, plan)
        except SessError as exc:
            raise _as_sent(exc) from None

        async def finish(results: list[dict]) -> tuple[list, dict]:
            choices, sampled, cached = [], 0, 0
            for i, (ids, result) in enumerate(zip(prompts, results)):
                if plan.echo and plan.logprobs is not None and len(ids) == 1 and plan.max_tokens:
                    result = _one_token_prompt_result(ids, result)
                choices += choices_of(tokenizer, plan, ids, result, i * plan.n)
                sampled += sum(len(s["tokens"]) for s in result.get("sequences", []))
                cached += result.get("prompt_cache_hit_tokens", 0)
            return choices, usage_block(sum(len(ids) for ids in prompts), sampled, cached)

        if live.eligible(plan):
            queue, progresses = live.listeners(len(prompts))
            waiting = asyncio.ensure_future(
                _wait(engine, owner, _submit(engine, owner, target, plan, prompts, progresses))
            )
            try:
                first = await live.first_event(queue, waiting)
            except BaseException:
                for progress in progresses:  # an error, or the client gone before the first token
                    progress.cancelled = True
                raise
            lines = live.events(plan, tokenizer, first, queue, waiting, progresses, finish)
            return StreamingResponse(lines, media_type=streaming.MEDIA_TYPE)
        choices, usage = await finish(
            await _wait(engine, owner, _submit(engine, owner, target, plan, prompts))
        )
        if plan.stream:
            return StreamingResponse(streaming.events(plan, choices, usage), media_type=streaming.MEDIA_TYPE)
        return answer(plan, choices, usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)
