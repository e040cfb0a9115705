"""Streaming tokens as the decode batch draws them, and cancelling the sampling when the client goes.

Each prompt's sample op carries a :class:`Progress` (the decode batch's ``SampleJob.progress``): after
each draw it hands (prompt, sample, token) to the event loop, which sends the text that can no longer
change (decoded so far, cut at a stop string, less what could still become one, less a partial
character) as a chunk. When the ops finish, each choice's last chunk brings the rest of the finished
answer's text and its finish_reason, so the stream joins to exactly the unstreamed answer at the same
seed. A client that goes away sets ``cancelled``: the decode batch ends those rows at its next step,
and the op is billed for the tokens drawn. Rows decoded by the vLLM sampler or on other ranks report
only when they finish; their text comes in the last chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from sess.engine.protocol.errors import SessError
from sess.engine.server.openai.answers import Choice, header
from sess.engine.server.openai.requests import Plan
from sess.engine.server.openai.streaming import event


class Progress:
    """One sample op's listener: runs on the executor thread, hands each token to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, prompt: int):
        self.loop, self.queue, self.prompt = loop, queue, prompt
        self.cancelled = False

    def token(self, sample: int, token_id: int, logprob: float) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.prompt, sample, token_id))


def listeners(prompts: int) -> tuple[asyncio.Queue, list[Progress]]:
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    return queue, [Progress(loop, queue, i) for i in range(prompts)]


def eligible(plan: Plan) -> bool:
    """Whether tokens can stream as drawn: logprobs' alternatives and echo come only at the end."""
    return plan.stream and plan.logprobs is None and not plan.echo


def _settled(tokenizer, ids: list[int], stops: list[str]) -> str:
    """The text of ``ids`` that no later token can change."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    if cut >= 0:
        return text[:cut]
    hold = max((len(s) for s in stops), default=1) - 1  # the start of a stop string not yet complete
    return text[: len(text) - hold].rstrip("\ufffd")  # a partial character waits for its next byte


async def first_event(queue: asyncio.Queue, waiting: asyncio.Future) -> tuple | None:
    """The first token, or None when the ops finished first; an op's error raises here, before the
    response starts, so it is an ordinary 4xx."""
    getting = asyncio.ensure_future(queue.get())
    await asyncio.wait({getting, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if getting.done():
        return getting.result()
    getting.cancel()
    waiting.result()
    return None


async def events(
    plan: Plan,
    tokenizer,
    first: tuple | None,
    queue: asyncio.Queue,
    waiting: asyncio.Future,
    progresses: list[Progress],
    finish: Callable[[list[dict]], Awaitable[tuple[list[Choice], dict]]],
) -> AsyncIterator[str]:
    head = {**header(plan), "object": "chat.completion.chunk" if plan.chat else "text_completion"}
    extra = {"usage": None} if plan.include_usage else {}
    choices = len(progresses) * plan.n
    ids: list[list[int]] = [[] for _ in range(choices)]
    sent = [""] * choices

    def chunk(index: int, text: str, reason: str | None = None, role: bool = False) -> str:
        if plan.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            body = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            body = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        return event({**head, "choices": [body], **extra})

    def heard(item: tuple) -> str | None:
        index = item[0] * plan.n + item[1]
        ids[index].append(item[2])
        text = _settled(tokenizer, ids[index], plan.stops)
        if len(text) <= len(sent[index]) or not text.startswith(sent[index]):
            return None
        new, sent[index] = text[len(sent[index]) :], text
        return chunk(index, new)

    try:
        if plan.chat:
            for index in range(choices):
                yield chunk(index, "", role=True)
        item = first
        while item is not None:
            line = heard(item)
            if line is not None:
                yield line
            item = queue.get_nowait() if not queue.empty() else None
            if item is None and not waiting.done():
                getting = asyncio.ensure_future(queue.get())
                await asyncio.wait({getting, waiting}, return_when=asyncio.FIRST_COMPLETED)
                if getting.done():
                    item = getting.result()
                else:
                    getting.cancel()
        try:
            done, usage = await finish(await waiting)
        except SessError as exc:  # the response has started: the error is the stream's last event
            yield event({"error": {"message": str(exc), "type": "invalid_request_error", "code": exc.status}})
            return
        for choice in done:
            text = choice.text
            rest = text[len(sent[choice.index]) :] if text.startswith(sent[choice.index]) else ""
            yield chunk(choice.index, rest, choice.finish_reason)
        if plan.include_usage:
            yield event({**head, "choices": [], "usage": usage})
        yield event("[DONE]")
    finally:
        if not waiting.done():  # the client went away: end the sampling with what it drew
            for progress in progresses:
                progress.cancelled = True
