"""Held-out evaluation, which the runner does at the start, every ``loop.eval_every`` steps and at the end.

Environments: one greedy episode (temperature 0, ``loop.max_tokens`` per turn) of each held-out env,
reported as the mean reward and the mean of each env metric (``eval/accuracy`` for arithmetic: the
share of exact answers) over ``eval/n`` episodes, with the standard error ``sqrt(p(1-p)/n)`` of
each metric whose values are all 0 or 1 (``eval/accuracy_se``): two accuracies closer than about
twice it are within noise. A loop whose config has ``eval_samples`` > 0 (code
RL) also samples that many episodes of each env at the loop's ``temperature``, reported under
``eval/sampled/`` (``eval/sampled/accuracy``: the pass rate of a sampled answer, pass@1 as the policy
is trained to answer); their seeds depend only on the run's seed and the env, so every evaluation of a
run draws with the same seeds and two evaluations differ by the weights alone. Chats, when the data has no envs: the token-mean
cross-entropy of the assistant tokens (``eval/loss``). A loop with its own held-out measure adds it
(KTO's implied-reward margin; see :data:`.registry.LOOPS`).
"""

from __future__ import annotations

import numpy as np

from sess.engine import SamplingParams, TrainingClient

from . import rendering, rollouts
from .env import EnvFactory, Messages


def greedy_episodes(
    tc: TrainingClient,
    envs: list[EnvFactory],
    max_tokens: int,
    seeds: list[int],
    max_turns: int | None = None,
    max_observation_tokens: int | None = None,
) -> dict:
    """Mean reward and env metrics of one greedy episode per env, sampled from the session's weights
    (at most ``max_turns`` replies each; None: the rollouts' default)."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    caps = {"max_turns": max_turns, "max_observation_tokens": max_observation_tokens}
    return _episode_metrics(tc, envs, greedy, seeds, caps, samples=1, prefix="eval/")


def sampled_episodes(
    tc: TrainingClient,
    envs: list[EnvFactory],
    max_tokens: int,
    temperature: float,
    samples: int,
    seeds: list[int],
    max_turns: int | None = None,
    max_observation_tokens: int | None = None,
) -> dict:
    """The same means over ``samples`` episodes per env at ``temperature`` (``eval/sampled/...``)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    caps = {"max_turns": max_turns, "max_observation_tokens": max_observation_tokens}
    return _episode_metrics(tc, envs, params, seeds, caps, samples, prefix="eval/sampled/")


def _episode_metrics(tc, envs, params, seeds, caps, samples: int, prefix: str) -> dict:
    """``caps``: the rollouts' ``max_turns`` and ``max_observation_tokens`` (None: their default)."""
    sc = tc.create_sampling_client()
    groups = rollouts.rollout_groups(
        sc,
        tc.get_tokenizer(),
        [[make_env() for _ in range(samples)] for make_env in envs],
        params,
        seeds,
        **caps,
    )
    episodes = [e for g in groups for e in g.episodes_G]  # an env that failed to open has none
    metrics = {}
    for key in dict.fromkeys(k for e in episodes for k in e.metrics):
        values = [e.metrics[key] for e in episodes if key in e.metrics]
        metrics[f"{prefix}{key}"] = float(np.mean(values))
        if all(v in (0, 1) for v in values):  # a share: its binomial standard error
            metrics[f"{prefix}{key}_se"] = standard_error(metrics[f"{prefix}{key}"], len(values))
    metrics[f"{prefix}reward"] = float(np.mean([e.reward for e in episodes]))
    metrics[f"{prefix}n"] = len(episodes)
    return metrics


def standard_error(share: float, n: int) -> float:
    """The standard error ``sqrt(p(1-p)/n)`` of a share ``p`` measured on ``n`` episodes."""
    return float(np.sqrt(share * (1 - share) / n)) if n else 0.0


def chat_loss(tc: TrainingClient, chats: list[Messages]) -> dict:
    """Token-mean negative log-likelihood of the assistant tokens of ``chats`` under the session's weights."""
    tok = tc.get_tokenizer()
    datums, total = [], 0.0
    for chat in chats:
        tokens, weights = rendering.chat_tokens(tok, chat)
        datums.append(rendering.shifted_datum(tokens, weights=weights))
        total += sum(weights[1:])
    out = tc.forward(datums, "cross_entropy").result()
    return {"eval/loss": out.metrics["loss:sum"] / max(total, 1.0)}
