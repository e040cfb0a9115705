"""The loss registry: every built-in loss by name, with the facts each reader of it needs.

One row per loss (:data:`LOSSES`): the ``loss_fn_inputs`` it needs, the options it takes with their
defaults, which inputs may be (N, K), whether its gradient at a token depends on that token alone
(the engine then takes it in the same pass as the logprobs), and whether it is a policy-gradient loss
over advantages and sampler logprobs (the RL loops' ``loop.loss``). :data:`REFUSED` holds the losses
the tinker SDK names that this engine does not compute, with the reason. The SDK's
:class:`~sess.engine.protocol.types.LossFunction`, the batch checks (:mod:`.data_checks`), the engine's
formulas (:mod:`sess.engine.runtime.losses`) and the loops' config checks all read this table, so a
loss name is spelled here and nowhere else. Plain data: importing it loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")


@dataclass(frozen=True)
class Loss:
    inputs: tuple[str, ...]  # loss_fn_inputs every datum must carry
    defaults: dict[str, float] = field(default_factory=dict)  # the options it takes, with their defaults
    multi_target: tuple[str, ...] = ()  # inputs that may be (N, K): K targets per position
    per_token: bool = True  # its gradient at a token depends on that token's logprob and inputs alone
    policy_gradient: bool = True  # weighs sampled tokens by advantages, with the sampler's logprobs
    # inputs whose zeros leave a position out of the loss, value and gradient: where every one of
    # them the datum sends is 0, its target token is not read (a placeholder); () for a loss that
    # reads every position's target (dro's penalty)
    masked_by: tuple[str, ...] = ("advantages",)


LOSSES: dict[str, Loss] = {
    "cross_entropy": Loss(
        ("target_tokens", "weights"),
        multi_target=("target_tokens", "weights"),
        policy_gradient=False,
        masked_by=("weights",),
    ),
    "importance_sampling": Loss(_POLICY_INPUTS),
    "ppo": Loss(_POLICY_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": Loss(_POLICY_INPUTS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": Loss(_POLICY_INPUTS, {"beta": 0.05}, masked_by=()),
    # optional input: sequence_ratio_mask; clip range: the GSPO paper's; one ratio per sequence
    "gspo": Loss(
        _POLICY_INPUTS,
        {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
        per_token=False,
        masked_by=("advantages", "sequence_ratio_mask"),
    ),
    # sess's own formula (Tinker's is not public); logprobs: the recorded sampler's, where spans name them
    "stable_reinforce": Loss(_POLICY_INPUTS, {"kl_coeff": 0.0, "weight_cap": 2.0}),
}

REFUSED: dict[str, str] = {
    "custom": "server-side custom losses are not supported; compute the loss on the client (forward_backward_custom)",
}

POLICY_GRADIENT_LOSSES: tuple[str, ...] = tuple(name for name, loss in LOSSES.items() if loss.policy_gradient)
PER_TOKEN_LOSSES: frozenset[str] = frozenset(name for name, loss in LOSSES.items() if loss.per_token)


def check_policy_loss(option: str, name: str) -> None:
    """Refuse a loop's ``option`` (``loop.loss``) that names no policy-gradient loss."""
    if name not in POLICY_GRADIENT_LOSSES:
        raise ValueError(f"{option}: expected one of {', '.join(POLICY_GRADIENT_LOSSES)}, got {name!r}")
