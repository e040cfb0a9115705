"""``data=needle``: haystacks as one-turn envs (RL, greedy evaluation) and as chats whose answer is the code (SFT).

Prompts are sized in the run's model's tokens (:mod:`.haystack`): the runner fits the data to the
model's tokenizer and window before the first step, through :attr:`sess.rl.data.Data.fit`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sess.rl.data import Data, Dataset
from sess.rl.env import EnvFactory, Messages

from .haystack import Haystack, Haystacks, LazyList
from .needle_env import NeedleEnv


@dataclass
class NeedleData:
    """``data=needle``: the haystack's length and the question (``sess run data=needle``'s defaults)."""

    name: str = "needle"
    context_tokens: int = 1024  # each prompt's length in the model's tokens (at most this, within a sentence)
    eval_size: int = 32  # held-out haystacks, their needles spread evenly from the start to the end
    code_digits: int = 4
    instruction: str = "Reply with just the code."


def needle_env(haystack: Haystack) -> EnvFactory:
    return lambda: NeedleEnv(haystack)


def needle_chat(haystack: Haystack) -> Messages:
    return [*haystack.prompt(), {"role": "assistant", "content": haystack.code}]


def load_needle(cfg: NeedleData, seed: int) -> Data:
    gen = Haystacks(seed, cfg.context_tokens, cfg.eval_size, cfg.code_digits, cfg.instruction)
    held = LazyList(cfg.eval_size, gen.held_out)
    return Data(
        "needle",
        envs=Dataset(lambda k: needle_env(gen.train(k)), LazyList(len(held), lambda k: needle_env(held[k]))),
        chats=Dataset(
            lambda k: needle_chat(gen.train(k)), LazyList(len(held), lambda k: needle_chat(held[k]))
        ),
        fit=gen.fit,
    )
