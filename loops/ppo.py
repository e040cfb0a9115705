"""PPO: several clipped epochs over each batch of rollouts, with a KL penalty to the base model.

Each step samples ``group_size`` completions for each of ``batch_size`` problems from the current
policy (the sampler's per-token logprobs are ``logp_old``) and scores them like GRPO (exact final
answer 1, wrong 0, unparseable ``-format_penalty``). There is no value network: the baseline is the
group mean, ``A_g = r_g - mean(r)``. The reference is the base model (adapter off): its logprobs of
every sampled token come from ``svc.create_sampling_client(base_model=...).compute_logprobs``. The KL
penalty is folded into the per-token advantage, ``A_t = A_g - kl_coef * (logp_old_t - logp_ref_t)``
(the k1 estimator of KL(policy || base) at the sampled token), divided by the number of completion
tokens in the batch. Then ``epochs`` passes, each over ``minibatches`` shuffled minibatches, take one
``forward_backward(loss_fn="ppo", clip [clip_low, clip_high])`` + AdamW ``optim_step`` per minibatch,
always against the same ``logp_old`` — so later minibatches are off-policy and the clip bounds them.

Launch: ``sess run loop=ppo`` or ``sess run loop=ppo model=tiny-llama loop.steps=2 loop.kl_coef=0.1``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

from sess.engine import AdamParams

from . import rollouts
from .config import LoopConfig

NEEDS = ("problem",)


@dataclass
class Config(LoopConfig):
    name: str = "ppo"
    group_size: int = 4
    epochs: int = 2
    minibatches: int = 2
    clip_low: float = 0.8
    clip_high: float = 1.2
    kl_coef: float = 0.05
    scale_by_std: bool = False
    format_penalty: float = 0.1


def reference_logprobs(ref_sc, group: rollouts.Group) -> list[list[float]]:
    """Base-model logprobs of each member's completion tokens (``ref_T`` per member)."""
    futures = [ref_sc.compute_logprobs(group.prompt_T + tokens_T) for tokens_T in group.tokens_G_T]
    n = len(group.prompt_T)
    return [[float(x) for x in f.result()[n:]] for f in futures]


def main(run) -> None:
    cfg = run.loop
    adam = AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    ref_sc = run.svc.create_sampling_client(base_model=run.tc.base_model)
    clip = {"clip_low_threshold": cfg.clip_low, "clip_high_threshold": cfg.clip_high}
    sc = run.tc.save_weights_and_get_sampling_client()
    for step in range(run.start_step, cfg.steps):
        started = time.perf_counter()
        problems_P = [run.data.train_problem(step * cfg.batch_size + i) for i in range(cfg.batch_size)]
        groups_P = rollouts.sample_groups(run, sc, problems_P, cfg.group_size, step)
        n_tokens = max(1, rollouts.sampled_tokens(groups_P))
        datums, kls = [], []
        for group in groups_P:
            advantages_G = rollouts.group_advantages(group.rewards_G, cfg.scale_by_std)
            ref_G_T = reference_logprobs(ref_sc, group)
            for tokens_T, old_T, ref_T, a in zip(group.tokens_G_T, group.logprobs_G_T, ref_G_T, advantages_G):
                kl_T = np.asarray(old_T) - np.asarray(ref_T)
                kls.append(float(kl_T.sum()))
                advantages_T = (a - cfg.kl_coef * kl_T) / n_tokens
                datums.append(rollouts.policy_datum(group.prompt_T, tokens_T, old_T, advantages_T))
        order = list(range(len(datums)))
        rng = random.Random(f"{run.seed}/ppo/{step}")
        losses, trained = [], 0
        for _ in range(cfg.epochs):
            rng.shuffle(order)
            for mb in range(cfg.minibatches):
                chosen = [datums[i] for i in order[mb :: cfg.minibatches]]
                if not chosen:
                    continue
                fb = run.tc.forward_backward(chosen, loss_fn="ppo", loss_fn_config=clip)
                opt = run.tc.optim_step(adam)
                losses.append(fb.result().metrics["loss:sum"])
                opt.result()
                trained += sum(d.model_input.length for d in chosen)
        sc = run.tc.save_weights_and_get_sampling_client()
        metrics = rollouts.batch_metrics(groups_P)
        metrics.update(
            loss=losses[0] if losses else 0.0,  # the first minibatch is on-policy: comparable across steps
            loss_last=losses[-1] if losses else 0.0,
            kl=float(np.mean(kls)),
            tokens=rollouts.sampled_tokens(groups_P) + trained,
            seconds=time.perf_counter() - started,
        )
        run.step_done(step, metrics)
