"""GRPO: group sampling with group-relative advantages, one policy-gradient update per step.

Each step takes ``batch_size`` problems (environment factories, item ``step*batch_size + i`` of the
seeded order) and runs ``group_size`` episodes of each with the current policy (temperature
``temperature``, at most ``max_tokens`` tokens per turn, seed derived from (run seed, step, i)). The
env scores each episode; for ``data=arithmetic`` that is 1 for the exact final answer, 0 for a wrong
one, ``-data.format_penalty`` when no number can be parsed. Advantage of episode g:
``A_g = r_g - mean(r)`` over its group (divided by ``std(r)`` when ``scale_by_std``); groups whose
rewards are all equal carry no signal and are dropped. Every sampled token gets its episode's
advantage divided by the number of sampled tokens in the batch (token-mean normalisation); prompt and
observation tokens get 0. The loss is ``loss`` (ppo by default: ``-min(ρA, clip(ρ, 0.8, 1.2)A)`` with
``ρ = exp(logp - logp_sampler)``; or cispo, importance_sampling, dro with ``loss_config``), one
``forward_backward`` + AdamW ``optim_step`` per step, no KL term, no reference model. After the update
``save_weights_and_get_sampling_client`` gives the sampler of the next step, so sampling is on-policy.

Launch: ``sess run`` (this is the default loop), ``sess run loop=grpo model=tiny-llama loop.steps=2``,
or the run harness without the CLI, which records a run like ``sess run`` does:
``python -m sess.harness loop=grpo model=tiny-llama loop.steps=2``. From Python with no runner at all:
``grpo.train(grpo.Config(steps=2), tc, data.envs, PrintMetrics())`` for any training client ``tc``
and, e.g., ``data = load_arithmetic(ArithmeticData(), seed=0)`` (:mod:`sess.tasks.arithmetic.source`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sess.engine import AdamParams, TrainingClient
from sess.engine.protocol.loss_registry import check_policy_loss
from sess.rl import rollouts
from sess.rl import step as rl_step
from sess.rl.data import Dataset
from sess.rl.env import EnvFactory
from sess.rl.hooks import Hooks
from sess.rl.step import RolloutConfig


@dataclass
class Config(RolloutConfig):
    """Sized for smollm2-135m on CPU: short answers, 8 prompts x 8 samples per step, 20 steps (the
    README's results table gives what it reaches). The batch and sampling settings it shares with
    the other policy-gradient loops: :class:`~sess.rl.step.RolloutConfig`."""

    name: str = "grpo"
    learning_rate: float = 1e-4  # higher rates collapse the policy within 20 steps (benchmarks/README.md)
    max_tokens: int = 16  # per turn, in rollouts and in the runner's greedy evaluation
    loss: str = "ppo"  # a policy-gradient loss (sess.engine.protocol.loss_registry), e.g. cispo
    # e.g. +loop.loss_config.clip_low_threshold=0.7 (ppo, cispo) or +loop.loss_config.beta=0.1 (dro)
    loss_config: dict = field(default_factory=dict)


def check(cfg: Config) -> None:
    check_policy_loss("loop.loss", cfg.loss)
    if cfg.group_size < 2:
        raise ValueError(f"loop.group_size: group-relative advantages need at least 2, got {cfg.group_size}")
    rollouts.check_observation_cap(cfg.max_observation_tokens)


def train(
    cfg: Config,
    tc: TrainingClient,
    envs: Dataset[EnvFactory],
    hooks: Hooks,
    *,
    seed: int = 0,
    start_step: int = 0,
) -> int:
    """Train steps ``start_step .. cfg.steps - 1``; returns the number of steps done (``cfg.steps``)."""
    check(cfg)
    tok = tc.get_tokenizer()
    adam = AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    sc = tc.save_weights_and_get_sampling_client()
    for step in range(start_step, cfg.steps):
        started = time.perf_counter()
        # 1. Sample and score: group_size episodes of each of batch_size problems; the envs give rewards.
        groups_P = rl_step.sample_groups(sc, tok, envs, cfg, seed=seed, step=step)
        metrics = rollouts.batch_metrics(groups_P)
        # 2. Datums: group-relative advantages (a group whose rewards are all equal has no signal), each
        #    episode's divided by the batch's sampled tokens, on its sampled tokens.
        datums = rollouts.batch_datums(groups_P, cfg.scale_by_std)
        # 3. Update: forward_backward with the clipped loss, then AdamW (queued behind it on the engine).
        loss_config = dict(cfg.loss_config) or None
        passes = [tc.forward_backward(datums, loss_fn=cfg.loss, loss_fn_config=loss_config)] if datums else []
        metrics.update(rl_step.update(tc, passes, datums, adam, rl_step.clip_range(cfg.loss, loss_config)))
        metrics.update(datums=len(datums), trained_tokens=sum(d.model_input.length for d in datums))
        # 4. The next step samples from the new weights (on-policy).
        sc = tc.save_weights_and_get_sampling_client()
        metrics["tokens"] = rollouts.sampled_tokens(groups_P) + metrics["trained_tokens"]
        metrics["seconds"] = time.perf_counter() - started
        hooks.step_done(step, metrics)
    return cfg.steps
