"""``data=chat_jsonl`` and ``data=feedback_jsonl``: a user's chats (SFT) and binary feedback (KTO) files."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from sess.rl.data import Data, Dataset, Feedback
from sess.rl.env import Messages

from .. import files


@dataclass
class ChatJsonlData:
    name: str = "chat_jsonl"
    path: str = MISSING  # jsonl, one {"messages": [{"role": ..., "content": ...}, ...]} per line
    eval_path: str | None = None
    eval_size: int = 8
    shuffle: bool = True


@dataclass
class FeedbackJsonlData:
    name: str = "feedback_jsonl"
    path: str = MISSING  # jsonl, one {"prompt": ..., "completion": ..., "label": true|false} per line
    eval_path: str | None = None
    eval_size: int = 8
    shuffle: bool = True


def read_chat(line: dict, where: str) -> Messages:
    messages = line.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages
    ):
        raise ValueError(f"{where}: expected 'messages': a list of {{role, content}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message to learn from")
    return messages


def read_feedback(line: dict, where: str) -> Feedback:
    try:
        prompt, completion, label = line["prompt"], line["completion"], line["label"]
    except KeyError as exc:
        raise ValueError(f"{where}: missing key {exc.args[0]!r} (need prompt, completion, label)") from None
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(label, bool):
        raise ValueError(f"{where}: label must be true or false, got {label!r}")
    return Feedback(prompt, completion, label)


def load_chat_jsonl(cfg: ChatJsonlData, seed: int) -> Data:
    train, held = files.train_and_held_out(cfg, read_chat)
    return Data("chat_jsonl", chats=Dataset(files.seeded_order(train, seed, cfg.shuffle), held, len(train)))


def load_feedback_jsonl(cfg: FeedbackJsonlData, seed: int) -> Data:
    train, held = files.train_and_held_out(cfg, read_feedback)
    order = files.seeded_order(train, seed, cfg.shuffle)
    return Data("feedback_jsonl", feedback=Dataset(order, held, len(train)))
