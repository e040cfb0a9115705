"""transformers' internals the engine uses where transformers has no public API for them: the
per-layer switch of activation checkpointing. Checked on transformers 5.25.0
(:data:`sess.engine.libraries.CHECKED`)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def layer_checkpointing(layer: torch.nn.Module) -> tuple[bool, Callable | None]:
    """A ``GradientCheckpointingLayer``'s switch: whether it checkpoints, and the checkpoint
    function set on this instance (None: none of its own)."""
    return layer.gradient_checkpointing, layer.__dict__.get("_gradient_checkpointing_func")


def set_layer_checkpointing(layer: torch.nn.Module, on: bool, func: Callable | None) -> None:
    """Set ``layer``'s switch to ``on`` with the checkpoint function ``func`` (None: remove the
    instance's own). The public ``activation_checkpointing_enable``/``_disable`` act on a whole
    model and also register an input-embedding hook that ``_disable`` leaves on a peft-wrapped
    model; they take no previous state to restore."""
    layer.gradient_checkpointing = on
    if func is None:
        layer.__dict__.pop("_gradient_checkpointing_func", None)
    else:
        layer._gradient_checkpointing_func = func
