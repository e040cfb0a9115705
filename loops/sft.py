"""SFT: supervised fine-tuning with cross-entropy on assistant tokens of rendered chats.

Each step takes ``batch_size`` chats (items ``step*batch_size ..`` of the data order: for files a
fresh seeded permutation per epoch, or file order with ``data.shuffle=false``; arithmetic problems
come with a worked answer ending in ``Answer: <n>``). A chat is rendered with the tokenizer's chat template;
every assistant turn's tokens (content and end-of-turn) get weight ``1/N`` where N is the number of
assistant tokens in the batch, all other tokens weight 0, so the loss
``-(logp · w).sum()`` is the token-mean negative log-likelihood of assistant tokens. One
``forward_backward(cross_entropy)`` and one AdamW ``optim_step`` per step; with a finite data set,
``epochs`` caps the number of steps at ``epochs * len(data) / batch_size``.

Launch: ``sess run loop=sft`` (arithmetic chats), ``sess run loop=sft data=chat_jsonl data.path=chats.jsonl``,
or without the CLI: ``python -m sess.harness loop=sft model=tiny-llama loop.steps=2``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sess.engine import AdamParams, TrainingClient
from sess.rl import rendering
from sess.rl.data import Dataset
from sess.rl.env import Messages
from sess.rl.hooks import Hooks


@dataclass
class Config:
    name: str = "sft"
    steps: int = 20
    batch_size: int = 16  # chats per step
    learning_rate: float = 2e-4
    grad_clip_norm: float = 1.0
    max_tokens: int = 16  # the runner's greedy evaluation budget
    epochs: int = 1  # with a file data set: stop after this many passes (0: no cap)


def train(
    cfg: Config,
    tc: TrainingClient,
    chats: Dataset[Messages],
    hooks: Hooks,
    *,
    seed: int = 0,  # unused: the data order is seeded already
    start_step: int = 0,
) -> int:
    """Train steps ``start_step ..``; returns the number of steps done: ``cfg.steps``, or fewer when
    ``epochs`` ends a finite data set first."""
    tok = tc.get_tokenizer()
    adam = AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    steps = cfg.steps
    if chats.size and cfg.epochs:
        steps = min(steps, max(1, cfg.epochs * chats.size // cfg.batch_size))
    for step in range(start_step, steps):
        started = time.perf_counter()
        rendered_B = [
            rendering.chat_tokens(tok, chats.train(step * cfg.batch_size + i)) for i in range(cfg.batch_size)
        ]
        # Weight 1/N on each of the batch's N assistant tokens: the loss is their token-mean NLL.
        n_assistant = sum(sum(w[1:]) for _, w in rendered_B)
        datums = [
            rendering.shifted_datum(tokens_T, weights=[w / n_assistant for w in weights_T])
            for tokens_T, weights_T in rendered_B
        ]
        fb = tc.forward_backward(datums, "cross_entropy")
        opt = tc.optim_step(adam)
        out, stepped = fb.result(), opt.result()
        trained = sum(d.model_input.length for d in datums)
        hooks.step_done(
            step,
            {
                "loss": out.metrics["loss:sum"],
                "grad_norm": stepped.metrics.get("grad_norm", 0.0),
                "assistant_tokens": n_assistant,
                "tokens": trained,
                "seconds": time.perf_counter() - started,
            },
        )
    return max(steps, start_step)
