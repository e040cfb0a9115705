"""OpenAI's answer shapes from the engine's results: each choice as pieces (a stretch of text and the
tokens behind it), which an unstreamed answer joins and a stream sends one by one, so both carry the
same text and logprobs.

Logprobs are the engine's: a sampled token's is the sampler's (the model's own distribution at
temperature 1 with no top-k or top-p, equal to the trainer's ``compute_logprobs``, as the sess SDK
reports it), whatever temperature drew the token; the alternatives at a position are that
distribution's top k; an echoed prompt's come from the same forward pass as ``compute_logprobs``
(its first token has none: null).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from sess.engine.server.openai.requests import Plan


@dataclass
class Token:
    text: str
    logprob: float | None
    top: list[tuple[str, float]] | None  # None: no alternatives at this position (the first prompt token)


@dataclass
class Piece:
    text: str
    tokens: list[Token] = field(default_factory=list)


@dataclass
class Choice:
    index: int
    pieces: list[Piece]
    finish_reason: str

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    @property
    def tokens(self) -> list[Token]:
        return [t for p in self.pieces for t in p.tokens]


def _cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    cut = min((text.find(s) for s in stop if s and s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _tokens(tokenizer, ids: list[int], logprobs: list, tops: list | None) -> list[Token]:
    """One :class:`Token` per id; ``tops`` rows are [id, logprob] pairs (None: not asked)."""
    text = [tokenizer.decode([i]) for i in ids]
    alternatives = [
        None if row is None else [(tokenizer.decode([i]), lp) for i, lp in row]
        for row in (tops if tops is not None else [[] for _ in ids])
    ]
    return [Token(t, lp, top) for t, lp, top in zip(text, logprobs, alternatives)]


def _sampled_pieces(tokenizer, plan: Plan, sequence: dict) -> tuple[list[Piece], str]:
    """One piece per sampled token, whose texts join to the answer's text (cut before a stop string);
    tokens wholly past the cut are left out."""
    ids = sequence["tokens"]
    text, stopped = _cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), plan.stops)
    reason = "stop" if stopped or sequence["stop_reason"] == "stop" else "length"
    wanted = plan.logprobs is not None
    entries = _tokens(tokenizer, ids, sequence["logprobs"], sequence.get("topk_logprobs")) if wanted else None
    pieces, start = [], 0
    for i in range(len(ids)):
        if stopped and start >= len(text):
            break
        end = (
            len(text) if i == len(ids) - 1 else len(tokenizer.decode(ids[: i + 1], skip_special_tokens=True))
        )
        end = max(start, min(end, len(text)))
        pieces.append(Piece(text[start:end], [entries[i]] if wanted else []))
        start = end
    if start < len(text):  # the last kept token's piece takes what decoding a prefix held back
        pieces[-1].text += text[start:]
    return pieces, reason


def choices_of(tokenizer, plan: Plan, prompt_ids: list[int], result: dict, first_index: int) -> list[Choice]:
    """The choices of one prompt's result (a sample op's, or compute_logprobs' for max_tokens 0)."""
    echoed = []
    if plan.echo:
        prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
        tokens = []
        if plan.logprobs is not None:
            tops = result.get("topk_prompt_logprobs") if plan.logprobs else None
            tokens = _tokens(tokenizer, prompt_ids, result.get("prompt_logprobs") or result["logprobs"], tops)
            tokens[0].top = None
        echoed = [Piece(prompt_text, tokens)]
    if plan.max_tokens == 0:
        return [Choice(first_index + j, list(echoed), "length") for j in range(plan.n)]
    choices = []
    for j, sequence in enumerate(result["sequences"]):
        pieces, reason = _sampled_pieces(tokenizer, plan, sequence)
        choices.append(Choice(first_index + j, echoed + pieces, reason))
    return choices


def completion_logprobs(tokens: list[Token], offset: int = 0) -> dict:
    """Completions' ``logprobs`` block for ``tokens``; text offsets count from ``offset``."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [None if t.top is None else dict(t.top) for t in tokens],
        "text_offset": offsets,
    }


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: list[Token]) -> dict:
    """Chat's ``logprobs`` block: ``content``, one entry per sampled token with its alternatives."""
    content = [
        {**_entry(t.text, t.logprob), "top_logprobs": [_entry(text, lp) for text, lp in t.top or []]}
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def header(plan: Plan) -> dict:
    return {
        "id": f"{'chatcmpl' if plan.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion" if plan.chat else "text_completion",
        "created": int(time.time()),
        "model": plan.model,
    }


def usage_block(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``cached_tokens``: the prompt tokens found in the sampler's prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def answer(plan: Plan, choices: list[Choice], usage: dict) -> dict:
    """The unstreamed answer."""
    wire = []
    for choice in choices:
        if plan.chat:
            logprobs = chat_logprobs(choice.tokens) if plan.logprobs is not None else None
            body = {"message": {"role": "assistant", "content": choice.text}, "logprobs": logprobs}
        else:
            logprobs = completion_logprobs(choice.tokens) if plan.logprobs is not None else None
            body = {"text": choice.text, "logprobs": logprobs}
        wire.append({"index": choice.index, **body, "finish_reason": choice.finish_reason})
    return {**header(plan), "choices": wire, "usage": usage}
