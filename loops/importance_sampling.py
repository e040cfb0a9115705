"""Off-policy RL: rollout workers sample while the trainer trains; importance weights correct the lag.

``rollout_workers`` threads (:mod:`sess.rl.rollout_workers`) each take the next problem index k (or a
requeued one), run ``group_size`` episodes of that problem's environment with the newest published
policy (at most ``max_turns`` replies each; the env scores them: for arithmetic, exact final answer 1,
wrong 0, unparseable ``-data.format_penalty``) and hand the group to the trainer, tagged with the
policy's step. At most ``batch_size * (max_steps_off_policy + 1)`` groups are sampled ahead of the
trainer. Each training step takes ``batch_size`` groups; a group sampled by policy step ``v`` at
training step ``s`` is used when ``s - v <= max_steps_off_policy``, otherwise ``stale_policy`` says
what happens to it: ``requeue`` (resample the same problem from the newest policy, at most
``max_requeues`` times: a problem resampled that often is used at its lag, which the loss's ratio
corrects) or ``discard``. Each group's staleness ``s - v`` is recorded. The sampling this allows is
bounded by the config (:meth:`sess.rl.rollout_workers.RolloutWorkers.take_fresh` says how), the
bound ``sess run --dry-run`` forecasts.

Advantages are group-relative (``A_g = r_g - mean(r)`` over the group, divided by ``std(r)`` with
``scale_by_std``); a group whose rewards are all equal has no signal and sends nothing. Two ways to
feed them to the engine, one option:

- ``stream=false`` (the default): once the step's groups are in, one ``forward_backward`` over the
  batch, each sampled token weighted by its episode's advantage over the batch's sampled tokens
  (token-mean, as in grpo).
- ``stream=true``: each group's datums go to ``forward_backward`` as soon as the group is taken, while
  later groups are still being sampled; the engine adds up their gradients. The losses reduce by token
  sum, so the sub-batches' gradients add up to the one-batch gradient; what must be fixed before the
  batch is complete is the normaliser, so an advantage is divided by its group's sampled tokens and
  by ``batch_size``: each group weighs the same, token-mean within it.

The loss is ``loss`` (``importance_sampling`` by default: ``-(ρ A).sum()`` with ``ρ = exp(logp -
logp_sampler)``; or cispo, ppo, dro with ``loss_config``), whose ratio corrects for the policy having
moved since the group was sampled. One AdamW ``optim_step`` per step applies the (summed) gradient,
then the trainer publishes a new sampler (``save_weights_and_get_sampling_client``) for the workers.

Which policy version samples a group depends on timing, so unlike grpo this loop is not bit-for-bit
reproducible. Launch: ``sess run loop=importance_sampling loop.max_steps_off_policy=2``, or without
the CLI: ``python -m sess.harness loop=importance_sampling model=tiny-llama loop.steps=2``. ``loop=code_rl``
(:mod:`.code_rl`) is this trainer streaming on the code task.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sess.engine import AdamParams, SamplingParams, TrainingClient
from sess.engine.protocol.loss_registry import check_policy_loss
from sess.rl import rollouts
from sess.rl import step as rl_step
from sess.rl.data import Dataset
from sess.rl.env import EnvFactory
from sess.rl.hooks import Hooks
from sess.rl.rollout_workers import RolloutWorkers, check_requeue_limit
from sess.rl.step import RolloutConfig


@dataclass
class Config(RolloutConfig):
    """The batch and sampling settings beside these: :class:`~sess.rl.step.RolloutConfig`."""

    name: str = "importance_sampling"
    loss: str = "importance_sampling"  # policy-gradient loss (sess.engine.protocol.loss_registry), e.g. cispo
    loss_config: dict = field(default_factory=dict)  # e.g. +loop.loss_config.clip_high_threshold=2 (cispo)
    rollout_workers: int = 2  # groups sampled at once: the engine decodes all their rows in one batch
    max_steps_off_policy: int = 1
    stale_policy: str = "requeue"  # requeue | discard
    max_requeues: int = 1  # times a stale problem is resampled (requeue); then it is used at its lag
    stream: bool = False  # true: each group goes to forward_backward as soon as it is taken


def check(cfg: Config) -> None:
    check_policy_loss("loop.loss", cfg.loss)
    if cfg.group_size < 2:
        raise ValueError(f"loop.group_size: group-relative advantages need at least 2, got {cfg.group_size}")
    if cfg.stale_policy not in ("requeue", "discard"):
        raise ValueError(f"loop.stale_policy: expected requeue or discard, got {cfg.stale_policy!r}")
    if cfg.rollout_workers < 1 or cfg.max_steps_off_policy < 0:
        raise ValueError("loop.rollout_workers must be >= 1 and loop.max_steps_off_policy >= 0")
    check_requeue_limit(cfg.max_requeues)
    if cfg.max_turns is not None and cfg.max_turns < 1:
        raise ValueError(f"loop.max_turns: expected 1 or more, got {cfg.max_turns}")
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
    adam = AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    loss_config = dict(cfg.loss_config) or None
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
        max_turns=cfg.max_turns,
        max_observation_tokens=cfg.max_observation_tokens,
        trainer_logprobs=cfg.trainer_logprobs,
    )
    try:
        for step in range(start_step, cfg.steps):
            started = time.perf_counter()
            # 1. Take batch_size groups no more than max_steps_off_policy behind; requeue or drop the rest.
            #    Streaming: each group's datums go to forward_backward at once (a sub-batch).
            groups_P, staleness_P, stale, passes, datums = [], [], 0, [], []
            while len(groups_P) < cfg.batch_size:
                group, lag, skipped = pool.take_fresh(
                    step,
                    cfg.max_steps_off_policy,
                    requeue=cfg.stale_policy == "requeue",
                    max_requeues=cfg.max_requeues,
                )
                stale += skipped
                groups_P.append(group)
                staleness_P.append(lag)
                if cfg.stream and (
                    sub_batch := rollouts.group_datums(group, cfg.batch_size, cfg.scale_by_std)
                ):
                    passes.append(
                        tc.forward_backward(sub_batch, loss_fn=cfg.loss, loss_fn_config=loss_config)
                    )
                    datums += sub_batch
            metrics = rollouts.batch_metrics(groups_P)
            # 2. Not streaming: one forward_backward over the batch, advantages token-mean normalised (as in grpo).
            if not cfg.stream and (datums := rollouts.batch_datums(groups_P, cfg.scale_by_std)):
                passes.append(tc.forward_backward(datums, loss_fn=cfg.loss, loss_fn_config=loss_config))
            # 3. One AdamW step on the summed gradients; the loss's ratio exp(logp - logp_sampler) corrects the lag.
            clip = rl_step.clip_range(cfg.loss, loss_config)
            metrics.update(rl_step.update(tc, passes, datums, adam, clip))
            # 4. The workers sample from the new weights from now on.
            pool.publish(step + 1, tc.save_weights_and_get_sampling_client())
            sampled = rollouts.sampled_tokens(groups_P)
            if cfg.stream:
                metrics.update(datums=len(datums), sub_batches=len(passes), tokens=sampled)
            else:
                trained = sum(d.model_input.length for d in datums)
                metrics.update(datums=len(datums), trained_tokens=trained, tokens=sampled + trained)
            metrics.update(
                stale_groups=stale,
                off_policy_steps=sum(staleness_P) / len(staleness_P),
                seconds=time.perf_counter() - started,
            )
            if cfg.stream:
                metrics["group_staleness"] = staleness_P
            hooks.step_done(step, metrics)
    finally:
        pool.close()
    return cfg.steps
