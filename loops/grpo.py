"""GRPO: group sampling with group-relative advantages, one policy-gradient update per step.

Each step takes ``batch_size`` problems (item ``step*batch_size + i`` of the seeded order) and samples
``group_size`` completions of each from the current policy (temperature ``temperature``, at most
``max_tokens`` tokens, seed derived from (run seed, step, i)). Reward: 1 for the exact final answer, 0
for a wrong one, ``-format_penalty`` when no number can be parsed. Advantage of completion g:
``A_g = r_g - mean(r)`` over its group (divided by ``std(r)`` when ``scale_by_std``); groups whose
rewards are all equal carry no signal and are dropped. Every completion token gets its sequence's
advantage, divided by the number of completion tokens in the batch (token-mean normalisation); prompt
tokens get 0. The loss is ``loss`` (ppo by default: ``-min(ρA, clip(ρ, 0.8, 1.2)A)`` with
``ρ = exp(logp - logp_sampler)``; or cispo, importance_sampling, dro with ``loss_config``), one
``forward_backward`` + AdamW ``optim_step`` per step, no KL term, no reference model. After the update
``save_weights_and_get_sampling_client`` gives the sampler of the next step, so sampling is on-policy.

Launch: ``sess run`` (this is the default loop) or ``sess run loop=grpo model=tiny-llama loop.steps=2``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sess.engine import AdamParams

from . import rollouts
from .config import LoopConfig

NEEDS = ("problem",)
LOSSES = ("ppo", "cispo", "importance_sampling", "dro")


@dataclass
class Config(LoopConfig):
    name: str = "grpo"
    group_size: int = 8
    loss: str = "ppo"  # ppo | cispo | importance_sampling | dro
    loss_config: dict = field(
        default_factory=dict
    )  # e.g. {clip_low_threshold: 0.8, clip_high_threshold: 1.2}
    scale_by_std: bool = False
    format_penalty: float = 0.1


def check(cfg) -> None:
    if "loss" in cfg and cfg.loss not in LOSSES:
        raise ValueError(f"loop.loss: expected one of {', '.join(LOSSES)}, got {cfg.loss!r}")
    if cfg.group_size < 2:
        raise ValueError(f"loop.group_size: group-relative advantages need at least 2, got {cfg.group_size}")


def train_step(
    run, groups_P: list[rollouts.Group], loss: str, loss_config: dict | None, adam: AdamParams
) -> dict:
    """One update from scored groups; returns the step's loss metrics (zeros when no group has signal)."""
    advantages_P_G = [rollouts.group_advantages(g.rewards_G, run.loop.scale_by_std) for g in groups_P]
    kept = [(g, a_G) for g, a_G in zip(groups_P, advantages_P_G) if any(abs(a) > 1e-9 for a in a_G)]
    n_tokens = sum(len(t) for g, _ in kept for t in g.tokens_G_T)
    datums = [
        rollouts.policy_datum(g.prompt_T, tokens_T, logprobs_T, a / n_tokens)
        for g, a_G in kept
        for tokens_T, logprobs_T, a in zip(g.tokens_G_T, g.logprobs_G_T, a_G)
    ]
    if not datums:
        return {"loss": 0.0, "datums": 0, "trained_tokens": 0}
    fb = run.tc.forward_backward(datums, loss_fn=loss, loss_fn_config=loss_config or None)
    opt = run.tc.optim_step(adam)
    out, step = fb.result(), opt.result()
    return {
        "loss": out.metrics["loss:sum"],
        "grad_norm": step.metrics.get("grad_norm", 0.0),
        "datums": len(datums),
        "trained_tokens": sum(d.model_input.length for d in datums),
    }


def main(run) -> None:
    cfg = run.loop
    check(cfg)
    adam = AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    sc = run.tc.save_weights_and_get_sampling_client()
    for step in range(run.start_step, cfg.steps):
        started = time.perf_counter()
        problems_P = [run.data.train_problem(step * cfg.batch_size + i) for i in range(cfg.batch_size)]
        groups_P = rollouts.sample_groups(run, sc, problems_P, cfg.group_size, step)
        metrics = rollouts.batch_metrics(groups_P)
        metrics.update(train_step(run, groups_P, cfg.loss, dict(cfg.loss_config), adam))
        sc = run.tc.save_weights_and_get_sampling_client()
        metrics["tokens"] = rollouts.sampled_tokens(groups_P) + metrics["trained_tokens"]
        metrics["seconds"] = time.perf_counter() - started
        run.step_done(step, metrics)
