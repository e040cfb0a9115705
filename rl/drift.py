"""Sampler-vs-trainer drift: how far the sampler's logprobs of the sampled tokens are from the trainer's.

An RL loop trains on tokens the sampler chose, with the sampler's logprobs as ``logp_old``. When the
sampler computes them with other kernels than the trainer (vLLM as the engine's sampler), the two
differ even at the same weights, and the importance ratio is off by that much before any update.
``forward_backward`` returns the trainer's logprobs of every datum's tokens, so the drift costs no
extra pass: over the sampled tokens (sampler logprob or advantage non-zero), with
``d = logp_sampler - logp_trainer``, ``drift/logprob_abs_diff`` is mean |d| and
``drift/kl_sample_train`` is mean d, the sampled (k1) estimate of KL(sampler || trainer), and
``drift/kl_sample_train_k3`` the k3 estimate, mean ``exp(-d) - 1 + d`` (never negative, lower variance
near 0). ``clip/fraction`` (:func:`clip_fraction`) is the share of those tokens whose ratio
``exp(logp_trainer - logp_sampler)`` lies outside a loss's clip range. On-policy (GRPO, a
PPO step's first minibatch) it measures the kernels alone; where sampling lags the weights
(importance sampling) it includes the lag. The built-in sampler's drift is ~1e-6 (float32).

The same two figures at sampling time, lag-free in every loop (``drift/at_sampling/...``), come from
sample responses that carry the trainer's logprobs of their tokens (a loop's
``trainer_logprobs=true`` asks for them: one more forward pass per sample, none when not asked).
"""

from __future__ import annotations

import numpy as np


def _array(value) -> np.ndarray:
    return np.asarray(value.tolist() if hasattr(value, "tolist") else value, np.float64)


def sample_train_drift(datums: list, loss_fn_outputs: list[dict]) -> dict[str, float]:
    """``drift/logprob_abs_diff`` and ``drift/kl_sample_train`` over the sampled tokens of ``datums``
    (whose ``loss_fn_inputs`` carry the sampler's ``logprobs``), against ``forward_backward``'s outputs."""
    d = _sampled_diffs(datums, loss_fn_outputs)
    if d.size == 0:
        return {}
    return {
        "drift/logprob_abs_diff": float(np.abs(d).mean()),
        "drift/kl_sample_train": float(d.mean()),
        "drift/kl_sample_train_k3": float(np.mean(np.expm1(-d) + d)),
    }


def clip_fraction(datums: list, loss_fn_outputs: list[dict], low: float, high: float) -> dict[str, float]:
    """``clip/fraction``: the share of the sampled tokens of ``datums`` whose importance ratio
    ``exp(logp_trainer - logp_sampler)`` (the trainer's logprobs from ``forward_backward``'s outputs)
    is below ``low`` or above ``high``, i.e. where a clipped loss cuts the gradient off."""
    d = _sampled_diffs(datums, loss_fn_outputs)
    if d.size == 0:
        return {}
    ratio = np.exp(-d)
    return {"clip/fraction": float(np.mean((ratio < low) | (ratio > high)))}


def _sampled_diffs(datums: list, loss_fn_outputs: list[dict]) -> np.ndarray:
    """``logp_sampler - logp_trainer`` on every sampled token of ``datums``, in order."""
    diffs = []
    for datum, output in zip(datums, loss_fn_outputs):
        sampler_T = _array(datum.loss_fn_inputs["logprobs"])
        trainer_T = _array(output["logprobs"])
        sampled_T = sampler_T != 0
        if "advantages" in datum.loss_fn_inputs:
            sampled_T |= _array(datum.loss_fn_inputs["advantages"]) != 0
        diffs.append(sampler_T[sampled_T] - trainer_T[sampled_T])
    return np.concatenate(diffs) if diffs else np.zeros(0)


def rollout_drift(episodes: list) -> dict[str, float]:
    """``drift/at_sampling/logprob_abs_diff`` and ``drift/at_sampling/kl_sample_train`` over the sampled
    tokens of the episodes that carry the trainer's logprobs of them (``Episode.trainer_logprobs``, from
    the sample responses), against the sampler's; nothing when none does."""
    diffs = []
    for episode in episodes:
        if not episode.trainer_logprobs:
            continue
        sampler = [lp for lp, sampled in zip(episode.logprobs_T, episode.sampled_T) if sampled]
        diffs.append(_array(sampler) - _array(episode.trainer_logprobs))
    if not diffs:
        return {}
    d = np.concatenate(diffs)
    return {
        "drift/at_sampling/logprob_abs_diff": float(np.abs(d).mean()),
        "drift/at_sampling/kl_sample_train": float(d.mean()),
    }
