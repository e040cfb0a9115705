"""Checks of a training batch, shared by the SDK (before a request leaves) and the engine.

A loss names the ``loss_fn_inputs`` it needs and the options it takes with their defaults (a row of
:mod:`.loss_registry`), whose values must keep it the loss it names (clip thresholds
around the on-policy ratio 1, a penalty weight of 0 or more); every datum's inputs must be finite
and as long as its ``model_input``, and token ids must lie in the vocabulary. Errors name the datum
index and the key.
The losses themselves are computed on the engine (:mod:`sess.engine.runtime.losses`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sess.engine.protocol.loss_registry import LOSSES, REFUSED
from sess.engine.protocol.types import Datum, InvalidRequest, LossFunction
from sess.engine.protocol.wire_checks import finite

# views of the loss registry, by loss name
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {name: loss.inputs for name, loss in LOSSES.items()}
DEFAULT_CONFIG: dict[str, dict[str, float]] = {name: loss.defaults for name, loss in LOSSES.items()}
MULTI_TARGET_INPUTS: dict[str, tuple[str, ...]] = {name: loss.multi_target for name, loss in LOSSES.items()}


def check_loss_fn(loss_fn: str | LossFunction, loss_fn_config: dict | None) -> tuple[str, dict[str, float]]:
    """Normalise the loss name and merge ``loss_fn_config`` over its defaults; unknown names are errors."""
    name = loss_fn.value if isinstance(loss_fn, LossFunction) else loss_fn
    if name in REFUSED:
        raise InvalidRequest(f"loss_fn: {name} is not supported by this engine: {REFUSED[name]}")
    if name not in REQUIRED_INPUTS:
        raise InvalidRequest(f"loss_fn: unknown loss {name!r}; choose one of {', '.join(REQUIRED_INPUTS)}")
    config = dict(DEFAULT_CONFIG[name])
    for key, value in (loss_fn_config or {}).items():
        if key not in config:
            known = ", ".join(config) or "none"
            raise InvalidRequest(f"loss_fn_config.{key}: not an option of {name} (options: {known})")
        if isinstance(value, bool) or not isinstance(value, int | float) or not finite(value):
            raise InvalidRequest(f"loss_fn_config.{key}: expected a finite number, got {value!r}")
        config[key] = float(value)
    _check_config(name, config)
    return name, config


def _check_config(name: str, config: dict[str, float]) -> None:
    """Options that would run but compute something else than the loss they name."""
    if "clip_low_threshold" in config:
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        # the thresholds bound the ratio p_new / p_sampler, which is 1 on-policy: a range without 1
        # clips every on-policy token (ppo then has no gradient at all)
        if not 0 <= low <= 1 <= high:
            raise InvalidRequest(
                f"loss_fn_config: {name} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold "
                f"(bounds of the probability ratio, 1 on-policy), got {low:g} and {high:g}"
            )
    if config.get("kl_coeff", 0.0) < 0:
        raise InvalidRequest(
            f"loss_fn_config.kl_coeff: expected a value of 0 or more (the weight of {name}'s KL penalty "
            f"toward the sampler), got {config['kl_coeff']:g}"
        )
    if config.get("weight_cap", 1.0) < 1:
        # on-policy every weight is 1: a cap under it would truncate every token
        raise InvalidRequest(
            f"loss_fn_config.weight_cap: expected 1 or more (where {name} truncates the importance "
            f"weight, 1 on-policy), got {config['weight_cap']:g}"
        )
    if config.get("beta", 0.0) < 0:
        raise InvalidRequest(
            f"loss_fn_config.beta: expected a value of 0 or more (the weight of {name}'s penalty on "
            f"moving away from the sampler), got {config['beta']:g}"
        )


def check_data(
    data: Sequence[Datum], loss_fn: str, *, vocab_size: int | None = None, require_targets: bool = True
) -> None:
    """Raise InvalidRequest naming the datum index and key for the first problem in ``data``."""
    if not isinstance(data, list | tuple) or len(data) == 0:
        raise InvalidRequest("data: expected a non-empty list of Datum")
    required = REQUIRED_INPUTS[loss_fn] if require_targets else ("target_tokens",)
    for i, datum in enumerate(data):
        if not isinstance(datum, Datum):
            raise InvalidRequest(f"data[{i}]: expected a Datum, got {type(datum).__name__}")
        tokens = datum.model_input.to_ints()
        if not tokens:
            raise InvalidRequest(f"data[{i}].model_input: empty")
        _check_tokens(tokens, f"data[{i}].model_input", vocab_size)
        for key in required:
            if key not in datum.loss_fn_inputs:
                raise InvalidRequest(f"data[{i}].loss_fn_inputs: missing {key!r} (required by {loss_fn})")
        _check_shapes(datum, i, len(tokens), MULTI_TARGET_INPUTS.get(loss_fn, ()))
        for key, value in datum.loss_fn_inputs.items():
            array = value.to_numpy()
            if not np.all(np.isfinite(array)):
                raise InvalidRequest(f"data[{i}].loss_fn_inputs[{key!r}]: contains NaN or infinity")
        if "target_tokens" in datum.loss_fn_inputs:
            targets = datum.loss_fn_inputs["target_tokens"].to_numpy()
            if targets.dtype.kind == "f" and not np.all(targets == np.round(targets)):
                raise InvalidRequest(f"data[{i}].loss_fn_inputs['target_tokens']: token ids must be integers")
            # checked as sent: float ids cast to int64 first would wrap (1e30 -> -2**63)
            _check_tokens(targets.ravel().tolist(), f"data[{i}].loss_fn_inputs['target_tokens']", vocab_size)


def _check_shapes(datum: Datum, i: int, length: int, multi: tuple[str, ...]) -> None:
    """Every input one value per position ((N,)); the ``multi`` inputs may instead all be (N, K)."""
    shapes = {key: tuple(value.to_numpy().shape) for key, value in datum.loss_fn_inputs.items()}
    for key, shape in shapes.items():
        where = f"data[{i}].loss_fn_inputs[{key!r}]"
        if key in multi and len(shape) == 2:
            if shape[0] != length:
                raise InvalidRequest(
                    f"{where}: shape {shape} does not match model_input.length {length} (expected ({length}, K))"
                )
            if shape[1] == 0:
                raise InvalidRequest(
                    f"{where}: shape {shape} has K = 0 targets; send {' and '.join(multi)} of shape "
                    f"({length}, K) with K >= 1, or of shape ({length},)"
                )
            partners = {k: s for k, s in shapes.items() if k in multi and k != key and s != shape}
            if partners:
                other, other_shape = next(iter(partners.items()))
                raise InvalidRequest(
                    f"{where}: shape {shape} does not match loss_fn_inputs[{other!r}] shape {other_shape} "
                    f"(K targets per position need {', '.join(multi)} of one (N, K) shape)"
                )
        elif len(shape) != 1 or shape[0] != length:
            extra = f" or ({length}, K) for {', '.join(multi)}" if key in multi else ""
            raise InvalidRequest(
                f"{where}: shape {shape} does not match model_input.length {length} "
                f"(expected ({length},){extra})"
            )


def _check_tokens(tokens: Sequence[int | float], where: str, vocab_size: int | None) -> None:
    low, high = min(tokens), max(tokens)
    if low < 0:
        raise InvalidRequest(f"{where}: token id {_shown(low)} is negative; token ids count from 0")
    if vocab_size is not None and high >= vocab_size:
        raise InvalidRequest(
            f"{where}: token id {_shown(high)} is outside the vocabulary (0..{vocab_size - 1})"
        )


def _shown(token: int | float) -> str:
    """A token id as the client sent it: 7 for 7.0, 1e+30 for a float no integer type holds."""
    return str(int(token)) if isinstance(token, int) or abs(token) < 2**53 else f"{token:g}"
