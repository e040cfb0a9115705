"""RL pieces the policy-gradient loops share: sample groups, score them, turn them into datums.

A *group* is the G completions of one prompt. Names carry their shapes (tinker-cookbook style):
``rewards_G`` per group member, ``tokens_G_T`` per member per token, ``groups_P`` per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sess.engine import Datum, SamplingClient

from . import rendering, rewards
from .arithmetic import Problem


@dataclass
class Group:
    problem: Problem
    prompt_T: list[int]
    tokens_G_T: list[list[int]]
    logprobs_G_T: list[list[float]]
    texts_G: list[str]
    rewards_G: list[float]
    policy_step: int = 0  # the optimizer step whose weights sampled this group


def submit_group(run, sc: SamplingClient, problem: Problem, group_size: int, seed_step: int, index: int):
    prompt_T = rendering.prompt_tokens(run.tok, run.data.prompt(problem))
    future = sc.sample(prompt_T, group_size, run.sampling_params(seed_step, index))
    return problem, prompt_T, future


def finish_group(run, problem: Problem, prompt_T: list[int], future, policy_step: int = 0) -> Group:
    sequences = future.result().sequences
    texts_G = [run.tok.decode(s.tokens, skip_special_tokens=True) for s in sequences]
    penalty = getattr(run.loop, "format_penalty", 0.1)
    return Group(
        problem,
        prompt_T,
        [list(s.tokens) for s in sequences],
        [list(s.logprobs) for s in sequences],
        texts_G,
        [rewards.reward(t, problem.answer, penalty) for t in texts_G],
        policy_step,
    )


def sample_groups(
    run, sc: SamplingClient, problems_P: list[Problem], group_size: int, step: int
) -> list[Group]:
    """All prompts are submitted before any result is read, so the engine can work on them together."""
    pending = [submit_group(run, sc, p, group_size, step, i) for i, p in enumerate(problems_P)]
    return [finish_group(run, *item, policy_step=step) for item in pending]


def group_advantages(rewards_G: list[float], scale_by_std: bool = False) -> list[float]:
    """Group-relative advantages: reward minus the group mean (divided by the group std if asked)."""
    r = np.asarray(rewards_G, np.float64)
    a = r - r.mean()
    if scale_by_std:
        a = a / (r.std() + 1e-6)
    return a.tolist()


def policy_datum(prompt_T: list[int], tokens_T: list[int], logprobs_T: list[float], advantages_T) -> Datum:
    """prompt + completion as one datum: sampler logprobs and advantages on completion tokens only."""
    n_prompt = len(prompt_T)
    full_T = prompt_T + tokens_T
    logprobs = [0.0] * n_prompt + list(logprobs_T)
    advantages = [0.0] * n_prompt + list(np.broadcast_to(advantages_T, (len(tokens_T),)))
    return rendering.shifted_datum(full_T, logprobs=logprobs, advantages=advantages)


def batch_metrics(groups_P: list[Group]) -> dict:
    all_rewards = [r for g in groups_P for r in g.rewards_G]
    hits = [rewards.correct(t, g.problem.answer) for g in groups_P for t in g.texts_G]
    lengths = [len(t) for g in groups_P for t in g.tokens_G_T]
    return {
        "reward/mean": float(np.mean(all_rewards)),
        "accuracy": float(np.mean(hits)),
        "completion_tokens": float(np.mean(lengths)),
        "groups_with_signal": sum(len(set(g.rewards_G)) > 1 for g in groups_P) / len(groups_P),
    }


def sampled_tokens(groups_P: list[Group]) -> int:
    return sum(len(t) for g in groups_P for t in g.tokens_G_T)
