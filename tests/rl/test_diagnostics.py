"""The RL diagnostics computed client-side: zero-advantage share, sampled-token entropy, the
sampler-trainer KL (k1, k3), clip fractions and the standard error of a held-out share."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sess.engine import Datum
from sess.rl import drift, rollouts
from sess.rl.evaluation import standard_error
from sess.rl.rollouts import Episode, Group
from sess.rl.step import clip_range


def _episode(sampler_lps: list[float], reward: float) -> Episode:
    e = Episode.opening([1, 2], [])
    e.tokens_T += [3] * len(sampler_lps)
    e.sampled_T += [True] * len(sampler_lps)
    e.logprobs_T += sampler_lps
    e.reward = reward
    return e


def test_zero_advantage_share_and_entropy_are_from_the_rollouts():
    flat = Group([_episode([-1.0, -3.0], 1.0), _episode([-2.0], 1.0)])  # all rewards equal
    split = Group([_episode([-0.5], 1.0), _episode([-0.5, -0.0], 0.0)])
    metrics = rollouts.batch_metrics([flat, split])
    assert metrics["groups/zero_advantage"] == 0.5
    assert metrics["groups_with_signal"] == 0.5
    # mean of -logp over the 6 sampled tokens, prompt tokens left out
    assert metrics["entropy/sampled_mc"] == pytest.approx((1 + 3 + 2 + 0.5 + 0.5 + 0) / 6)


def _datum(sampler_T: list[float], advantage: float = 1.0) -> Datum:
    return rollouts.policy_datum(_episode(sampler_T, 0.0), advantage)


def test_kl_sample_train_k1_k3_and_clip_fraction_against_the_trainer_logprobs():
    datums = [_datum([-1.0, -2.0]), _datum([-0.5])]
    # trainer's logprobs per target position (shifted datum: prompt 2 tokens -> 1 position before)
    shifted = [np.asarray(d.loss_fn_inputs["logprobs"].tolist(), np.float64) for d in datums]
    d_tokens = [0.1, -0.3, 0.5]  # logp_sampler - logp_trainer per sampled token
    outputs, k = [], 0
    for s in shifted:
        trainer = s.copy()
        for i in np.flatnonzero(s != 0):
            trainer[i] = s[i] - d_tokens[k]
            k += 1
        outputs.append({"logprobs": trainer})
    got = drift.sample_train_drift(datums, outputs)
    d = np.asarray(d_tokens)
    assert got["drift/kl_sample_train"] == pytest.approx(d.mean())
    assert got["drift/kl_sample_train_k3"] == pytest.approx(np.mean(np.exp(-d) - 1 + d))
    assert got["drift/kl_sample_train_k3"] >= 0
    # ratios exp(-d): 0.905, 1.35, 0.607 -> two of three outside [0.8, 1.2]
    assert drift.clip_fraction(datums, outputs, 0.8, 1.2) == {"clip/fraction": pytest.approx(2 / 3)}
    assert drift.clip_fraction(datums, outputs, 0.5, 2.0) == {"clip/fraction": 0.0}


def test_clip_range_follows_the_loss_and_its_config():
    assert clip_range("ppo", None) == (0.8, 1.2)
    assert clip_range("ppo", {"clip_low_threshold": 0.7}) == (0.7, 1.2)
    assert clip_range("cispo", {}) == (0.0, 4.0)
    assert clip_range("importance_sampling", None) is None
    assert clip_range("gspo", None) is None  # one ratio per sequence, not per token


def test_standard_error_of_a_share():
    assert standard_error(0.5, 64) == pytest.approx(math.sqrt(0.25 / 64))
    assert standard_error(0.0, 10) == 0.0 and standard_error(0.3, 0) == 0.0
