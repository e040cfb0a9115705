"""Built-in losses, computed on the engine over a batch's per-token logprobs.

Every loss reduces by token sum; ``weights`` / ``advantages`` act as the mask, and
``ratio = exp(lp - sampling_lp)`` where ``sampling_lp`` is the sampler's logprob of the token:

- ``cross_entropy``        -(lp * w).sum()
- ``importance_sampling``  -(ratio * A).sum()
- ``ppo``                  -min(ratio * A, clip(ratio, lo, hi) * A).sum()      lo/hi default 0.8 / 1.2
- ``cispo``                -(clip(ratio, lo, hi).detach() * lp * A).sum()      lo/hi default 0.0 / 4.0
- ``dro``                  -(lp * A - beta / 2 * (lp - sampling_lp) ** 2).sum()   beta default 0.05
- ``gspo``                 ppo's clipped objective on GSPO-token ratios: per datum,
  ``s = exp(mean over M of (lp - sampling_lp))`` and every token's ratio is
  ``s.detach() * exp(lp - lp.detach())`` (the sequence's value, the token's own gradient). M is
  where ``sequence_ratio_mask`` is non-zero, or where the advantage is (a datum without the mask).
  lo/hi default 1 - 3e-4 / 1 + 4e-4, the GSPO paper's clip ranges (Zheng et al., 2025).
- ``stable_reinforce``     -(min(ratio, cap).detach() * lp * A).sum() + kl_coeff * (ratio - 1 - log_ratio)[M].sum()
  truncated-importance-weighted REINFORCE plus Schulman's k3 estimate of KL(sampler || learner)
  over the masked tokens M (A != 0); cap default 2, kl_coeff default 0. sess's own formula: Tinker
  does not publish its StableReinforce's (docs/tinker.md).

``cross_entropy`` also takes (N, K) ``target_tokens`` and ``weights``; the training op runs such a
datum as K datums of one column each (:mod:`sess.engine.runtime.ops.training_ops`), so the sum above is over every target.
``custom``, which the tinker SDK names, is refused with the reason in
:data:`sess.engine.protocol.loss_registry.REFUSED`.

Which inputs each loss needs and its options' defaults are in :mod:`sess.engine.protocol.loss_registry`;
:data:`LOSSES` maps each of its names to the function of that name here, whose docstring cites the
paper it comes from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sess.engine.protocol import loss_registry
from sess.engine.protocol.errors import InvalidRequest

_RL_INPUTS = ("advantages", "logprobs")
Loss = Callable[
    [dict[str, float], list[torch.Tensor], list[dict[str, torch.Tensor]]], tuple[torch.Tensor, dict]
]


def cross_entropy(
    config: dict[str, float], logprobs: list[torch.Tensor], inputs: list[dict[str, torch.Tensor]]
) -> tuple[torch.Tensor, dict[str, float]]:
    """``-(lp * w).sum()``: the weighted negative log-likelihood of supervised fine-tuning, maximum
    likelihood on the tokens ``weights`` marks (the SFT stage of Ouyang et al., 2022, "Training
    language models to follow instructions with human feedback", arXiv:2203.02155)."""
    lp = torch.cat(logprobs)
    weights = torch.cat([x["weights"] for x in inputs]).to(lp.device, torch.float32)
    loss = -(lp * weights).sum()
    return loss, {"loss:sum": loss.item(), "weights:sum": weights.sum().item()}


class Terms(NamedTuple):
    """What every policy-gradient loss reads, over the batch's tokens (concatenated)."""

    lp: torch.Tensor  # the policy's logprobs, with their graph
    advantages: torch.Tensor
    log_ratio: torch.Tensor  # lp - sampling_lp
    ratio: torch.Tensor  # exp(log_ratio)
    logprobs: list[torch.Tensor]  # per datum, for losses that work sequence by sequence
    inputs: list[dict[str, torch.Tensor]]


def importance_sampling(t: Terms, config: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``-(ratio * A).sum()``: REINFORCE's policy gradient (Williams, 1992, "Simple statistical
    gradient-following algorithms for connectionist reinforcement learning") with the importance
    weight of the sampling policy (Precup, Sutton & Singh, 2000, "Eligibility traces for off-policy
    policy evaluation"), which corrects for samples drawn by an older policy."""
    return -(t.ratio * t.advantages).sum(), t.ratio


def ppo(
    t: Terms, config: dict[str, float], ratio: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``-min(ratio * A, clip(ratio, lo, hi) * A).sum()``: PPO's clipped surrogate objective
    (Schulman et al., 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347)."""
    ratio = t.ratio if ratio is None else ratio
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * t.advantages, clipped * t.advantages).sum(), ratio


def gspo(t: Terms, config: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective on GSPO-token ratios, one sequence-level ratio per datum (Zheng et al.,
    2025, "Group Sequence Policy Optimization", arXiv:2507.18071)."""
    return ppo(t, config, _gspo_ratios(t.logprobs, t.inputs))


def cispo(t: Terms, config: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``-(clip(ratio, lo, hi).detach() * lp * A).sum()``: CISPO, which clips the importance weight
    instead of the update, so no token's gradient is dropped (MiniMax, 2025, "MiniMax-M1: Scaling
    Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585)."""
    clipped = torch.clamp(t.ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -(clipped * t.lp * t.advantages).sum(), t.ratio


def dro(t: Terms, config: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``-(lp * A - beta / 2 * (lp - sampling_lp) ** 2).sum()``: Direct Reward Optimisation's
    regularised objective (Richemond et al., 2024, "Offline Regularised Reinforcement Learning for
    Large Language Models Alignment", arXiv:2405.19107)."""
    return -(t.lp * t.advantages - 0.5 * config["beta"] * t.log_ratio**2).sum(), t.ratio


def stable_reinforce(t: Terms, config: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``-(min(w, cap).detach() * lp * A).sum() + kl_coeff * (w - 1 - log w)[M].sum()``, ``w`` the
    ratio: REINFORCE (Williams, 1992) with per-token importance weights truncated at ``cap``, as in
    truncated importance sampling (Ionides, 2008, "Truncated importance sampling") and IMPALA's
    V-trace (Espeholt et al., 2018, arXiv:1802.01561), with the weight a constant so every token keeps
    its gradient as in CISPO (MiniMax, 2025, arXiv:2506.13585); the penalty is Schulman's k3 estimator
    of KL(sampler || learner) on the sampled tokens ("Approximating KL Divergence", 2020), unbiased
    and never negative. Metrics: the weights' mean and max, the share truncated, the KL estimate."""
    mask = t.advantages != 0
    cap = config["weight_cap"]
    weight = torch.clamp(t.ratio, max=cap).detach()
    kl = torch.where(mask, t.ratio - 1 - t.log_ratio, torch.zeros_like(t.ratio))
    loss = -(weight * t.lp * t.advantages).sum() + config["kl_coeff"] * kl.sum()
    with torch.no_grad():
        n = max(int(mask.sum()), 1)
        ratio = t.ratio[mask]
        metrics = {
            "is_weight:mean": float(ratio.sum() / n),
            "is_weight:max": float(ratio.max()) if ratio.numel() else 0.0,
            "is_weight_truncated:mean": float((ratio > cap).sum() / n),
            "kl_sampler_learner_k3:mean": float(kl.sum() / n),
        }
    return loss, t.ratio, metrics


def _policy_gradient(loss: Callable[[Terms, dict[str, float]], tuple]) -> Loss:
    """A policy-gradient loss over the batch, with the ratio and sampler-drift metrics of its tokens."""

    def compute(config, logprobs, inputs):
        lp = torch.cat(logprobs)
        advantages, sampling_lp = (
            torch.cat([x[key] for x in inputs]).to(lp.device, torch.float32) for key in _RL_INPUTS
        )
        mask = advantages != 0
        log_ratio = lp - sampling_lp
        value, ratio, *extra = loss(
            Terms(lp, advantages, log_ratio, torch.exp(log_ratio), logprobs, inputs), config
        )
        with torch.no_grad():
            n = max(int(mask.sum()), 1)
            metrics = {
                "loss:sum": value.item(),
                "ratio:mean": float(ratio[mask].sum() / n),
                "kl_sample_train:mean": float(-log_ratio[mask].sum() / n),
                **(extra[0] if extra else {}),
            }
        return value, metrics

    compute.__doc__ = loss.__doc__
    return compute


# each registry row's formula is the function of its name here; a policy-gradient loss also reports
# its ratio and the sampler's drift
_FORMULAS = {
    f.__name__: f for f in (cross_entropy, importance_sampling, ppo, gspo, cispo, dro, stable_reinforce)
}
LOSSES: dict[str, Loss] = {
    name: _policy_gradient(_FORMULAS[name]) if row.policy_gradient else _FORMULAS[name]
    for name, row in loss_registry.LOSSES.items()
}


def compute_loss(
    loss_fn: str,
    config: dict[str, float],
    logprobs: list[torch.Tensor],
    inputs: list[dict[str, torch.Tensor]],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-sum loss over all datums; ``logprobs[i]`` and every ``inputs[i][k]`` have one length."""
    if loss_fn not in LOSSES:  # check_loss_fn keeps this unreachable
        raise InvalidRequest(f"loss_fn: unknown loss {loss_fn!r}")
    return LOSSES[loss_fn](config, logprobs, inputs)


def _gspo_ratios(logprobs: list[torch.Tensor], inputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """GSPO-token ratios of every token, datum by datum (a datum is one sampled sequence)."""
    ratios = []
    for lp, x in zip(logprobs, inputs):
        sampling_lp = x["logprobs"].to(lp.device, torch.float32)
        marks = x.get("sequence_ratio_mask", x["advantages"]).to(lp.device)
        in_ratio = marks != 0
        log_ratio = (lp.detach() - sampling_lp)[in_ratio].mean() if bool(in_ratio.any()) else lp.new_zeros(())
        ratios.append(torch.exp(log_ratio + lp - lp.detach()))
    return torch.cat(ratios)
