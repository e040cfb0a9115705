"""Every field of OpenAI's completions and chat completions requests, and what sess does with each.

:data:`HONOURED` fields are read and acted on (the note says how); :data:`REFUSED` fields get a 400
naming the field and giving the reason here, unless their value is one that asks for nothing (a
``presence_penalty`` of 0, ``tools`` of ``[]``: :data:`INERT`). A field in neither table is refused
as unknown (:func:`check_fields`). The keys are the fields of the ``openai`` package's
``CompletionCreateParams`` and ``chat.CompletionCreateParams``; ``tests/server/test_openai_fields.py``
walks the installed package's request types and fails on a field in neither table. A few of vLLM's
extensions (``top_k``) are honoured too. docs/openai.md describes each field.
"""

from __future__ import annotations

from typing import Any

from sess.engine.protocol.errors import InvalidRequest

COMPLETIONS = "completions"
CHAT = "chat"

SAMPLING = {
    "model": "a live session's name (its current weights), a sess:// sampler checkpoint, or a base model name",
    "n": "samples per prompt (1..1024), drawn in one batch",
    "temperature": "0 is greedy; the reported logprobs are the model's own at temperature 1 either way",
    "top_p": "nucleus sampling, as the engine's sample op",
    "top_k": "vLLM's extension: keep the k most likely tokens (-1: off)",
    "seed": "the engine's counter-based RNG: the same seed gives the same tokens, streamed or not",
    "stop": "a string or up to 64 strings; the text ends before the first one (finish_reason stop)",
    "stream": "server-sent events: text as it is drawn, then data: [DONE]; a client gone ends the sampling",
    "stream_options": "include_usage adds a last chunk with the usage block",
    "user": "accepted, not stored: usage is kept per key and session by the engine",
}

HONOURED: dict[str, dict[str, str]] = {
    COMPLETIONS: {
        **SAMPLING,
        "prompt": "a string, a list of token ids, or a list of either (one batch, answered in index order)",
        "max_tokens": "tokens to sample per choice (default 16); 0 only with echo",
        "logprobs": "k in 0..20: each token's logprob and the k most likely tokens at its position",
        "echo": "the prompt's text and, with logprobs, its tokens' logprobs (the first is null)",
    },
    CHAT: {
        **SAMPLING,
        "messages": "role and content (a string or text parts), rendered by the model's chat template",
        "max_tokens": "tokens to sample per choice (default 16)",
        "max_completion_tokens": "the same as max_tokens; both given and different is a 400",
        "logprobs": "each sampled token's logprob in choices[].logprobs.content",
        "top_logprobs": "0..20 most likely tokens at each sampled position (needs logprobs)",
        "safety_identifier": "accepted, not stored: usage is kept per key and session by the engine",
        "prompt_cache_key": "accepted: a routing hint; the engine has one copy of each model",
    },
}

NO_PENALTIES = "the engine's sampler applies no penalties; leave it out or 0"
NO_TOOLS = "the engine returns text: render tools into the messages with the model's chat template"
TEXT_ONLY = "the engine's models read and write text only"
NOT_STORED = "the engine does not store completions"

REFUSED: dict[str, dict[str, str]] = {
    COMPLETIONS: {
        "best_of": "ranking candidates is left to the client: ask n samples with logprobs and pick",
        "suffix": "insertion after a suffix is not supported; send the prompt only",
        "logit_bias": "the engine's sampler takes no logit bias",
        "presence_penalty": NO_PENALTIES,
        "frequency_penalty": NO_PENALTIES,
    },
    CHAT: {
        "presence_penalty": NO_PENALTIES,
        "frequency_penalty": NO_PENALTIES,
        "logit_bias": "the engine's sampler takes no logit bias",
        "tools": NO_TOOLS,
        "tool_choice": NO_TOOLS,
        "parallel_tool_calls": NO_TOOLS,
        "functions": NO_TOOLS,
        "function_call": NO_TOOLS,
        "response_format": "no constrained decoding: only {'type': 'text'}",
        "audio": TEXT_ONLY,
        "modalities": TEXT_ONLY,
        "prediction": "predicted outputs are not used by the engine's decoder",
        "web_search_options": "the engine does not search the web",
        "reasoning_effort": "reasoning effort is a property of the model: render it into the messages",
        "verbosity": "verbosity is a property of the model: render it into the messages",
        "store": NOT_STORED,
        "metadata": NOT_STORED,
        "service_tier": "the engine has one tier: leave it out, 'auto' or 'default'",
        "moderation": "the engine does not moderate; check the text on the client",
        "prompt_cache_retention": "the engine's prefix cache keeps no retention setting",
        "prompt_cache_options": "the engine's prefix cache takes no options",
    },
}

# values of refused fields that ask for nothing, so a client sending its defaults is answered
INERT: dict[str, tuple] = {
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "tools": ([],),
    "functions": ([],),
    "parallel_tool_calls": (False, True),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
}


def _inert(name: str, value: Any) -> bool:
    if value is None:
        return True
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in INERT.get(name, ()))


def check_fields(kind: str, body: dict) -> None:
    """400 for a field not in either table (naming it) and for a refused field set to something."""
    for name, value in body.items():
        if name in HONOURED[kind]:
            continue
        reason = REFUSED[kind].get(name)
        if reason is None:
            known = "the fields of OpenAI's " + ("chat completions" if kind == CHAT else "completions")
            raise InvalidRequest(f"{name}: not a field of {known} request this engine knows; leave it out")
        if not _inert(name, value):
            raise InvalidRequest(f"{name}: not supported by this engine ({reason}); got {str(value)[:40]}")


def uncovered(kind: str, names: list[str]) -> list[str]:
    """The fields in ``names`` that neither table covers (what the field test asserts is empty)."""
    return [n for n in names if n not in HONOURED[kind] and n not in REFUSED[kind]]


def markdown_table(kind: str) -> str:
    """docs/openai.md's table of ``kind``'s fields."""
    rows = ["| field | sess |", "|---|---|"]
    rows += [f"| `{n}` | {note} |" for n, note in HONOURED[kind].items()]
    rows += [f"| `{n}` | refused: {note} |" for n, note in REFUSED[kind].items()]
    return "\n".join(rows)
