"""Server-sent events for ``stream: true``: ``data: {chunk}`` lines in OpenAI's chunk shapes, the
choice's last chunk carrying its finish_reason, a usage chunk when ``stream_options.include_usage``
asks, then ``data: [DONE]``.

Without logprobs or echo, tokens stream as the decode batch draws them (:mod:`.live`). With them,
the chunks are cut from the finished answer (:func:`events`: one per piece of each choice, a sampled
token or the echoed prompt), since the alternatives at each position come when sampling ends; the
stream carries exactly the text and logprobs of the unstreamed answer at the same seed either way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from sess.engine.server.openai.answers import Choice, Piece, chat_logprobs, completion_logprobs, header
from sess.engine.server.openai.requests import Plan

MEDIA_TYPE = "text/event-stream"


def event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _chunk_choice(plan: Plan, choice: Choice, piece: Piece, offset: int, first: bool, last: bool) -> dict:
    reason = choice.finish_reason if last else None
    if plan.chat:
        delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
        logprobs = chat_logprobs(piece.tokens) if plan.logprobs is not None else None
        return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    logprobs = completion_logprobs(piece.tokens, offset) if plan.logprobs is not None else None
    return {"index": choice.index, "text": piece.text, "logprobs": logprobs, "finish_reason": reason}


def events(plan: Plan, choices: list[Choice], usage: dict) -> Iterator[str]:
    """The stream's lines, in choice index order."""
    head = {**header(plan), "object": "chat.completion.chunk" if plan.chat else "text_completion"}
    extra = {"usage": None} if plan.include_usage else {}
    for choice in choices:
        pieces = choice.pieces or [Piece("")]
        offset = 0
        for i, piece in enumerate(pieces):
            wire = _chunk_choice(plan, choice, piece, offset, i == 0, i == len(pieces) - 1)
            offset += sum(len(t.text) for t in piece.tokens)
            yield event({**head, "choices": [wire], **extra})
    if plan.include_usage:
        yield event({**head, "choices": [], "usage": usage})
    yield event("[DONE]")
