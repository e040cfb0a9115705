"""SFT: supervised fine-tuning with cross-entropy on assistant tokens of rendered chats.

Each step takes ``batch_size`` chats (items ``step*batch_size ..`` of the data order: with
``shuffle`` a fresh seeded permutation per epoch, without it file order; arithmetic problems come
with a worked answer ending in ``Answer: <n>``). A chat is rendered with the tokenizer's chat template;
every assistant turn's tokens (content and end-of-turn) get weight ``1/N`` where N is the number of
assistant tokens in the batch, all other tokens weight 0, so the loss
``-(logp · w).sum()`` is the token-mean negative log-likelihood of assistant tokens. One
``forward_backward(cross_entropy)`` and one AdamW ``optim_step`` per step; with a finite data set,
``epochs`` caps the number of steps at ``epochs * len(data) / batch_size``.

Launch: ``sess run loop=sft`` (arithmetic chats) or ``sess run loop=sft data=chat_jsonl data.path=chats.jsonl``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sess.engine import AdamParams

from . import rendering
from .config import LoopConfig

NEEDS = ("chat",)


@dataclass
class Config(LoopConfig):
    name: str = "sft"
    steps: int = 20
    batch_size: int = 16
    learning_rate: float = 2e-4
    epochs: int = 1  # with a file data set: stop after this many passes (0: no cap)
    shuffle: bool = True


def main(run) -> None:
    cfg = run.loop
    adam = AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    steps = cfg.steps
    if run.data.train_size and cfg.epochs:
        steps = min(steps, max(1, cfg.epochs * run.data.train_size // cfg.batch_size))
    for step in range(run.start_step, steps):
        started = time.perf_counter()
        rendered_B = [
            rendering.chat_tokens(run.tok, run.data.train_chat(step * cfg.batch_size + i))
            for i in range(cfg.batch_size)
        ]
        n_assistant = sum(sum(w[1:]) for _, w in rendered_B)
        datums = [
            rendering.shifted_datum(tokens_T, weights=[w / n_assistant for w in weights_T])
            for tokens_T, weights_T in rendered_B
        ]
        fb = run.tc.forward_backward(datums, "cross_entropy")
        opt = run.tc.optim_step(adam)
        out, stepped = fb.result(), opt.result()
        trained = sum(d.model_input.length for d in datums)
        run.step_done(
            step,
            {
                "loss": out.metrics["loss:sum"],
                "grad_norm": stepped.metrics.get("grad_norm", 0.0),
                "assistant_tokens": n_assistant,
                "tokens": trained,
                "seconds": time.perf_counter() - started,
            },
        )
