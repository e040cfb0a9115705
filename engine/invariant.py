"""Batch-invariant sampling: a row's tokens and logprobs do not depend on which rows share its batch.

Continuous batching puts whatever requests are in flight into one forward pass, and which requests
those are depends on thread timing. If a row's arithmetic depended on its neighbours, the same
seeded request would return logprobs that differ in the last bits from run to run, and so would
every loss computed from them. Three things make a row's result a function of the row alone:

* **Attention** runs in :func:`sampler_attention` whenever the sampler passes a :class:`Layout`.
  Decode rows keep their KV cache from column 0 (right-padded), and attention is an explicit
  ``q @ k^T -> mask -> softmax -> @ v``: masked columns add exact zeros at the end of every
  reduction, so neither the batch's width nor its other rows change a row's sums (fused SDPA
  kernels pick block sizes from the batch's shapes, so they do). The prompts of a batched prefill
  each get their own causal SDPA call, shaped exactly as if the prompt were prefilled alone.
* **Linear layers** see the same number of rows whatever the batch: BLAS kernels treat the last
  few rows of a small matrix with a different code path, so :func:`row_padding` measures at start-up
  which row counts give every row the result it gets in a large matrix, and the forward hooks that
  :func:`make_linears_invariant` installs pad a linear's input up to the next such count while
  sampling (zeros rows, sliced off again). On this project's CPU that means multiples of 4 below 12.
* Everything else in these models (norms, rotary embeddings, activations, log-softmax) works row by
  row already.

Training forwards never take these paths: their shapes follow from their data, so they repeat
exactly anyway. On GPUs the BLAS libraries split reductions by shape, so there this is best effort.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "sess_sdpa"  # sdpa for everything but sampler forwards, which carry a Layout
BLOCK = 64  # decode attention works on cache columns in blocks of this many


@dataclass
class Layout:
    """Where the sampler's rows lie. Prefill: row ``r`` holds a prompt of ``prompt_lengths[r]``
    tokens at the end of its columns (left-padded). Decode: ``positions[r]`` is the cache column
    row ``r``'s one new token is written to; its earlier entries fill the columns before it."""

    prompt_lengths: list[int] | None = None
    positions: torch.Tensor | None = None


def sampler_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    layout: Layout | None = kwargs.pop("sess_layout", None)
    if layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if layout.prompt_lengths is not None:
        out = torch.zeros_like(query)  # padding columns attend to nothing
        width = query.shape[2]
        for row, n in enumerate(layout.prompt_lengths):  # one prompt at a time, shaped as if alone
            out[row : row + 1, :, width - n :] = F.scaled_dot_product_attention(
                query[row : row + 1, :, width - n :].contiguous(),
                key[row : row + 1, :, width - n :].contiguous(),
                value[row : row + 1, :, width - n :].contiguous(),
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
            )
        return out.transpose(1, 2).contiguous(), None
    return _decode_attention(query, key, value, layout.positions, scaling), None


def _decode_attention(query, key, value, positions, scaling):
    """One new token per row over its cache columns ``[0, positions[r]]``. The cache comes in
    blocks, ``key``/``value`` [blocks, rows, kv heads, BLOCK, dim]: every matmul has the same shape
    and memory layout whatever the batch, each block's sum is taken at a fixed size, and blocks are
    added in column order, so a row's result depends on its own columns only (those past its end,
    however many, add exact zeros)."""
    blocks, rows, kv_heads, _, dim = key.shape
    heads = query.shape[1]
    q = query.reshape(1, rows, kv_heads, heads // kv_heads, dim).expand(blocks, -1, -1, -1, -1)
    scores = (q @ key.transpose(-1, -2)) * scaling  # [blocks, rows, kv heads, groups, BLOCK]
    columns = torch.arange(blocks * BLOCK, device=key.device).reshape(blocks, 1, 1, 1, BLOCK)
    scores = scores.masked_fill(columns > positions[None, :, None, None, None], float("-inf"))
    top = scores.amax(dim=(0, 4), keepdim=True)  # exact: max does not round
    weights = (scores - top).exp()
    sums, outs = weights.sum(dim=-1), weights.to(value.dtype) @ value
    total, out = sums[0], outs[0]
    for block in range(1, blocks):  # in column order
        total, out = total + sums[block], out + outs[block]
    out = out / total[..., None]  # [rows, kv heads, groups, dim]
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous()


AttentionInterface.register(ATTENTION, sampler_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


# linear layers ---------------------------------------------------------------------------------
@cache
def row_padding(device: str = "cpu") -> tuple[int, ...]:
    """For m = 1..16 rows, the row count m is padded to so that each row's result equals the
    one it gets in a large matrix (measured on this machine's BLAS; large counts are exact)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(device)
    x = torch.randn(64, 64, generator=gen).to(device)
    reference = F.linear(x, weight)
    good = [m for m in range(1, 17) if torch.equal(F.linear(x[:m], weight), reference[:m])]
    return tuple(next((g for g in good if g >= m), 16) for m in range(1, 17))


class _Switch(threading.local):
    active = False


_SWITCH = _Switch()


@contextlib.contextmanager
def invariant_rows() -> Iterator[None]:
    """Within this block, hooked linear layers pad their inputs to batch-invariant row counts."""
    before, _SWITCH.active = _SWITCH.active, True
    try:
        yield
    finally:
        _SWITCH.active = before


def _pad_rows(module: torch.nn.Linear, args: tuple):
    if not _SWITCH.active:
        return None
    x = args[0]
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    target = row_padding(x.device.type)[rows - 1] if 0 < rows <= 16 else rows
    if target == rows:  # BLAS also reads strided rows differently: hand it dense ones
        return None if x.is_contiguous() else (x.contiguous(), *args[1:])
    module._sess_rows = (x.shape, rows)
    flat = x.reshape(rows, x.shape[-1])
    return (torch.cat([flat, flat.new_zeros(target - rows, x.shape[-1])]), *args[1:])


def _unpad_rows(module: torch.nn.Linear, args: tuple, output: torch.Tensor):
    shape_rows = module.__dict__.pop("_sess_rows", None)
    if shape_rows is None:
        return None
    shape, rows = shape_rows
    return output[:rows].reshape(*shape[:-1], output.shape[-1])


def make_linears_invariant(model: torch.nn.Module) -> None:
    """Hook every ``nn.Linear`` of ``model`` (base and LoRA layers) to pad rows inside :func:`invariant_rows`."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not getattr(module, "_sess_hooked", False):
            module.register_forward_pre_hook(_pad_rows)
            module.register_forward_hook(_unpad_rows)
            module._sess_hooked = True
