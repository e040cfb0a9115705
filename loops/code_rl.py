"""Code RL, a recipe: the importance_sampling trainer, streaming, on the code task.

This module holds no training code: ``loop=code_rl`` is :mod:`.importance_sampling`'s trainer with
``stream=true``, the cispo loss, ``max_turns=1`` and code-sized sampling (:class:`Config`), trained on
``data=code_tasks`` (:mod:`sess.tasks.code`: generated function-writing tasks; or ``data=code_jsonl``)
unless ``data=`` says otherwise, and evaluated with ``eval_samples=4`` sampled answers a problem
beside the greedy one (the run harness applies both presets, ``sess.harness.registry``).

Each problem is an environment (:mod:`sess.tasks.code.code_env`): the reply's code blocks run against the
problem's tests in the run's grader (``grader=local``, bubblewrap on this machine, or
``grader=sandbox_fusion grader.url=...``); reward 1 when every test passes, 0 otherwise,
``-data.format_penalty`` when the reply has no code block. With ``max_turns=2`` the policy may first
call ``check_solution`` and read the test verdict before its final answer, both turns trained on
(sampled tokens weight 1, the tool's result weight 0).

Which policy samples a group depends on timing, so (like importance_sampling) runs are not bit-for-bit
reproducible. Launch: ``sess run loop=code_rl``, ``sess run loop=code_rl loop.max_turns=2``, or
``python -m sess.harness loop=code_rl model=tiny-llama loop.steps=2``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import importance_sampling

train = importance_sampling.train


@dataclass
class Config(importance_sampling.Config):
    """Sized for smollm2-135m on a shared 2-core CPU: 20 steps of 8 problems x 8 samples of at most
    64 tokens at learning rate 1e-4 (benchmarks/code_rl.py measures it)."""

    name: str = "code_rl"
    max_tokens: int = 64  # per turn, in rollouts and in the runner's greedy evaluation
    temperature: float = 0.8
    max_turns: int | None = 1  # 2: the policy may call check_solution once before its final answer
    loss: str = "cispo"
    rollout_workers: int = 8  # groups sampled at once: the engine decodes all their rows in one batch
    stream: bool = True


PRESETS = ("data=code_tasks", "eval_samples=4")  # what `loop=code_rl` sets unless the command line does
