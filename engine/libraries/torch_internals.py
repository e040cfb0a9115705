"""torch's internals the engine uses where torch has no public API for them: a tensor's version
counter, a module's own dictionaries, the fused log-softmax backward, oneDNN's prepacked linear and
FSDP2's record of forward passes. Checked on torch 2.13.0 (:data:`sess.engine.libraries.CHECKED`)."""

from __future__ import annotations

import torch


def version_of(tensor: torch.Tensor) -> int:
    """The in-place version counter of ``tensor`` (bumped by every in-place change: an optimizer
    step, a loaded state). torch has a public writer (``torch.autograd.graph.increment_version``)
    but no public reader."""
    return tensor._version


def parameter_versions(modules: list[torch.nn.Module], name: str) -> list[tuple[int, int]]:
    """``(id, version)`` of each module's own parameter ``name`` (:func:`version_of`), read from
    the modules' dictionaries in one call: ``getattr`` goes through ``nn.Module.__getattr__``, and a
    decode step checks hundreds (``get_parameter`` is the public, slower form)."""
    weights = [m._parameters[name] for m in modules]
    return [(id(w), w._version) for w in weights]


def own_child(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """``module``'s direct child ``name`` (None where it has none), read from its dictionary, for
    the same reason as :func:`parameter_versions` (``get_submodule`` is the public, slower, raising
    form)."""
    return module._modules.get(name)


def log_softmax_backward(grad: torch.Tensor, output: torch.Tensor, dim: int) -> torch.Tensor:
    """The gradient of ``log_softmax`` at its ``output`` for ``grad`` over ``dim``, as autograd's own
    backward computes it (``grad - exp(output) * grad.sum(dim)`` in one kernel, so the bits are
    autograd's). No public API: the same formula written as torch ops rounds differently."""
    return torch._log_softmax_backward_data(grad, output, dim, output.dtype)


def onednn_pack_linear_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """oneDNN's prepacked copy of a [out, in] fp32 weight for matmuls of up to ``rows`` rows
    (``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile``'s CPU backend packs with):
    torch has no public prepacked linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def onednn_linear():
    """oneDNN's linear over a :func:`onednn_pack_linear_weight` copy, called as
    ``op(x, packed, bias, "none", [], "")`` (``torch.ops.mkldnn._linear_pointwise.default``);
    raises AttributeError or RuntimeError on a torch build without it. No public API."""
    return torch.ops.mkldnn._linear_pointwise.default


def onednn_nbytes(packed: torch.Tensor) -> int:
    """The bytes a oneDNN tensor's buffer holds (``torch.ops.mkldnn._nbytes``): its layout is
    oneDNN's own, and an mkldnn tensor answers no ``untyped_storage()``. No public API."""
    return torch.ops.mkldnn._nbytes(packed)


def fsdp_forget_forward_order(unit: torch.nn.Module) -> None:
    """Drop what FSDP2 recorded of the forward passes through ``unit`` (an ``FSDPModule``) since
    its last backward pass: the order it prefetches the backward pass's all-gathers in. FSDP2 keeps
    it on its private state (``_get_fsdp_state()._fsdp_param_groups``, each group's
    ``_post_forward_indices`` and its ``comm_ctx.post_forward_order``) and has no public call to
    reset it."""
    state = unit._get_fsdp_state()
    for group in state._fsdp_param_groups:
        group._post_forward_indices.clear()
        order = getattr(group.comm_ctx, "post_forward_order", None)  # set once FSDP2 inits
        if order is not None:
            order.clear()
