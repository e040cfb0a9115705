"""Held-out evaluation, which the runner does at the start, every ``loop.eval_every`` steps and at the end.

Environments: one greedy episode (temperature 0, ``loop.max_tokens`` per turn) of each held-out env,
reported as the mean reward and the mean of each env metric (``eval/accuracy`` for arithmetic: the
share of exact answers) over ``eval/n`` episodes. Chats, when the data has no envs: the token-mean
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
) -> dict:
    """Mean reward and env metrics of one greedy episode per env, sampled from the session's weights
    (at most ``max_turns`` replies each; None: the rollouts' default)."""
    sc = tc.create_sampling_client()
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    groups = rollouts.rollout_groups(
        sc, tc.get_tokenizer(), [[make_env()] for make_env in envs], greedy, seeds, max_turns=max_turns
    )
    episodes = [g.episodes_G[0] for g in groups if g.episodes_G]  # an env that failed to open has none
    metrics = {}
    for key in dict.fromkeys(k for e in episodes for k in e.metrics):
        metrics[f"eval/{key}"] = float(np.mean([e.metrics[key] for e in episodes if key in e.metrics]))
    metrics["eval/reward"] = float(np.mean([e.reward for e in episodes]))
    metrics["eval/n"] = len(episodes)
    return metrics


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
