"""Off-policy RL: rollout workers sample while the trainer trains; importance weights correct the lag.

``rollout_workers`` threads (:mod:`.rollout_workers`) each take the next problem index k (or a
requeued one), run ``group_size`` episodes of that problem's environment with the newest published policy (the env
scores them: for arithmetic, exact final answer 1, wrong 0, unparseable ``-data.format_penalty``) and
hand the group to the trainer, tagged with the policy's step.
At most ``batch_size * (max_steps_off_policy + 1)`` groups are sampled ahead of the trainer. Each
training step takes ``batch_size`` groups; a group sampled by policy step ``v`` at training step ``s``
is used when ``s - v <= max_steps_off_policy``, otherwise ``stale_policy`` says what happens to it:
``requeue`` (resample the same problem from the newest policy) or ``discard``. Advantages are
group-relative (``r_g - mean(r)``), spread over sampled tokens and token-mean normalised; the loss
is ``importance_sampling``: ``-(ρ A).sum()`` with ``ρ = exp(logp - logp_sampler)``, whose ratio
corrects for the policy having moved since the group was sampled. After each ``optim_step`` the
trainer publishes a new sampler (``save_weights_and_get_sampling_client``) for the workers.

Which policy version samples a group depends on timing, so unlike grpo this loop is not bit-for-bit
reproducible. Launch: ``sess run loop=importance_sampling loop.max_steps_off_policy=2``, or on its
own: ``python -m sess.loops.importance_sampling model=tiny-llama loop.steps=2``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sess.engine import AdamParams, SamplingParams, TrainingClient

from . import drift, rollouts
from .datasets import Dataset
from .env import EnvFactory
from .hooks import Hooks
from .rollout_workers import RolloutWorkers


@dataclass
class Config:
    name: str = "importance_sampling"
    steps: int = 20
    batch_size: int = 8  # groups per training step
    group_size: int = 8  # episodes per problem
    learning_rate: float = 1e-4
    grad_clip_norm: float = 1.0
    max_tokens: int = 24  # per turn, in rollouts and in the runner's greedy evaluation
    temperature: float = 1.0
    rollout_workers: int = 2
    max_steps_off_policy: int = 1
    stale_policy: str = "requeue"  # requeue | discard
    scale_by_std: bool = False
    eval_every: int = 10  # read by the runner: evaluate every n steps (0: at start and end only)
    save_every: int = 10  # read by the runner: save state every n steps (0: at the end only)


def check(cfg: Config) -> None:
    if cfg.group_size < 2:
        raise ValueError(f"loop.group_size: group-relative advantages need at least 2, got {cfg.group_size}")
    if cfg.stale_policy not in ("requeue", "discard"):
        raise ValueError(f"loop.stale_policy: expected requeue or discard, got {cfg.stale_policy!r}")
    if cfg.rollout_workers < 1 or cfg.max_steps_off_policy < 0:
        raise ValueError("loop.rollout_workers must be >= 1 and loop.max_steps_off_policy >= 0")


def train(
    cfg: Config,
    tc: TrainingClient,
    envs: Dataset[EnvFactory],
    hooks: Hooks,
    *,
    seed: int = 0,
    start_step: int = 0,
) -> None:
    check(cfg)
    adam = AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    pool = RolloutWorkers(
        tc.get_tokenizer(),
        envs,
        seed=seed,
        group_size=cfg.group_size,
        sampling=SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature),
        workers=cfg.rollout_workers,
        capacity=cfg.batch_size * (cfg.max_steps_off_policy + 1),
        first_index=start_step * cfg.batch_size,
        sampler=tc.save_weights_and_get_sampling_client(),
        policy_step=start_step,
    )
    try:
        for step in range(start_step, cfg.steps):
            started = time.perf_counter()
            # Take batch_size groups no more than max_steps_off_policy behind; requeue or drop the rest.
            groups_P, stale, lags = [], 0, []
            while len(groups_P) < cfg.batch_size:
                group, lag, skipped = pool.take_fresh(
                    step, cfg.max_steps_off_policy, requeue=cfg.stale_policy == "requeue"
                )
                stale += skipped
                groups_P.append(group)
                lags.append(lag)
            metrics = rollouts.batch_metrics(groups_P)
            # Group-relative advantages, token-mean normalised, on sampled tokens (as in grpo).
            advantages_P_G = [rollouts.group_advantages(g.rewards_G, cfg.scale_by_std) for g in groups_P]
            kept = [(g, a_G) for g, a_G in zip(groups_P, advantages_P_G) if any(abs(a) > 1e-9 for a in a_G)]
            n_tokens = sum(e.n_sampled for g, _ in kept for e in g.episodes_G)
            datums = [
                rollouts.policy_datum(e, a / n_tokens) for g, a_G in kept for e, a in zip(g.episodes_G, a_G)
            ]
            # The importance_sampling loss: its ratio exp(logp - logp_sampler) corrects for the lag.
            if datums:
                fb = tc.forward_backward(datums, loss_fn="importance_sampling")
                opt = tc.optim_step(adam)
                metrics.update(
                    loss=fb.result().metrics["loss:sum"], grad_norm=opt.result().metrics.get("grad_norm", 0.0)
                )
                metrics.update(drift.sample_train_drift(datums, fb.result().loss_fn_outputs))
            else:
                metrics.update(loss=0.0)
            metrics.update(datums=len(datums), trained_tokens=sum(d.model_input.length for d in datums))
            pool.publish(step + 1, tc.save_weights_and_get_sampling_client())
            metrics.update(
                stale_groups=stale,
                off_policy_steps=sum(lags) / len(lags),
                tokens=rollouts.sampled_tokens(groups_P) + metrics["trained_tokens"],
                seconds=time.perf_counter() - started,
            )
            hooks.step_done(step, metrics)
    finally:
        pool.close()


if __name__ == "__main__":
    from .runner import main

    main("importance_sampling")
