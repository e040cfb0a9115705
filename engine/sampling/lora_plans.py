"""One adapter's LoRA weights as the lean decoder runs them: merged into copies of the weights, or as terms.

A plan is made per adapter and made again when any of its weights changes (a training session's
after ``optim_step``), keyed by :func:`versions`. It takes one of two forms, decided per engine
(:meth:`~.llama_decoder.LlamaDecoder.merges_lora`), never per batch, so a row's arithmetic does
not depend on which rows share its step:

* **merged** (fp32 base on CPU, where the model's weights fit the copy budget): each projection's
  weight with its LoRA term added once, ``W + scaling * B A``, prepacked for oneDNN with its
  calibration (:class:`~.row_invariant.PackedMatmul`), the projections that read the same input
  stacked into one (:class:`Fused`). A decode step then runs one matmul a projection, or a bundle,
  for the adapter's rows instead of the base matmul plus two LoRA matmuls and an add; the copies
  are as large as the adapted weights (425 MB on smollm2).
* **terms** (elsewhere: a bf16 base, whose rounding would swallow a merged LoRA term; a budget
  without room for the copies): the adapter's A matrices stacked for the projections that read the
  same input, and per projection its B (prepacked where oneDNN's packed kernel is row-invariant at
  its shape), added to the base projections' output for the adapter's rows.

Both give a row the arithmetic of that row alone; they differ from each other in the last bits (a
sum taken in another order), and from the trainer's ``forward`` by rounding (the parity tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sess.engine.libraries import torch_internals
from sess.engine.sampling.row_invariant import PackedMatmul, lora_linear, packed_linear
from sess.engine.sampling.rows import add_to_rows, take_rows


@dataclass
class Terms:
    """One adapter's LoRA terms for a bundle of projections that read the same input: their A
    matrices stacked, and per projection its B, scaling and columns of the stacked A's output.
    Where oneDNN's prepacked kernel is row-invariant at a matrix's shape (:class:`PackedMatmul`),
    the matrix is prepacked with its calibration (B with its scaling folded in): no padding of
    small row counts and no lookup per call; elsewhere it goes through :func:`lora_linear`."""

    a: torch.Tensor | PackedMatmul
    parts: list[tuple[str, torch.Tensor | PackedMatmul, float, slice]]


def base_of(module: torch.nn.Module) -> torch.nn.Module:
    """The frozen linear layer under a peft LoRA layer (the module itself when it has none)."""
    return getattr(module, "base_layer", module)


def lora_layers(modules, adapter: str) -> list[torch.nn.Module]:
    """``adapter``'s LoRA A and B layers in each of ``modules`` (peft LoRA layers that carry it),
    in order."""
    return [layer for m in modules for layer in (m.lora_A[adapter], m.lora_B[adapter])]


def versions(layers: list[torch.nn.Module]) -> tuple:
    """What a plan made from ``layers`` (:func:`lora_layers`) depends on: each one's weight (the
    tensor and its version: an optimizer step or a loaded state changes it in place, a sharded
    engine swaps it) and the thread count (its prepacked matrices' calibrations). Read from the
    layers' own dictionaries: every decode step checks its plans, and ``nn.Module``'s attribute
    lookup would make that ~1 ms a check on smollm2."""
    return (torch.get_num_threads(), *torch_internals.parameter_versions(layers, "weight"))


@dataclass(frozen=True)
class Kept:
    """An adapter's plan with what it was made from: the first of its LoRA modules and that
    module's name in the model (the model itself, named "", where the adapter has none), the
    adapter's LoRA layers in all of them (:func:`lora_layers`) and their :func:`versions` with the
    plan's form."""

    plan: list
    first: str
    module: torch.nn.Module
    layers: list
    made: tuple

    def holds(self, model, adapter: str, merged: bool) -> bool:
        """Whether the plan is still the adapter's as ``model`` holds it: the same modules (peft
        wraps and unwraps layers as adapters come and go), the same LoRA layers (an adapter deleted
        and made again under its name has new ones in every module, so the first one tells) and
        the same weights at the same versions."""
        try:
            same_module = model.get_submodule(self.first) is self.module
        except AttributeError:
            return False
        if self.layers:
            lora_a = torch_internals.own_child(torch_internals.own_child(self.module, "lora_A"), adapter)
            same_module = same_module and lora_a is self.layers[0]
        return same_module and (merged, versions(self.layers)) == self.made


def _lora_layers(parent, names, adapter: str) -> list:
    """``(name, module)`` of the projections ``names`` of ``parent`` that carry ``adapter``."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    present = [
        (name, getattr(parent, name))
        for name in names
        if adapter in getattr(getattr(parent, name), "lora_A", {})
    ]
    for name, module in present:
        if not isinstance(module, LoraLinear) or module.merged or module.lora_variant.get(adapter):
            raise RuntimeError(f"adapter {adapter}: {name} is not a plain LoRA linear layer")
    return present


def terms_of(parent, names, adapter: str) -> Terms | None:
    """The :class:`Terms` of ``adapter`` for the projections ``names`` (None: it has none there)."""
    present = _lora_layers(parent, names, adapter)
    if not present:
        return None
    a_parts, parts, start = [], [], 0
    for name, module in present:
        a = module.lora_A[adapter].weight
        a_parts.append(a)
        b, scaling = module.lora_B[adapter].weight, float(module.scaling[adapter])
        packed = PackedMatmul.of(b.detach() * scaling)  # the scaling goes into the copy
        parts.append((name, packed or b, scaling, slice(start, start + a.shape[0])))
        start += a.shape[0]
    a = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts).contiguous()
    return Terms(a=PackedMatmul.of(a.detach()) or a, parts=parts)


def add_terms(outs, x: torch.Tensor, rows, terms: Terms, names) -> None:
    """Add each projection's ``B(A x) * scaling`` for the rows ``rows`` to its output."""
    # LoRA weights stay fp32 under a bf16 base model: its terms run in fp32, as peft runs them
    a = terms.a
    part = take_rows(x, rows).to(torch.float32 if isinstance(a, PackedMatmul) else a.dtype)
    low = a(part) if isinstance(a, PackedMatmul) else lora_linear(part, a)  # [rows, sum of ranks]
    for name, b, scaling, columns in terms.parts:
        if isinstance(b, PackedMatmul):
            delta = b(low[:, columns])
        else:
            delta = lora_linear(low[:, columns] * scaling, b)
        add_to_rows(outs[names.index(name)], rows, delta)


Merged = list  # per projection of a bundle: its merged matmul, or None where the adapter has no LoRA


@dataclass(frozen=True)
class Fused:
    """A bundle's projections (q/k/v, gate/up) merged and stacked into one prepacked matmul: its
    output holds each projection's features in bundle order, ``sizes`` of them each. One call
    instead of one a projection (fewer kernel calls a step, and one weight large enough to share
    out evenly between threads); oneDNN sums each output the same way at either shape, so the
    result is the same as the projections' one by one. ``lora``: how many of them carry LoRA (the
    others are the base weights' copies)."""

    matmul: PackedMatmul
    sizes: tuple[int, ...]
    lora: int


def merged_of(parent, names, adapter: str, scratch: torch.Tensor) -> Fused | Merged | None:
    """``adapter``'s projections ``names`` over ``W + scaling * B A`` (fp32), prepacked where
    oneDNN's packed kernel is row-invariant at the shape: stacked into one :class:`Fused` matmul
    where the bundle has several projections, else per projection a matmul, or None where
    ``adapter`` has no LoRA; None when it has none in the bundle. Each sum is made in ``scratch``
    (as many floats as the largest bundle's weights) and packed from there, so making a plan leaves
    no freed weight-sized blocks in the heap."""
    present = dict(_lora_layers(parent, names, adapter))
    if not present:
        return None
    bases = [base_of(getattr(parent, name)) for name in names]
    if len(names) > 1 and all(b.bias is None for b in bases):
        start = 0
        for name, base in zip(names, bases):
            _merge_into(scratch[start : start + base.weight.numel()], base, present.get(name), adapter)
            start += base.weight.numel()
        packed = PackedMatmul.of(scratch[:start].view(-1, bases[0].in_features))  # a copy of its own
        if packed is not None:
            return Fused(packed, tuple(b.out_features for b in bases), len(present))
    merged: Merged = []
    for name, base in zip(names, bases):
        module = present.get(name)
        if module is None:
            merged.append(None)
            continue
        weight = _merge_into(scratch[: base.weight.numel()], base, module, adapter)
        packed = PackedMatmul.of(weight)  # a copy of its own
        merged.append(packed or functools.partial(packed_linear, weight=weight.clone(), packed=False))
    return merged


def _merge_into(space: torch.Tensor, base, module, adapter: str) -> torch.Tensor:
    """``base``'s weight with ``module``'s LoRA term added (a copy of it where ``module`` is None),
    written into ``space`` and returned [out, in]."""
    weight = space.view(base.weight.shape)
    if module is None:
        return weight.copy_(base.weight.detach())
    return torch.addmm(
        base.weight.detach(),
        module.lora_B[adapter].weight.detach(),
        module.lora_A[adapter].weight.detach(),
        alpha=float(module.scaling[adapter]),
        out=weight,
    )


def count(plan: list) -> int:
    """How many LoRA projections a plan (per layer a list of bundles, then the lm_head's) covers."""
    bundles = [b for layer in plan[:-1] for b in layer] + [plan[-1]]
    return sum(
        len(b.parts)
        if isinstance(b, Terms)
        else b.lora
        if isinstance(b, Fused)
        else sum(m is not None for m in b)
        for b in bundles
        if b is not None
    )


def project(
    linear: Callable, parent, names, merged: Fused | Merged | None, x: torch.Tensor
) -> list[torch.Tensor]:
    """The projections ``names`` of ``parent`` on rows ``x`` through one adapter's ``merged``
    bundle: its fused matmul, or per projection its merged matmul, or the base weight
    (``linear``) where the adapter has no LoRA there (``merged`` None: base-model rows)."""
    if isinstance(merged, Fused):
        return list(merged.matmul(x).split(merged.sizes, dim=-1))
    outs = []
    for index, name in enumerate(names):
        fn = merged[index] if merged is not None else None
        if fn is None:
            base = base_of(getattr(parent, name))
            outs.append(linear(x, base.weight, base.bias))
        else:
            outs.append(fn(x))
    return outs


def run_merged(linear: Callable, parent, names, x: torch.Tensor, groups, bundle: int) -> list[torch.Tensor]:
    """The projections ``names`` of ``parent`` on ``x`` with merged plans: each group of rows
    (``(rows, layer plan or None)``: None for the base model) through its own weights. One group of
    every row needs no gathering."""
    bundles = [(rows, plan[bundle] if plan is not None else None) for rows, plan in groups]
    if len(bundles) == 1:
        return project(linear, parent, names, bundles[0][1], x)
    outs = None
    for rows, merged in bundles:
        parts = project(linear, parent, names, merged, take_rows(x, rows))
        if outs is None:
            outs = [x.new_empty(x.shape[0], part.shape[-1]) for part in parts]
        for out, part in zip(outs, parts):
            if isinstance(rows, slice):
                out[rows] = part
            else:
                out.index_copy_(0, rows, part)
    return outs
