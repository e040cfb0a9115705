"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

``model`` is a live session's name (its current weights), a ``sess://`` sampler checkpoint, or a
base model name. Requests become ordinary ``sample`` ops on the engine, so they are batched, bounded
and accounted like any other; the ``usage`` block counts the same prompt and sampled tokens.
``n``, ``max_tokens``, ``temperature``, ``top_p``, ``stop`` and ``seed`` are honoured; streaming is not,
nor are the options in :data:`UNSUPPORTED` (a 400 names them rather than an answer that ignores them).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from sess.engine.runtime.models.catalog import list_models
from sess.engine.runtime.ops.sampling_ops import resolve_target
from sess.engine.runtime.session_names import client_view, engine_name, engine_path
from sess.engine.sdk.errors import InvalidRequest, NotFound, SessError
from sess.engine.sdk.requests import Target
from sess.engine.sdk.types import SamplingParams, SessionStatus
from sess.engine.sdk.wire_checks import check_text

SAMPLE_TIMEOUT_S = 600.0
# options that would change the answer, with the values that ask for nothing (those are accepted)
UNSUPPORTED = {
    "logprobs": (False,),  # completions' logprobs=0 asks for the sampled tokens' logprobs
    "top_logprobs": (0,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "tools": ([],),
    "functions": ([],),
    "response_format": ({"type": "text"},),
}
LOGPROBS = ("logprobs", "top_logprobs", "echo")
# the engine's names for what an OpenAI client sent, as its error messages start with them
CLIENT_NAMES = {"num_samples:": "n:", "sampling_params.": ""}


def _number(body: dict, name: str, default: float, kind=(int, float)) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InvalidRequest(f"{name}: expected a number, got {value!r}")
    return value if kind is int else float(value)  # read_json refuses integers no float holds


def _target(engine, owner: str, model: Any) -> dict:
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: expected a session name, a sess:// checkpoint path or a base model name")
    if model.startswith("sess://"):  # the caller's own checkpoint, or a published one
        return {"model_path": engine_path(engine.runtime, owner, model)}
    if engine.runtime.find_session(owner, model) is not None:
        return {"session": model}
    if model in list_models():
        return {"base_model": model}
    raise NotFound(f"model: {model!r} is not a live session, a checkpoint or a base model of this key")


def _prepare(engine, owner: str, target: dict, messages: list | None, prompt: Any):
    """On the executor: the sampling host, and the prompt as token ids."""

    def run(runtime):
        host, _, _ = resolve_target(runtime, owner, Target.from_wire(target, "model"))
        tokenizer = host.tokenizer
        if messages is not None:
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # the model's template refuses these messages (jinja raises)
                raise InvalidRequest(f"messages: the model's chat template refused them: {exc}") from None
            return tokenizer, list(tokenizer.encode(text, add_special_tokens=False))
        if isinstance(prompt, str):
            return tokenizer, list(tokenizer.encode(prompt))
        return tokenizer, prompt

    return engine.run(run, owner=owner)


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: expected a non-empty list of {role, content}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}]: expected an object with a string 'role'")
        if not isinstance(message.get("content"), str):
            raise InvalidRequest(f"messages[{i}].content: expected a string")
        check_text(message["role"], f"messages[{i}].role")
        check_text(message["content"], f"messages[{i}].content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _check_supported(body: dict) -> None:
    for name, inert in UNSUPPORTED.items():
        value = body.get(name)
        if value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in inert):
            continue
        hint = " (sess's own sample op returns each sampled token's logprob)" if name in LOGPROBS else ""
        raise InvalidRequest(
            f"{name}: not supported by this engine, got {str(value)[:40]}; leave it out{hint}"
        )


def _as_sent(exc: SessError) -> SessError:
    """``exc`` with the engine's field names replaced by the ones the OpenAI client sent."""
    message = str(exc)
    for ours, theirs in CLIENT_NAMES.items():
        if message.startswith(ours):
            return type(exc)(theirs + message[len(ours) :], status=exc.status)
    return exc


def _cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    cut = min((text.find(s) for s in stop if s and s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def add_openai_routes(app: FastAPI, engine, owner_of, read_json) -> None:
    @app.get("/v1/models")
    async def models(request: Request):
        owner = owner_of(request)
        sessions = await run_in_threadpool(engine.call, owner, "list_sessions", {})
        data = [
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
        body = await read_json(request)
        if body.get("stream"):
            raise InvalidRequest("stream: streaming responses are not supported; send stream=false")
        _check_supported(body)
        model = body.get("model")
        target = _target(engine, owner, model)
        messages = _check_messages(body.get("messages")) if chat else None
        prompt = body.get("prompt")
        if not chat and not (
            isinstance(prompt, str)
            and prompt
            or isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            raise InvalidRequest("prompt: expected a non-empty string or a list of token ids")
        n = _number(body, "n", 1, int)
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise InvalidRequest("stop: expected a string or a list of strings")
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
        try:
            params = SamplingParams(
                max_tokens=_number(body, "max_tokens", 16, int),
                temperature=_number(body, "temperature", 1.0),
                top_p=_number(body, "top_p", 1.0),
                seed=_number(body, "seed", None, int),
                stop=stops or None,
            )
            params.validate()
            tokenizer, tokens = await run_in_threadpool(_prepare, engine, owner, target, messages, prompt)
            op_id = engine.submit(
                owner,
                "sample",
                {"target": target, "prompt": tokens, "num_samples": n, "sampling_params": params.to_wire()},
            )
        except SessError as exc:
            raise _as_sent(exc) from None
        op = await engine.wait_async(owner, op_id, SAMPLE_TIMEOUT_S)
        if op is None:
            raise SessError("sample: timed out inside the engine", status=504)
        if op.error is not None:
            raise _as_sent(op.error)
        choices, sampled = [], 0
        for index, seq in enumerate(op.result["sequences"]):
            sampled += len(seq["tokens"])
            text, stopped = _cut_at_stop(tokenizer.decode(seq["tokens"], skip_special_tokens=True), stops)
            reason = "stop" if stopped or seq["stop_reason"] == "stop" else "length"
            choice = {"index": index, "finish_reason": reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(tokens),
                "completion_tokens": sampled,
                "total_tokens": len(tokens) + sampled,
            },
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)
