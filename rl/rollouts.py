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

Bad envs end only their own episode. An env whose ``step`` raises, or answers a reward that is not a
finite number, leaves its episode with an ``error`` and no reward of its own: in ``rewards_G`` it
stands at its group's mean, so it carries no advantage and is not trained on. An env whose
``initial_observation`` raises leaves an empty group with the ``error``. An env that ends its episode
with a ``failure`` (a malformed tool call, a solution that hung) keeps the reward it gave.

Observations are capped: the tokens between one reply and the next turn (end of turn, observation
messages, the next generation prompt) may number at most ``max_observation_tokens`` (default
:data:`MAX_OBSERVATION_TOKENS`, ``loop.max_observation_tokens``). An env that answers with more ends
its episode there, as the turn cap does (its rewards so far stand), with a ``failure`` that says
so. So an episode's length is bounded by its prompt, ``max_tokens`` per reply and the cap per
observation, which is what ``sess run --dry-run`` forecasts.
:func:`batch_metrics` counts both and keeps their reasons, which the loops record with the step.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sess.engine import Datum, SamplingClient, SamplingParams

from . import drift, rendering
from .env import Env, Messages

DEFAULT_MAX_TURNS = 16  # replies per episode when a loop sets no cap of its own
MAX_OBSERVATION_TOKENS = 512  # tokens between a reply and the next turn, when a loop sets no cap
STEP_THREADS = 8  # envs stepped at once within a rollout


def check_count(name: str, value: Any, least: int) -> None:
    """Refuse a config value ``name`` that is not an integer of at least ``least`` (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: expected an integer >= {least}, got {value!r}")


def check_observation_cap(value: Any) -> None:
    """Refuse a ``loop.max_observation_tokens`` that is not a positive integer."""
    check_count("loop.max_observation_tokens", value, 1)


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
    error: str = ""  # the env raised or gave a non-finite reward: no reward, no advantage
    failure: str = ""  # the env ended the episode badly, and said why (its reward stands)
    # the trainer's logprob of each sampled token, in order, when the rollout asked the sampler for it
    trainer_logprobs: list[float] = field(default_factory=list)

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
    error: str = ""  # the env could not even open the episode (no episodes then)

    @property
    def rewards_G(self) -> list[float]:
        """Each member's reward; a member with an ``error`` gets the mean of the others (advantage 0)."""
        scored = [e.reward for e in self.episodes_G if not e.error]
        mean = float(np.mean(scored)) if scored else 0.0
        return [mean if e.error else e.reward for e in self.episodes_G]

    @property
    def reasons(self) -> list[str]:
        """Why episodes of this group erred or failed, one line each."""
        return [self.error] * bool(self.error) + [
            e.error or e.failure for e in self.episodes_G if e.error or e.failure
        ]


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
    max_turns: int | None = None,
    max_observation_tokens: int | None = None,
    trainer_logprobs: bool = False,
) -> list[Group]:
    """One episode per env; the envs of a group must open with the same observation and tools.

    ``params`` gives max_tokens and temperature per turn; an env still talking after ``max_turns``
    replies (default :data:`DEFAULT_MAX_TURNS`) is cut off there (its rewards so far stand), and so
    is one whose observation is over ``max_observation_tokens`` (default :data:`MAX_OBSERVATION_TOKENS`).
    ``trainer_logprobs``: each sample request also asks for the trainer's logprobs of its tokens
    (``include_trainer_logprobs``, one more forward pass each), which :func:`batch_metrics` turns
    into the drift at sampling (:func:`.drift.rollout_drift`).
    """
    asked = {"include_trainer_logprobs": True} if trainer_logprobs else {}
    max_turns = max_turns or DEFAULT_MAX_TURNS
    cap = max_observation_tokens or MAX_OBSERVATION_TOKENS
    groups_P, live_P_G, futures_P = [], [], []
    for envs_G, seed in zip(envs_P_G, seeds_P):
        # First turn: one request per group; its G samples are the members' first replies.
        try:
            for env in envs_G:
                env.max_turns = max_turns
            first, tools = envs_G[0].initial_observation(), [t.to_json() for t in envs_G[0].tools] or None
            same = all(env.initial_observation() == first for env in envs_G[1:])
        except Exception as exc:  # a broken env loses its group, not the batch
            groups_P.append(Group([], policy_step, error=f"env raised in initial_observation: {_said(exc)}"))
            continue
        if not same:
            raise ValueError(
                "rollout: the envs of a group must share their initial observation (one problem)"
            )
        prompt_T = rendering.prompt_tokens(tok, first, tools)
        episodes_G = [Episode.opening(prompt_T, first) for _ in envs_G]
        groups_P.append(Group(episodes_G, policy_step))
        live_P_G.append([_Live(e, env, tools, seed, g) for g, (e, env) in enumerate(zip(episodes_G, envs_G))])
        futures_P.append(sc.sample(prompt_T, len(envs_G), replace(params, seed=seed), **asked))
    replies = [
        (item, s) for live_G, f in zip(live_P_G, futures_P) for item, s in zip(live_G, f.result().sequences)
    ]
    for turn in range(1, max_turns + 1):
        # The envs score this turn's replies (at once: an env may wait on a sandbox or a server); those
        # that go on get their observation and sample again.
        last = turn == max_turns
        with ThreadPoolExecutor(max(1, min(len(replies), STEP_THREADS))) as pool:
            goes = list(pool.map(lambda r: _take_turn(tok, *r, last=last, cap=cap), replies))  # noqa: B023
        going = [item for (item, _), go in zip(replies, goes) if go]
        if not going:
            break
        futures = [
            sc.sample(
                item.episode.tokens_T,
                1,
                replace(params, seed=derive_seed(item.group_seed, item.member, turn)),
                **asked,
            )
            for item in going
        ]
        replies = [(item, f.result().sequences[0]) for item, f in zip(going, futures)]
    return groups_P


def _take_turn(tok, item: _Live, sequence, *, last: bool, cap: int) -> bool:
    """Append a sampled reply, let the env answer it, append its observation; True if the episode goes on."""
    episode = item.episode
    text = tok.decode(sequence.tokens, skip_special_tokens=True)
    episode.tokens_T += sequence.tokens
    episode.sampled_T += [True] * len(sequence.tokens)
    episode.logprobs_T += [float(x) for x in sequence.logprobs]
    if sequence.trainer_logprobs is not None:
        episode.trainer_logprobs += [float(x) for x in sequence.trainer_logprobs]
    episode.turns += 1
    try:
        result = item.env.step(text)
        reward = float(result.reward)
    except Exception as exc:  # the env's bug ends this episode only
        result, episode.error = None, f"env raised in step: {_said(exc)}"
    else:
        if not math.isfinite(reward):
            episode.error = f"env gave reward {reward} (not a finite number)"
    if result is None or episode.error:
        episode.messages.append({"role": "assistant", "content": text})
        return False
    episode.reward += reward
    episode.metrics.update(result.metrics)
    episode.failure = result.failure or episode.failure
    if result.done or last:
        episode.messages.append({"role": "assistant", "content": text})
        return False
    stopped_on = tok.decode(sequence.tokens[-1:]) if sequence.stop_reason == "stop" else ""
    observation_T = rendering.observation_tokens(
        tok, episode.messages, result.observation, stop_text=stopped_on, tools=item.tools
    )
    episode.messages.append({"role": "assistant", "content": text})
    if len(observation_T) > cap:  # the episode ends before an observation past the cap
        episode.failure = (
            f"observation of {len(observation_T)} tokens is over loop.max_observation_tokens={cap}: "
            "episode ended before it"
        )
        return False
    episode.messages += result.observation
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


def batch_datums(groups_P: list[Group], scale_by_std: bool = False) -> list[Datum]:
    """One datum per episode of the groups with signal: its group-relative advantage divided by the
    batch's sampled tokens (token-mean over the batch) on its sampled tokens. A group whose rewards
    are all equal has no signal and gives none."""
    advantages_P_G = [group_advantages(g.rewards_G, scale_by_std) for g in groups_P]
    kept = [(g, a_G) for g, a_G in zip(groups_P, advantages_P_G) if any(abs(a) > 1e-9 for a in a_G)]
    n_tokens = sum(e.n_sampled for g, _ in kept for e in g.episodes_G)
    return [policy_datum(e, a / n_tokens) for g, a_G in kept for e, a in zip(g.episodes_G, a_G)]


def group_datums(group: Group, batch_size: int, scale_by_std: bool = False) -> list[Datum]:
    """One group's datums as a sub-batch of ``batch_size`` groups: advantage / (the group's sampled
    tokens * batch_size) on sampled tokens, so each group weighs the same and the sub-batches'
    gradients add up to the batch's. Episodes that erred or sampled nothing give none."""
    advantages_G = group_advantages(group.rewards_G, scale_by_std) if group.episodes_G else []
    if not any(abs(a) > 1e-9 for a in advantages_G):
        return []
    n_tokens = sum(e.n_sampled for e in group.episodes_G) * batch_size
    return [
        policy_datum(e, a / n_tokens)
        for e, a in zip(group.episodes_G, advantages_G)
        if e.n_sampled and not e.error
    ]


def batch_metrics(groups_P: list[Group]) -> dict:
    """Mean reward, the mean of each env metric (``accuracy``, ...), sampled tokens per episode, the
    share of groups with signal and its complement ``groups/zero_advantage``, the sampled-token
    entropy (:func:`sampled_entropy`); the count of episodes that erred or failed, and their
    reasons (``failures``, a few distinct lines);
    the drift at sampling where the episodes carry the trainer's logprobs."""
    episodes = [e for g in groups_P for e in g.episodes_G]
    scored = [e for e in episodes if not e.error]
    metrics = {"reward/mean": float(np.mean([e.reward for e in scored])) if scored else 0.0}
    for key in dict.fromkeys(k for e in episodes for k in e.metrics):
        metrics[key] = float(np.mean([e.metrics[key] for e in episodes if key in e.metrics]))
    metrics["completion_tokens"] = float(np.mean([e.n_sampled for e in episodes])) if episodes else 0.0
    metrics["groups_with_signal"] = sum(len(set(g.rewards_G)) > 1 for g in groups_P) / len(groups_P)
    metrics["groups/zero_advantage"] = 1.0 - metrics["groups_with_signal"]  # all rewards equal: no gradient
    metrics.update(sampled_entropy(episodes))
    reasons = [r for g in groups_P for r in g.reasons]
    if reasons:
        metrics["episodes/errors"] = sum(bool(e.error) for e in episodes) + sum(
            bool(g.error) for g in groups_P
        )
        metrics["episodes/failed"] = sum(bool(e.failure) and not e.error for e in episodes)
        metrics["failures"] = list(dict.fromkeys(reasons))[:MAX_REASONS]
    metrics.update(drift.rollout_drift(episodes))
    return metrics


def sampled_entropy(episodes: list[Episode]) -> dict[str, float]:
    """``entropy/sampled_mc``: the mean of ``-logp_sampler`` over the sampled tokens, from the
    logprobs the sampler returned (no extra pass). Those are the model's own logprobs, before
    temperature, so at temperature 1 (the default) this is the Monte-Carlo estimate of the policy's
    per-token entropy in nats; below 1 it reads lower. Near 0: the policy has stopped exploring."""
    logprobs = [lp for e in episodes for lp, s in zip(e.logprobs_T, e.sampled_T) if s]
    return {"entropy/sampled_mc": float(-np.mean(logprobs))} if logprobs else {}


MAX_REASONS = 5  # distinct failure reasons kept per step: enough to see what broke, not a transcript


def _said(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line and short."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text[:300]


def sampled_tokens(groups_P: list[Group]) -> int:
    return sum(e.n_sampled for g in groups_P for e in g.episodes_G)
