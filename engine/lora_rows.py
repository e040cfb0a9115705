"""Mixed-adapter batches: every row of a forward through its own LoRA adapter, a group at a time.

peft can mix adapters in one batch (``adapter_names=[...]``), but it registers forward hooks on
every LoRA layer for each call and, in each layer, rebuilds the row lists of every adapter in
Python, gathers them and scatters the results back: in a decode step of 16 rows from 4 sessions
that bookkeeping cost more than the model. Here the engine works out the groups once per forward
(:func:`grouped_rows`) and a LoRA ``Linear`` adds each group's ``B(A(x)) * scaling`` to its rows of
the base output: a slice when the group's rows are contiguous, an index otherwise.

Per row this is the arithmetic of a single-adapter forward (the same base output plus the same
LoRA term, and the linear layers give each row the same result at any row count, see
:mod:`.invariant`), so a row's tokens and logprobs do not depend on which sessions share its batch.
Outside :func:`grouped_rows`, and for LoRA variants (DoRA, ...), peft's own forward runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from peft.tuners.lora.layer import Linear as LoraLinear

Groups = list[tuple[str | None, slice | torch.Tensor]]


class _Current(threading.local):
    groups: Groups | None = None


_CURRENT = _Current()


def groups_of(adapters: list[str | None], device: torch.device | str = "cpu") -> Groups:
    """Each distinct adapter of ``adapters`` (None: base model) with the rows that use it."""
    rows: dict[str | None, list[int]] = {}
    for row, adapter in enumerate(adapters):
        rows.setdefault(adapter, []).append(row)
    return [
        (
            adapter,
            slice(index[0], index[-1] + 1)
            if index[-1] - index[0] + 1 == len(index)
            else torch.tensor(index, device=device),
        )
        for adapter, index in rows.items()
    ]


@contextlib.contextmanager
def grouped_rows(groups: Groups) -> Iterator[None]:
    """Within this block (on this thread), LoRA linear layers apply ``groups``' adapters by row."""
    before, _CURRENT.groups = _CURRENT.groups, groups
    try:
        yield
    finally:
        _CURRENT.groups = before


def take_rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """The rows ``rows`` of ``x`` (a view for a slice)."""
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def add_to_rows(out: torch.Tensor, rows: slice | torch.Tensor, delta: torch.Tensor) -> None:
    """``out[rows] += delta``, in place, without writing the slice back."""
    if isinstance(rows, slice):
        out[rows].add_(delta)
    else:
        out.index_add_(0, rows, delta)


_peft_forward = LoraLinear.forward


def _forward(self: LoraLinear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    groups = _CURRENT.groups
    if groups is None or args or kwargs or self.merged or self.lora_variant:
        return _peft_forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    for adapter, rows in groups:
        if adapter is None or adapter not in self.lora_A:
            continue
        part = take_rows(x, rows).to(self.lora_A[adapter].weight.dtype)
        delta = self.lora_B[adapter](self.lora_A[adapter](self.lora_dropout[adapter](part)))
        add_to_rows(result, rows, (delta * self.scaling[adapter]).to(result.dtype))
    return result


LoraLinear.forward = _forward


def only_linear_lora(model: torch.nn.Module) -> bool:
    """Whether every LoRA layer of ``model`` is a ``Linear`` (grouped rows cover no other kind)."""
    from peft.tuners.lora.layer import LoraLayer

    return all(isinstance(m, LoraLinear) for m in model.modules() if isinstance(m, LoraLayer))
