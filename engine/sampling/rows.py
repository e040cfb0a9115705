"""Groups of rows that share an adapter: the decode batch runs each group through its own adapter.

A batch's rows come from requests of different sessions (and of base models, adapter None). The
lean decoder runs each group's rows through its adapter's plan (:mod:`.lora_plans`), reaching them
by a slice when the group's rows are contiguous, an index otherwise. Per row this is the arithmetic
of a single-adapter forward, so a row's tokens and logprobs do not depend on which sessions share
its batch.
"""

from __future__ import annotations

import torch

Groups = list[tuple[str | None, slice | torch.Tensor]]


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


def take_rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """The rows ``rows`` of ``x`` (a view for a slice)."""
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def add_to_rows(out: torch.Tensor, rows: slice | torch.Tensor, delta: torch.Tensor) -> None:
    """``out[rows] += delta``, in place, without writing the slice back (an fp32 ``delta`` into
    bf16 ``out`` is added in fp32 and rounded once)."""
    if isinstance(rows, slice):
        out[rows].add_(delta)
    else:
        out.index_add_(0, rows, delta.to(out.dtype))
