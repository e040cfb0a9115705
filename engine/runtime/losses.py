"""Built-in losses, computed on the engine over a batch's per-token logprobs.

Every loss reduces by token sum; ``weights`` / ``advantages`` act as the mask, and
``ratio = exp(lp - sampling_lp)`` where ``sampling_lp`` is the sampler's logprob of the token:

- ``cross_entropy``        -(lp * w).sum()
- ``importance_sampling``  -(ratio * A).sum()
- ``ppo``                  -min(ratio * A, clip(ratio, lo, hi) * A).sum()      lo/hi default 0.8 / 1.2
- ``cispo``                -(clip(ratio, lo, hi).detach() * lp * A).sum()      lo/hi default 0.0 / 4.0
- ``dro``                  -(lp * A - beta / 2 * (lp - sampling_lp) ** 2).sum()   beta default 0.05
"""

from __future__ import annotations

import torch

from sess.engine.sdk.errors import InvalidRequest


def compute_loss(
    loss_fn: str,
    config: dict[str, float],
    logprobs: list[torch.Tensor],
    inputs: list[dict[str, torch.Tensor]],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-sum loss over all datums; ``logprobs[i]`` and every ``inputs[i][k]`` have one length."""
    lp = torch.cat(logprobs)
    cat = {
        key: torch.cat([x[key] for x in inputs]).to(lp.device, torch.float32)
        for key in inputs[0]
        if key != "target_tokens"
    }
    if loss_fn == "cross_entropy":
        loss = -(lp * cat["weights"]).sum()
        return loss, {"loss:sum": loss.item(), "weights:sum": cat["weights"].sum().item()}
    advantages, sampling_lp = cat["advantages"], cat["logprobs"]
    mask = advantages != 0
    log_ratio = lp - sampling_lp
    ratio = torch.exp(log_ratio)
    if loss_fn == "importance_sampling":
        loss = -(ratio * advantages).sum()
    elif loss_fn == "ppo":
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
