"""The loops by name: ``loop.name`` in a config picks one (an explicit dict, no plugin system).

Each entry says what the runner needs to drive a loop: its ``Config`` dataclass (the loop's defaults,
also the ``loop=`` option Hydra composes), its ``train`` function, the kind of data it trains on
(``envs``, ``chats`` or ``feedback``, see :class:`~.datasets.Data`) and, where the loop has its own
held-out measure, an ``evaluate(tc, dataset) -> metrics`` the runner adds to every evaluation, and
where it trains on its own kind of data, the ``data=`` option a run of it gets when none is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from . import code_rl, grpo, importance_sampling, kto, ppo, sft


class Loop(NamedTuple):
    config: type
    train: Callable[..., None]  # train(cfg, tc, dataset, hooks, *, seed, start_step)
    data: str  # envs | chats | feedback
    evaluate: Callable[..., dict] | None = None
    default_data: str | None = None  # data= when the command line names none (else config.yaml's)


LOOPS: dict[str, Loop] = {
    "sft": Loop(sft.Config, sft.train, "chats"),
    "grpo": Loop(grpo.Config, grpo.train, "envs"),
    "ppo": Loop(ppo.Config, ppo.train, "envs"),
    "importance_sampling": Loop(importance_sampling.Config, importance_sampling.train, "envs"),
    "kto": Loop(kto.Config, kto.train, "feedback", kto.evaluate),
    "code_rl": Loop(code_rl.Config, code_rl.train, "envs", default_data="code_tasks"),
}
