"""Code RL: the policy writes Python solutions, a sandbox runs the unit tests; overlapped and streamed.

Each problem (``data=code_tasks`` by default: generated function-writing tasks; or ``data=code_jsonl``)
is an environment (:mod:`.code_env`): the reply's code blocks run against the problem's tests in the
run's grader (``grader=local``, bubblewrap on this machine, or ``grader=sandbox_fusion
grader.url=...``); reward 1 when every test passes, 0 otherwise, ``-data.format_penalty`` when the
reply has no code block. With ``max_turns=2`` the policy may first call ``check_solution`` and read
the test verdict before its final answer, both turns trained on (sampled tokens weight 1, the tool's
result weight 0).

Overlap: ``rollout_workers`` threads (:mod:`.rollout_workers`) keep sampling groups of
``group_size`` episodes with the newest published policy while the trainer trains, at most
``batch_size * (max_steps_off_policy + 1)`` groups ahead. A group sampled by policy step ``v`` is used
at step ``s`` when ``s - v <= max_steps_off_policy``; otherwise ``stale_policy`` requeues it (the
problem is sampled again from the newest policy) or discards it. Each group's staleness ``s - v`` is
recorded (``group_staleness``).

Streaming: each group's datums go to ``forward_backward`` as soon as the group is taken, while later
groups are still being sampled; the engine adds up their gradients, and one AdamW ``optim_step`` per
step applies the sum. The losses reduce by token sum, so the sum of the sub-batches' gradients is the
one-batch gradient; what must be fixed before the batch is complete is the normaliser, so an
episode's advantage ``A_g = r_g - mean(r)`` (over its group; a group whose rewards are all equal has
no signal and sends nothing) is divided by its group's sampled tokens and by ``batch_size``: each
group weighs the same, token-mean within it. The loss is cispo by default,
``-(clip(ρ, 0, 4).detach() * logp * A).sum()`` with ``ρ = exp(logp - logp_sampler)``, whose ratio
corrects for the policy having moved since the group was sampled. After the update,
``save_weights_and_get_sampling_client`` publishes the next policy to the workers.

Which policy samples a group depends on timing, so (like importance_sampling) runs are not bit-for-bit
reproducible. Launch: ``sess run loop=code_rl``, ``sess run loop=code_rl loop.max_turns=2``, or
``python -m sess.loops.code_rl model=tiny-llama loop.steps=2``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sess.engine import AdamParams, Datum, SamplingParams, TrainingClient

from . import rollouts
from .datasets import Dataset
from .env import EnvFactory
from .hooks import Hooks
from .rollout_workers import RolloutWorkers
from .rollouts import Group

LOSSES = ("cispo", "importance_sampling", "ppo", "dro")


@dataclass
class Config:
    """Sized for smollm2-135m on a shared 2-core CPU (README, benchmarks/code_rl.py): 20 steps of
    8 problems x 8 samples of at most 64 tokens at learning rate 1e-4 (README says what 5e-4 with 4
    samples a problem did)."""

    name: str = "code_rl"
    steps: int = 20
    batch_size: int = 8  # groups (problems) per step
    group_size: int = 8  # episodes per problem
    learning_rate: float = 1e-4
    grad_clip_norm: float = 1.0
    max_tokens: int = 64  # per turn, in rollouts and in the runner's greedy evaluation
    temperature: float = 0.8
    max_turns: int = 1  # 2: the policy may call check_solution once before its final answer
    loss: str = "cispo"  # cispo | importance_sampling | ppo | dro
    loss_config: dict = field(default_factory=dict)  # e.g. +loop.loss_config.clip_high_threshold=2
    scale_by_std: bool = False
    rollout_workers: int = 8  # groups sampled at once: the engine decodes all their rows in one batch
    max_steps_off_policy: int = 1
    stale_policy: str = "requeue"  # requeue | discard
    eval_samples: int = 4  # held-out: also this many answers per problem at `temperature` (0: greedy only)
    eval_every: int = 10  # read by the runner: evaluate every n steps (0: at start and end only)
    save_every: int = 10  # read by the runner: save state every n steps (0: at the end only)


def check(cfg: Config) -> None:
    if cfg.loss not in LOSSES:
        raise ValueError(f"loop.loss: expected one of {', '.join(LOSSES)}, got {cfg.loss!r}")
    if cfg.group_size < 2:
        raise ValueError(f"loop.group_size: group-relative advantages need at least 2, got {cfg.group_size}")
    if cfg.stale_policy not in ("requeue", "discard"):
        raise ValueError(f"loop.stale_policy: expected requeue or discard, got {cfg.stale_policy!r}")
    if cfg.rollout_workers < 1 or cfg.max_steps_off_policy < 0:
        raise ValueError("loop.rollout_workers must be >= 1 and loop.max_steps_off_policy >= 0")
    if cfg.max_turns < 1:
        raise ValueError(f"loop.max_turns: expected 1 or more, got {cfg.max_turns}")


def group_datums(group: Group, batch_size: int, scale_by_std: bool = False) -> list[Datum]:
    """A group's datums: advantage / (the group's sampled tokens * batch_size) on sampled tokens."""
    advantages_G = rollouts.group_advantages(group.rewards_G, scale_by_std) if group.episodes_G else []
    if not any(abs(a) > 1e-9 for a in advantages_G):
        return []
    n_tokens = sum(e.n_sampled for e in group.episodes_G) * batch_size
    return [
        rollouts.policy_datum(e, a / n_tokens)
        for e, a in zip(group.episodes_G, advantages_G)
        if e.n_sampled and not e.error
    ]


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
    )
    try:
        for step in range(start_step, cfg.steps):
            started = time.perf_counter()
            # 1. Take groups as they finish; each fresh one goes to forward_backward at once (a sub-batch).
            groups_P, staleness_P, stale, passes, datums = [], [], 0, [], 0
            while len(groups_P) < cfg.batch_size:
                group, lag, skipped = pool.take_fresh(
                    step, cfg.max_steps_off_policy, requeue=cfg.stale_policy == "requeue"
                )
                stale += skipped
                groups_P.append(group)
                staleness_P.append(lag)
                sub_batch = group_datums(group, cfg.batch_size, cfg.scale_by_std)
                if sub_batch:
                    passes.append(
                        tc.forward_backward(sub_batch, loss_fn=cfg.loss, loss_fn_config=loss_config)
                    )
                    datums += len(sub_batch)
            metrics = rollouts.batch_metrics(groups_P)
            # 2. One optimizer step on the summed gradients of the step's sub-batches.
            if passes:
                opt = tc.optim_step(adam)
                metrics.update(
                    loss=sum(p.result().metrics["loss:sum"] for p in passes),
                    grad_norm=opt.result().metrics.get("grad_norm", 0.0),
                )
            else:
                metrics.update(loss=0.0)
            # 3. The workers sample from the new weights from now on.
            pool.publish(step + 1, tc.save_weights_and_get_sampling_client())
            metrics.update(
                datums=datums,
                sub_batches=len(passes),
                stale_groups=stale,
                group_staleness=staleness_P,
                off_policy_steps=sum(staleness_P) / len(staleness_P),
                tokens=rollouts.sampled_tokens(groups_P),
                seconds=time.perf_counter() - started,
            )
            hooks.step_done(step, metrics)
    finally:
        pool.close()


if __name__ == "__main__":
    from .runner import main

    main("code_rl")
