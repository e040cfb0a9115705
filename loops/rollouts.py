"""Rollouts, the RL loops' shared piece: run environments with a sampler, turn episodes into datums.

An *episode* is one env's conversation kept as ONE token sequence: the first prompt (the env's
initial observation rendered with the chat template and its tools), then per turn the tokens the
policy sampled and, unless the env is done, the observation tokens after them (end of turn, tool
results or the next user message, the next generation prompt; :func:`.rendering.observation_tokens`).
The next turn is sampled from exactly that sequence, so training on it trains on exactly the tokens
that were sampled: sampled tokens carry the advantage and their sampler logprobs, prompt and
observation tokens weight 0. The env sees each reply as decoded text; its rewards add up.

A *group* is G episodes of one problem (G envs from one factory). Its first turn is one request with
``num_samples=G``, so the engine prefills the shared prompt once; later turns continue each member on
its own. Every request of a turn is in flight before any result is read, so the engine batches them.
Seeds: group i's first turn uses ``seeds_P[i]``, member g's turn t > 0 ``derive_seed(seeds_P[i], g, t)``.
Names carry their shapes (tinker-cookbook style): ``rewards_G`` per group member, ``tokens_T`` per
token, ``groups_P`` per prompt.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sess.engine import Datum, SamplingClient, SamplingParams

from . import rendering
from .env import Env, Messages


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from parts (run seed, step, prompt index, ...): stable across processes and machines."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class Episode:
    tokens_T: list[int]  # prompt, then each turn's sampled tokens and the observation tokens after them
    sampled_T: list[bool]  # True on the tokens the policy sampled
    logprobs_T: list[float]  # the sampler's logprob on sampled tokens, 0 elsewhere
    messages: Messages  # the conversation as the env saw it (replies as decoded text)
    reward: float = 0.0  # the sum of the env's step rewards
    metrics: dict[str, float] = field(default_factory=dict)  # the env's metrics (a later step's win)
    turns: int = 0

    @classmethod
    def opening(cls, prompt_T: list[int], messages: Messages) -> Episode:
        """An episode that so far holds its prompt only."""
        return cls(list(prompt_T), [False] * len(prompt_T), [0.0] * len(prompt_T), list(messages))

    @property
    def n_sampled(self) -> int:
        return sum(self.sampled_T)


@dataclass
class Group:
    episodes_G: list[Episode]
    policy_step: int = 0  # the optimizer step whose weights sampled this group

    @property
    def rewards_G(self) -> list[float]:
        return [e.reward for e in self.episodes_G]


@dataclass
class _Live:
    """An episode still running: its env, the tools it renders with, and what seeds its later turns."""

    episode: Episode
    env: Env
    tools: list[dict] | None
    group_seed: int
    member: int


def rollout_groups(
    sc: SamplingClient,
    tok,
    envs_P_G: list[list[Env]],
    params: SamplingParams,
    seeds_P: list[int],
    *,
    policy_step: int = 0,
    max_turns: int = 16,
) -> list[Group]:
    """One episode per env; the envs of a group must open with the same observation and tools.

    ``params`` gives max_tokens and temperature per turn; an env still talking after ``max_turns``
    replies is cut off there (its rewards so far stand).
    """
    groups_P, live_P_G, futures_P = [], [], []
    for envs_G, seed in zip(envs_P_G, seeds_P):
        # First turn: one request per group; its G samples are the members' first replies.
        first, tools = envs_G[0].initial_observation(), [t.to_json() for t in envs_G[0].tools] or None
        if any(env.initial_observation() != first for env in envs_G[1:]):
            raise ValueError(
                "rollout: the envs of a group must share their initial observation (one problem)"
            )
        prompt_T = rendering.prompt_tokens(tok, first, tools)
        episodes_G = [Episode.opening(prompt_T, first) for _ in envs_G]
        groups_P.append(Group(episodes_G, policy_step))
        live_P_G.append([_Live(e, env, tools, seed, g) for g, (e, env) in enumerate(zip(episodes_G, envs_G))])
        futures_P.append(sc.sample(prompt_T, len(envs_G), replace(params, seed=seed)))
    replies = [
        (item, s) for live_G, f in zip(live_P_G, futures_P) for item, s in zip(live_G, f.result().sequences)
    ]
    for turn in range(1, max_turns + 1):
        # The envs score this turn's replies; those that go on get their observation and sample again.
        going = [
            item for item, sequence in replies if _take_turn(tok, item, sequence, last=turn == max_turns)
        ]
        if not going:
            break
        futures = [
            sc.sample(
                item.episode.tokens_T,
                1,
                replace(params, seed=derive_seed(item.group_seed, item.member, turn)),
            )
            for item in going
        ]
        replies = [(item, f.result().sequences[0]) for item, f in zip(going, futures)]
    return groups_P


def _take_turn(tok, item: _Live, sequence, *, last: bool) -> bool:
    """Append a sampled reply, let the env answer it, append its observation; True if the episode goes on."""
    episode = item.episode
    text = tok.decode(sequence.tokens, skip_special_tokens=True)
    episode.tokens_T += sequence.tokens
    episode.sampled_T += [True] * len(sequence.tokens)
    episode.logprobs_T += [float(x) for x in sequence.logprobs]
    episode.turns += 1
    result = item.env.step(text)
    episode.reward += result.reward
    episode.metrics.update(result.metrics)
    if result.done or last:
        episode.messages.append({"role": "assistant", "content": text})
        return False
    stopped_on = tok.decode(sequence.tokens[-1:]) if sequence.stop_reason == "stop" else ""
    observation_T = rendering.observation_tokens(
        tok, episode.messages, result.observation, stop_text=stopped_on, tools=item.tools
    )
    episode.messages += [{"role": "assistant", "content": text}, *result.observation]
    episode.tokens_T += observation_T
    episode.sampled_T += [False] * len(observation_T)
    episode.logprobs_T += [0.0] * len(observation_T)
    return True


def group_advantages(rewards_G: list[float], scale_by_std: bool = False) -> list[float]:
    """Group-relative advantages: reward minus the group mean (divided by the group std if asked)."""
    r = np.asarray(rewards_G, np.float64)
    a = r - r.mean()
    if scale_by_std:
        a = a / (r.std() + 1e-6)
    return a.tolist()


def policy_datum(episode: Episode, advantage) -> Datum:
    """The episode as one datum: sampler logprobs, and ``advantage`` (a number, or one per token of
    ``tokens_T``) on sampled tokens only."""
    mask_T = np.asarray(episode.sampled_T, np.float64)
    advantages_T = mask_T * np.broadcast_to(np.asarray(advantage, np.float64), mask_T.shape)
    return rendering.shifted_datum(episode.tokens_T, logprobs=episode.logprobs_T, advantages=advantages_T)


def batch_metrics(groups_P: list[Group]) -> dict:
    """Mean reward, the mean of each env metric (``accuracy``, ...), sampled tokens per episode."""
    episodes = [e for g in groups_P for e in g.episodes_G]
    metrics = {"reward/mean": float(np.mean([e.reward for e in episodes]))}
    for key in dict.fromkeys(k for e in episodes for k in e.metrics):
        metrics[key] = float(np.mean([e.metrics[key] for e in episodes if key in e.metrics]))
    metrics["completion_tokens"] = float(np.mean([e.n_sampled for e in episodes]))
    metrics["groups_with_signal"] = sum(len(set(g.rewards_G)) > 1 for g in groups_P) / len(groups_P)
    return metrics


def sampled_tokens(groups_P: list[Group]) -> int:
    return sum(e.n_sampled for g in groups_P for e in g.episodes_G)
