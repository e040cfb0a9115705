"""The RL step the policy-gradient loops share: its settings, sampling a batch of groups, one update.

:class:`RolloutConfig` holds the settings grpo, ppo and importance_sampling have in common (the
batch, the sampling, AdamW's learning rate and clip); each loop's ``Config`` extends it with its own
fields and the defaults it changes. :func:`sample_groups` is a step's first half in grpo and ppo: ``batch_size`` problems (items
``step*batch_size + i`` of the seeded order), ``group_size`` episodes of each with the sampler,
request seeds derived from (run seed, step, i), the envs' rewards on every episode
(:func:`sess.rl.rollouts.rollout_groups`). :func:`update` is the last half in grpo and
importance_sampling: one AdamW ``optim_step`` over the gradients that one or more
``forward_backward`` passes added up, and the step's ``loss``, ``grad_norm`` and sampler-trainer
drift. What lies between, how rewards become per-token advantages, is each loop's own math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sess.engine import AdamParams, APIFuture, Datum, SamplingClient, SamplingParams, TrainingClient
from sess.engine.protocol.loss_registry import LOSSES

from . import drift, rollouts
from .data import Dataset
from .env import EnvFactory
from .rollouts import Group, derive_seed


@dataclass
class RolloutConfig:
    steps: int = 20
    batch_size: int = 8  # problems (groups) per step
    group_size: int = 8  # episodes per problem
    learning_rate: float = 1e-4
    grad_clip_norm: float = 1.0
    max_tokens: int = 24  # per turn, in rollouts and in the runner's greedy evaluation
    temperature: float = 1.0
    # replies per episode (None: the env decides, at most rollouts.DEFAULT_MAX_TURNS)
    max_turns: int | None = None
    max_observation_tokens: int = rollouts.MAX_OBSERVATION_TOKENS  # longer: the episode ends there
    # ask each sample for the trainer's logprobs of its tokens and record the drift at sampling
    # (drift/at_sampling/*; worth it with --sampler vllm): one more forward pass per sample request
    trainer_logprobs: bool = False
    scale_by_std: bool = False  # advantages divided by their group's reward std


def sample_groups(
    sc: SamplingClient, tok: Any, envs: Dataset[EnvFactory], cfg: RolloutConfig, *, seed: int, step: int
) -> list[Group]:
    """``cfg.batch_size`` groups of ``cfg.group_size`` scored episodes, sampled by ``sc`` for ``step``."""
    make_env_P = [envs.train(step * cfg.batch_size + i) for i in range(cfg.batch_size)]
    envs_P_G = [[make_env() for _ in range(cfg.group_size)] for make_env in make_env_P]
    seeds_P = [derive_seed(seed, "sample", step, i) for i in range(cfg.batch_size)]
    return rollouts.rollout_groups(
        sc,
        tok,
        envs_P_G,
        SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature),
        seeds_P,
        policy_step=step,
        max_turns=cfg.max_turns,
        max_observation_tokens=cfg.max_observation_tokens,
        trainer_logprobs=cfg.trainer_logprobs,
    )


def clip_range(loss: str, loss_config: dict | None) -> tuple[float, float] | None:
    """The ratio range ``loss`` clips to per token, with ``loss_config``'s thresholds over its
    defaults (ppo: 0.8-1.2, cispo: 0-4); None for a loss that does not clip each token."""
    spec = LOSSES.get(loss)
    if spec is None or not spec.per_token or "clip_low_threshold" not in spec.defaults:
        return None
    merged = {**spec.defaults, **(loss_config or {})}
    return float(merged["clip_low_threshold"]), float(merged["clip_high_threshold"])


def update(
    tc: TrainingClient,
    passes: list[APIFuture],
    datums: list[Datum],
    adam: AdamParams,
    clip: tuple[float, float] | None = None,
) -> dict:
    """One AdamW step on the gradients ``passes`` (forward_backward futures over ``datums``, in that
    order) added up; its metrics: the passes' summed ``loss``, ``grad_norm``, the drift between
    the sampler's and the trainer's logprobs and, given the loss's ``clip`` range, ``clip/fraction``
    (:mod:`.drift`). No passes (no group had a signal): no step, loss 0."""
    if not passes:
        return {"loss": 0.0}
    opt = tc.optim_step(adam)  # queued behind the passes on the engine
    metrics = {
        "loss": sum(p.result().metrics["loss:sum"] for p in passes),
        "grad_norm": opt.result().metrics.get("grad_norm", 0.0),
    }
    outputs = [out for p in passes for out in p.result().loss_fn_outputs]  # in datums' order
    metrics.update(drift.sample_train_drift(datums, outputs))
    if clip is not None:
        metrics.update(drift.clip_fraction(datums, outputs, *clip))
    return metrics
