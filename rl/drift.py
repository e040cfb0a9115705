"""Sampler-vs-trainer drift: how far the sampler's logprobs of the sampled tokens are from the trainer's.

An RL loop trains on tokens the sampler chose, with the sampler's logprobs as ``logp_old``. When the
sampler computes them with other kernels than the trainer (vLLM as the engine's sampler), the two
differ even at the same weights, and the importance ratio is off by that much before any update.
``forward_backward`` returns the trainer's logprobs of every datum's tokens, so the drift costs no
extra pass: over the sampled tokens (sampler logprob or advantage non-zero), with
``d = logp_sampler - logp_trainer``, ``drift/logprob_abs_diff`` is mean |d| and
``drift/kl_sample_train`` is mean d, the sampled estimate of KL(sampler || trainer). On-policy (GRPO, a
PPO step's first minibatch) it measures the kernels alone; where sampling lags the weights
(importance sampling) it includes the lag. The built-in sampler's drift is ~1e-6 (float32).
"""

from __future__ import annotations

import numpy as np


def _array(value) -> np.ndarray:
    return np.asarray(value.tolist() if hasattr(value, "tolist") else value, np.float64)


def sample_train_drift(datums: list, loss_fn_outputs: list[dict]) -> dict[str, float]:
    """``drift/logprob_abs_diff`` and ``drift/kl_sample_train`` over the sampled tokens of ``datums``
    (whose ``loss_fn_inputs`` carry the sampler's ``logprobs``), against ``forward_backward``'s outputs."""
    diffs = []
    for datum, output in zip(datums, loss_fn_outputs):
        sampler_T = _array(datum.loss_fn_inputs["logprobs"])
        trainer_T = _array(output["logprobs"])
        sampled_T = sampler_T != 0
        if "advantages" in datum.loss_fn_inputs:
            sampled_T |= _array(datum.loss_fn_inputs["advantages"]) != 0
        diffs.append(sampler_T[sampled_T] - trainer_T[sampled_T])
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    if d.size == 0:
        return {}
    return {"drift/logprob_abs_diff": float(np.abs(d).mean()), "drift/kl_sample_train": float(d.mean())}
