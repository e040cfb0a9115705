"""Chats to tokens with the tokenizer's own chat template, and token lists to training datums.

A prompt is rendered with the generation prompt (``<|im_start|>assistant\\n`` for ChatML) and encoded
on its own, exactly as the sampler sees it (with the env's ``tools``, when it offers any). What comes
after it is found by *prefix difference*: render the conversation without and with the next part and
keep the text the longer rendering adds. An assistant turn (content plus end-of-turn) is encoded on
its own and appended, so the tokens trained on are the tokens a policy would sample; only assistant
tokens get weight. An observation in a multi-turn episode (:func:`observation_tokens`) is the text the
template puts between a reply and the next generation prompt, appended after the sampled tokens.

Tools (an env's ``tools``, OpenAI-style function entries) go to the template as ``tools=`` when it
renders them (Qwen, SmolLM3, Llama 3.1 templates do), and ``role: tool`` messages render as the
template says. Where the template ignores ``tools`` (ChatML as SmolLM2 and the tiny test models ship
it), the *fallback* writes the same thing as text, in the Hermes format those templates use: the tool
list in ``<tools></tools>`` and how to call one (``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``) at the end of the first user message, and each tool result as a user message
``<tool_response>\n...\n</tool_response>``, which is how Qwen's template renders a tool message.
"""

from __future__ import annotations

import json

import numpy as np

from sess.engine import Datum, ModelInput

_NATIVE_TOOLS: dict[str, bool] = {}  # chat template -> renders tools= itself


def _text(tok, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
    if tools and not renders_tools(tok):
        messages, tools = with_tool_text(messages, tools), None
    return tok.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
    )


def renders_tools(tok) -> bool:
    """Whether the tokenizer's chat template writes ``tools=`` into the prompt (its native tool format)."""
    template = str(tok.chat_template)
    if template not in _NATIVE_TOOLS:
        probe = {
            "type": "function",
            "function": {"name": "sess_probe_tool", "description": "", "parameters": {}},
        }
        shown = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[probe], add_generation_prompt=True, tokenize=False
        )
        _NATIVE_TOOLS[template] = "sess_probe_tool" in shown
    return _NATIVE_TOOLS[template]


def with_tool_text(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The fallback for templates without tools: the tool list in the first user message, tool results
    as user messages in ``<tool_response>`` tags (module docstring)."""
    listing = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    how = (
        f"\n\nYou may call a tool. The tools:\n<tools>\n{listing}\n</tools>\n"
        'To call one, reply with <tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call>; '
        "its result comes back in <tool_response></tool_response>."
    )
    out, told = [], False
    for message in messages:
        if message["role"] == "user" and not told:
            message, told = {**message, "content": message["content"] + how}, True
        elif message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        out.append(message)
    return out if told else [{"role": "system", "content": how.strip()}, *out]


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def prompt_tokens(tok, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    return encode(tok, _text(tok, messages, True, tools))


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


# Stands in for a sampled reply while rendering what follows it: private-use characters, no whitespace
# to trim, so templates copy it through unchanged and it cannot occur in a real conversation.
_REPLY = "\ue000sess-reply\ue000"


def observation_tokens(
    tok,
    messages: list[dict],
    observation: list[dict],
    *,
    stop_text: str = "",
    tools: list[dict] | None = None,
) -> list[int]:
    """The tokens between a reply sampled after ``messages`` and the policy's next turn.

    That is the end of the assistant turn (less ``stop_text``, the stop token the sampler already
    produced), the ``observation`` messages (tool results, the next user turn) and the next generation
    prompt: the text the template renders after a placeholder reply. The reply itself stays as sampled.
    """
    before = _text(tok, messages, True, tools)
    after = _text(tok, [*messages, {"role": "assistant", "content": _REPLY}, *observation], True, tools)
    if not after.startswith(before + _REPLY):
        raise ValueError(
            "multi-turn env: this chat template renders a conversation differently from the start of its "
            "continuation (it rewrites earlier turns), so observation tokens cannot be appended to sampled ones"
        )
    text = after[len(before) + len(_REPLY) :]
    if stop_text and text.startswith(stop_text):
        text = text[len(stop_text) :]
    return encode(tok, text)


def completion_tokens(tok, prompt: list[dict], completion: str) -> list[int]:
    return encode(tok, assistant_turn_text(tok, prompt, completion))


def shifted_datum(tokens_T: list[int], **per_token_T) -> Datum:
    """A datum predicting tokens_T[1:] from tokens_T[:-1]; each ``per_token_T`` array is shifted alike."""
    inputs = {"target_tokens": np.asarray(tokens_T[1:], np.int64)}
    for key, values in per_token_T.items():
        inputs[key] = np.asarray(values[1:], np.float32)
    return Datum(model_input=ModelInput.from_ints(tokens_T[:-1]), loss_fn_inputs=inputs)
