"""PPO: several clipped epochs over each batch of rollouts, with a KL penalty to the base model.

Each step runs ``group_size`` episodes of each of ``batch_size`` problems (environment factories)
with the current policy (the sampler's per-token logprobs are ``logp_old``); the env scores them like
GRPO's (arithmetic: exact final answer 1, wrong 0, unparseable ``-data.format_penalty``). There is no
value network: the baseline is the group mean, ``A_g = r_g - mean(r)``. The reference is the base
model (adapter off): its logprobs of every episode token come from
``tc.service.create_sampling_client(base_model=...).compute_logprobs``. The KL penalty is folded into
the per-token advantage of sampled tokens, ``A_t = A_g - kl_coef * (logp_old_t - logp_ref_t)`` (the k1
estimator of KL(policy || base) at the sampled token), divided by the number of sampled tokens in the
batch; prompt and observation tokens get 0. Then ``epochs`` passes, each over ``minibatches``
shuffled minibatches, take one ``forward_backward(loss_fn="ppo", clip [clip_low, clip_high])`` + AdamW
``optim_step`` per minibatch, always against the same ``logp_old`` — so later minibatches are
off-policy and the clip bounds them. Recorded beside the loss: ``kl`` (per episode, summed over its
tokens) and ``kl/reference_per_token`` (per sampled token), ``clip/fraction`` over every minibatch's
sampled tokens, and the drift of the first (on-policy) minibatch (:mod:`sess.rl.drift`).

Launch: ``sess run loop=ppo``, ``sess run loop=ppo model=tiny-llama loop.steps=2 loop.kl_coef=0.1``,
or without the CLI: ``python -m sess.harness loop=ppo model=tiny-llama loop.steps=2``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

from sess.engine import AdamParams, TrainingClient
from sess.rl import drift, rollouts
from sess.rl import step as rl_step
from sess.rl.data import Dataset
from sess.rl.env import EnvFactory
from sess.rl.hooks import Hooks
from sess.rl.rollouts import Episode
from sess.rl.step import RolloutConfig


@dataclass
class Config(RolloutConfig):
    """The batch and sampling settings beside these: :class:`~sess.rl.step.RolloutConfig`."""

    name: str = "ppo"
    group_size: int = 4  # episodes per problem
    epochs: int = 2
    minibatches: int = 2
    clip_low: float = 0.8
    clip_high: float = 1.2
    kl_coef: float = 0.05
    scale_by_std: bool = False


def kl_to_reference(ref_sc, episodes: list[Episode]) -> list[np.ndarray]:
    """Per token of each episode: ``logp_old - logp_ref`` on sampled tokens, 0 elsewhere (``kl_T``)."""
    futures = [ref_sc.compute_logprobs(e.tokens_T) for e in episodes]
    kls = []
    for e, future in zip(episodes, futures):
        ref_T = np.asarray([0.0 if x is None else float(x) for x in future.result()])
        kls.append(np.where(e.sampled_T, np.asarray(e.logprobs_T) - ref_T, 0.0))
    return kls


def train(
    cfg: Config,
    tc: TrainingClient,
    envs: Dataset[EnvFactory],
    hooks: Hooks,
    *,
    seed: int = 0,
    start_step: int = 0,
) -> int:
    """Train steps ``start_step ..``; returns the number of steps done (``cfg.steps``)."""
    rollouts.check_observation_cap(cfg.max_observation_tokens)
    tok = tc.get_tokenizer()
    adam = AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    ref_sc = tc.service.create_sampling_client(base_model=tc.base_model)
    clip = {"clip_low_threshold": cfg.clip_low, "clip_high_threshold": cfg.clip_high}
    sc = tc.save_weights_and_get_sampling_client()
    for step in range(start_step, cfg.steps):
        started = time.perf_counter()
        # Rollouts from the current policy; their sampler logprobs are logp_old for every epoch.
        groups_P = rl_step.sample_groups(sc, tok, envs, cfg, seed=seed, step=step)
        # Advantages: group baseline minus the KL penalty per sampled token, token-mean normalised.
        n_tokens = max(1, rollouts.sampled_tokens(groups_P))
        datums, kls = [], []
        for group in groups_P:
            advantages_G = rollouts.group_advantages(group.rewards_G, cfg.scale_by_std)
            kl_G_T = kl_to_reference(ref_sc, group.episodes_G)
            for episode, kl_T, a in zip(group.episodes_G, kl_G_T, advantages_G):
                kls.append(float(kl_T.sum()))
                datums.append(rollouts.policy_datum(episode, (a - cfg.kl_coef * kl_T) / n_tokens))
        # Clipped epochs over shuffled minibatches, all against the same logp_old.
        order = list(range(len(datums)))
        rng = random.Random(f"{seed}/ppo/{step}")
        losses, trained, drifts, seen = [], 0, {}, ([], [])
        for _ in range(cfg.epochs):
            rng.shuffle(order)
            for mb in range(cfg.minibatches):
                chosen = [datums[i] for i in order[mb :: cfg.minibatches]]
                if not chosen:
                    continue
                fb = tc.forward_backward(chosen, loss_fn="ppo", loss_fn_config=clip)
                opt = tc.optim_step(adam)
                losses.append(fb.result().metrics["loss:sum"])
                if len(losses) == 1:  # the first minibatch is on-policy: the sampler's own weights
                    drifts = drift.sample_train_drift(chosen, fb.result().loss_fn_outputs)
                seen[0].extend(chosen)  # every minibatch's ratios, for the clip fraction
                seen[1].extend(fb.result().loss_fn_outputs)
                opt.result()
                trained += sum(d.model_input.length for d in chosen)
        sc = tc.save_weights_and_get_sampling_client()
        metrics = rollouts.batch_metrics(groups_P)
        metrics.update(
            loss=losses[0] if losses else 0.0,  # the first minibatch is on-policy: comparable across steps
            loss_last=losses[-1] if losses else 0.0,
            kl=float(np.mean(kls)),
            **{"kl/reference_per_token": sum(kls) / n_tokens},  # k1 estimate of KL(policy || base)
            **drift.clip_fraction(*seen, cfg.clip_low, cfg.clip_high),
            tokens=rollouts.sampled_tokens(groups_P) + trained,
            seconds=time.perf_counter() - started,
            **drifts,
        )
        hooks.step_done(step, metrics)
    return cfg.steps
