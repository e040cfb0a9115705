"""Chats to tokens with the tokenizer's own chat template, and token lists to training datums.

A prompt is rendered with the generation prompt (``<|im_start|>assistant\\n`` for ChatML) and encoded
on its own, exactly as the sampler sees it. An assistant turn is the text the template adds after that
generation prompt (content plus end-of-turn), encoded on its own and appended, so the tokens trained
on are the tokens a policy would sample. Only assistant tokens get weight.
"""

from __future__ import annotations

import numpy as np

from sess.engine import Datum, ModelInput


def _text(tok, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def prompt_tokens(tok, messages: list[dict]) -> list[int]:
    return encode(tok, _text(tok, messages, True))


def assistant_turn_text(tok, messages: list[dict], content: str) -> str:
    """What the template adds for an assistant reply after the generation prompt of ``messages``."""
    before = _text(tok, messages, True)
    after = _text(tok, [*messages, {"role": "assistant", "content": content}], False)
    if not after.startswith(before):  # templates that rewrite history; fall back to the raw content
        return content + (tok.eos_token or "")
    return after[len(before) :]


def chat_tokens(tok, messages: list[dict]) -> tuple[list[int], list[float]]:
    """(tokens_T, weights_T) for a whole chat: weight 1 on assistant turns, 0 elsewhere."""
    tokens: list[int] = []
    weights: list[float] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = prompt_tokens(tok, messages[:i])[len(tokens) :] if i else []
        reply = encode(tok, assistant_turn_text(tok, messages[:i], message["content"]))
        tokens += prefix + reply
        weights += [0.0] * len(prefix) + [1.0] * len(reply)
    return tokens, weights


def completion_tokens(tok, prompt: list[dict], completion: str) -> list[int]:
    return encode(tok, assistant_turn_text(tok, prompt, completion))


def shifted_datum(tokens_T: list[int], **per_token_T) -> Datum:
    """A datum predicting tokens_T[1:] from tokens_T[:-1]; each ``per_token_T`` array is shifted alike."""
    inputs = {"target_tokens": np.asarray(tokens_T[1:], np.int64)}
    for key, values in per_token_T.items():
        inputs[key] = np.asarray(values[1:], np.float32)
    return Datum(model_input=ModelInput.from_ints(tokens_T[:-1]), loss_fn_inputs=inputs)
