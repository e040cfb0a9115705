"""The loops by name: ``loop.name`` in a config picks one (an explicit dict, no plugin system).

Each entry says what the runner needs to drive a loop: its ``Config`` dataclass (the loop's defaults,
also the ``loop=`` option Hydra composes), its ``train`` function (which returns the steps it ran), the
kind of data it trains on (``envs``, ``chats`` or ``feedback``, see :class:`sess.rl.data.Data`), where
the loop has its own held-out measure an ``evaluate(tc, dataset) -> metrics`` the runner adds to every
evaluation, and the ``presets`` a recipe brings: overrides (``data=code_tasks``) a run of it gets
unless the command line sets the same key or group. ``code_rl`` is such a recipe: the
importance_sampling trainer with its own defaults, on the code task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from sess.loops import code_rl, grpo, importance_sampling, kto, ppo, sft


class Loop(NamedTuple):
    config: type
    train: Callable[..., int]  # train(cfg, tc, dataset, hooks, *, seed, start_step) -> steps done
    data: str  # envs | chats | feedback
    evaluate: Callable[..., dict] | None = None
    presets: tuple[str, ...] = ()  # overrides applied first: the command line's win


LOOPS: dict[str, Loop] = {
    "sft": Loop(sft.Config, sft.train, "chats"),
    "grpo": Loop(grpo.Config, grpo.train, "envs"),
    "ppo": Loop(ppo.Config, ppo.train, "envs"),
    "importance_sampling": Loop(importance_sampling.Config, importance_sampling.train, "envs"),
    "kto": Loop(kto.Config, kto.train, "feedback", kto.evaluate),
    "code_rl": Loop(code_rl.Config, code_rl.train, "envs", presets=code_rl.PRESETS),
}
