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

Which inputs each loss needs and its options' defaults are in :mod:`sess.engine.sdk.data_checks`.
"""

from __future__ import annotations

import torch

from sess.engine.sdk.errors import InvalidRequest

_RL_INPUTS = ("advantages", "logprobs")


def compute_loss(
    loss_fn: str,
    config: dict[str, float],
    logprobs: list[torch.Tensor],
    inputs: list[dict[str, torch.Tensor]],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-sum loss over all datums; ``logprobs[i]`` and every ``inputs[i][k]`` have one length."""
    lp = torch.cat(logprobs)
    if loss_fn == "cross_entropy":
        weights = torch.cat([x["weights"] for x in inputs]).to(lp.device, torch.float32)
        loss = -(lp * weights).sum()
        return loss, {"loss:sum": loss.item(), "weights:sum": weights.sum().item()}
    advantages, sampling_lp = (
        torch.cat([x[key] for x in inputs]).to(lp.device, torch.float32) for key in _RL_INPUTS
    )
    mask = advantages != 0
    log_ratio = lp - sampling_lp
    ratio = torch.exp(log_ratio)
    if loss_fn == "importance_sampling":
        loss = -(ratio * advantages).sum()
    elif loss_fn in ("ppo", "gspo"):
        if loss_fn == "gspo":
            ratio = _gspo_ratios(logprobs, inputs)
        clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
        loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    elif loss_fn == "cispo":
        clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
        loss = -(clipped * lp * advantages).sum()
    elif loss_fn == "dro":
        loss = -(lp * advantages - 0.5 * config["beta"] * log_ratio**2).sum()
    else:  # check_loss_fn keeps this unreachable
        raise InvalidRequest(f"loss_fn: unknown loss {loss_fn!r}")
    with torch.no_grad():
        n = max(int(mask.sum()), 1)
        metrics = {
            "loss:sum": loss.item(),
            "ratio:mean": float(ratio[mask].sum() / n),
            "kl_sample_train:mean": float(-log_ratio[mask].sum() / n),
        }
    return loss, metrics


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
