"""Reading an OpenAI completions or chat completions body into one :class:`Plan`: the prompts (texts,
token lists or chat messages), the sampling settings, and what the answer includes (logprobs, echo,
streaming). Every field is checked against :mod:`.fields` first, so nothing is dropped unread; the
errors name the field as the client sent it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.types import SamplingParams
from sess.engine.protocol.wire_checks import check_text
from sess.engine.server.openai.fields import CHAT, COMPLETIONS, check_fields

MAX_TOP_LOGPROBS = 20  # OpenAI's bound (vLLM's default), for completions' logprobs and chat's top_logprobs
MAX_PROMPTS = 1024
DEFAULT_MAX_TOKENS = 16


@dataclass
class Plan:
    chat: bool
    model: str
    prompts: list  # completions: str or list[int] each; chat: one list of {role, content}
    n: int
    params: SamplingParams
    stops: list[str]
    max_tokens: int  # 0: echo only, nothing sampled
    logprobs: int | None  # None: no logprobs; k >= 0: each token's logprob and its top k
    echo: bool
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default: Any, kind=(int, float)) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InvalidRequest(f"{name}: expected a number, got {str(value)[:40]!r}")
    return value if kind is int else float(value)  # read_json refuses integers no float holds


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"{name}: expected true or false, got {str(value)[:40]!r}")
    return bool(value)


def _token_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _prompts(prompt: Any) -> list:
    """A completions ``prompt`` as a list of prompts, each a string or a list of token ids."""
    if isinstance(prompt, str) or _token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_list(p) for p in prompt):
        prompts = prompt
    else:
        raise InvalidRequest(
            "prompt: expected a non-empty string, a list of token ids, or a list of strings or of token-id lists"
        )
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"prompt: {len(prompts)} prompts is over the limit of {MAX_PROMPTS} per request")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise InvalidRequest(f"prompt[{i}]: an empty string has no tokens to continue")
            check_text(p, f"prompt[{i}]" if len(prompts) > 1 else "prompt")
    return prompts


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined with newlines, as vLLM does)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise InvalidRequest(f"{where}: expected a string or a non-empty list of text parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(
                f"{where}[{i}]: only {{'type': 'text', 'text': ...}} parts are supported, got {str(kind)[:40]!r} "
                "(the engine's models read text only)"
            )
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise InvalidRequest(f"{where}[{i}].{extra[0]}: not supported in a text part; leave it out")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: expected a non-empty list of {role, content}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}]: expected an object with a string 'role'")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise InvalidRequest(
                f"messages[{i}].{extra[0]}: not supported (only role and content are rendered); leave it out"
            )
        content = _content(message.get("content"), f"messages[{i}].content")
        check_text(message["role"], f"messages[{i}].role")
        check_text(content, f"messages[{i}].content")
        checked.append({"role": message["role"], "content": content})
    return checked


def _max_tokens(body: dict, chat: bool) -> int:
    given = {
        name: _number(body, name, None, int)
        for name in ("max_tokens", "max_completion_tokens")
        if body.get(name) is not None
    }
    if chat and len(set(given.values())) > 1:
        raise InvalidRequest(
            f"max_completion_tokens: {given['max_completion_tokens']} differs from max_tokens "
            f"{given['max_tokens']}; send one of them"
        )
    return next(iter(given.values()), DEFAULT_MAX_TOKENS)


def _logprobs(body: dict, chat: bool) -> int | None:
    """None for no logprobs, else how many top alternatives each position lists."""
    if chat:
        top = _number(body, "top_logprobs", None, int)
        if not _flag(body, "logprobs"):
            if top:
                raise InvalidRequest("top_logprobs: needs logprobs: true")
            return None
        k, name = top or 0, "top_logprobs"
    else:
        k, name = _number(body, "logprobs", None, int), "logprobs"
        if k is None:
            return None
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"{name}: expected a value in 0..{MAX_TOP_LOGPROBS}, got {k}")
    return k


def _stream_options(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options: expected an object such as {'include_usage': true}")
    if not body.get("stream"):
        raise InvalidRequest("stream_options: applies only with stream: true")
    extra = sorted(set(options) - {"include_usage", "include_obfuscation"})
    if extra:
        raise InvalidRequest(
            f"stream_options.{extra[0]}: not a stream option this engine knows; leave it out"
        )
    if options.get("include_obfuscation"):
        raise InvalidRequest("stream_options.include_obfuscation: not supported; the engine pads no chunks")
    return _flag(options, "include_usage")


def read_plan(body: dict, chat: bool) -> Plan:
    """The checked request, or a 400 naming the first field at fault."""
    check_fields(CHAT if chat else COMPLETIONS, body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: expected a session name, a sess:// checkpoint path or a base model name")
    prompts = [_messages(body.get("messages"))] if chat else _prompts(body.get("prompt"))
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("stop: expected a string or a list of strings")
    echo = not chat and _flag(body, "echo")
    max_tokens = _max_tokens(body, chat)
    if max_tokens == 0 and not echo:
        raise InvalidRequest("max_tokens: 0 samples nothing; it is allowed only with echo: true")
    logprobs = _logprobs(body, chat)
    if max_tokens == 0 and logprobs:
        raise InvalidRequest(
            "logprobs: the prompt's top alternatives need max_tokens >= 1; send logprobs: 0 with max_tokens: 0"
        )
    params = SamplingParams(
        max_tokens=max(max_tokens, 1),
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=_number(body, "top_k", -1, int),
        seed=_number(body, "seed", None, int),
        stop=stops or None,
    )
    params.validate()
    return Plan(
        chat=chat,
        model=model,
        prompts=prompts,
        n=_number(body, "n", 1, int),
        params=params,
        stops=stops,
        max_tokens=max_tokens,
        logprobs=logprobs,
        echo=echo,
        stream=_flag(body, "stream"),
        include_usage=_stream_options(body),
    )
