"""One adapter's LoRA weights as the lean decoder runs them: merged into copies of the weights, or as terms.

A plan is made per adapter and made again when any of its weights changes (a training session's
after ``optim_step``), keyed by :func:`versions`. It takes one of two forms, decided per engine
(:meth:`~.llama_decoder.LlamaDecoder.merges_lora`), never per batch, so a row's arithmetic does
not depend on which rows share its step:

* **merged** (fp32 base on CPU, where the model's weights fit the copy budget): each projection's
  weight with its LoRA term added once, ``W + scaling * B A``, prepacked for oneDNN with its
  calibration (:class:`~.row_invariant.PackedMatmul`). A decode step then runs one matmul a
  projection for the adapter's rows, as for the base model, instead of the base matmul plus two
  LoRA matmuls and an add; the copies are as large as the adapted weights (425 MB on smollm2).
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


def versions(modules, adapter: str) -> tuple:
    """What a plan depends on: the adapter's weights (their versions) and the thread count (its
    prepacked matrices' calibrations)."""
    return (torch.get_num_threads(),) + tuple(
        (id(w), w._version) for m in modules for w in (m.lora_A[adapter].weight, m.lora_B[adapter].weight)
    )


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


def merged_of(parent, names, adapter: str, scratch: torch.Tensor) -> Merged | None:
    """Per projection of ``names``, a matmul over ``W + scaling * B A`` (fp32, prepacked where
    oneDNN's packed kernel is row-invariant at the shape), or None where ``adapter`` has no LoRA;
    None when it has none in the bundle. Each sum is made in ``scratch`` (as many floats as the
    largest weight) and packed from there, so making a plan leaves no freed weight-sized blocks in
    the heap."""
    present = dict(_lora_layers(parent, names, adapter))
    if not present:
        return None
    merged: Merged = []
    for name in names:
        module = present.get(name)
        if module is None:
            merged.append(None)
            continue
        base = base_of(module)
        weight = scratch[: base.weight.numel()].view(base.weight.shape)
        torch.addmm(
            base.weight.detach(),
            module.lora_B[adapter].weight.detach(),
            module.lora_A[adapter].weight.detach(),
            alpha=float(module.scaling[adapter]),
            out=weight,
        )
        packed = PackedMatmul.of(weight)  # a copy of its own
        merged.append(packed or functools.partial(packed_linear, weight=weight.clone(), packed=False))
    return merged


def count(plan: list) -> int:
    """How many LoRA projections a plan (per layer a list of bundles, then the lm_head's) covers."""
    bundles = [b for layer in plan[:-1] for b in layer] + [plan[-1]]
    return sum(
        len(b.parts) if isinstance(b, Terms) else sum(m is not None for m in b)
        for b in bundles
        if b is not None
    )


def project(linear: Callable, base, layer_plan, bundle: int, index: int, x: torch.Tensor) -> torch.Tensor:
    """Projection ``index`` of ``bundle`` on rows ``x``: the plan's merged matmul, or the base
    weight (``linear``) where the rows' adapter has no LoRA there or they are base-model rows."""
    merged = layer_plan[bundle] if layer_plan is not None else None
    fn = merged[index] if merged is not None else None
    return fn(x) if fn is not None else linear(x, base.weight, base.bias)


def run_merged(linear: Callable, parent, names, x: torch.Tensor, groups, bundle: int) -> list[torch.Tensor]:
    """The projections ``names`` of ``parent`` on ``x`` with merged plans: each group of rows
    (``(rows, layer plan or None)``: None for the base model) through its own weights. One group of
    every row needs no gathering."""
    outs = []
    for index, name in enumerate(names):
        base = base_of(getattr(parent, name))
        if len(groups) == 1:
            outs.append(project(linear, base, groups[0][1], bundle, index, x))
            continue
        out = x.new_empty(x.shape[0], base.out_features)
        for rows, layer_plan in groups:
            part = project(linear, base, layer_plan, bundle, index, take_rows(x, rows))
            if isinstance(rows, slice):
                out[rows] = part
            else:
                out.index_copy_(0, rows, part)
        outs.append(out)
    return outs
