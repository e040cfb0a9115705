"""Decode attention as one C call a layer: the new entries into the cache and attention over it.

The lean decoder's attention over the :class:`~.block_cache.BlockCache` as torch ops
(:func:`~.row_invariant.decode_attention`) is ~20 small ops a layer and reads every row's cache up
to the batch's longest: at 64 rows on smollm2 ~24 ms of a ~140 ms step. ``decode_attention.c``
does the same step in one call a layer: it rotates each row's new key into its cache slot, writes
its value, rotates the queries (scaled) and attends over the row's own columns only, in an order
fixed by the code and the row's data (see the C file). So a row's result does not depend on its
batch, as with the torch ops, and the sums differ from theirs only in rounding: an engine uses
one or the other for its whole life (the decoder decides on its first step), so its requests
replay to the bit either way.

Used for fp32 on CPU, where :mod:`.native` built the kernels and the shape is one the kernel
covers (head dim a multiple of 16 up to 256, at most 16 query heads a key/value head).
"""

from __future__ import annotations

import torch

from sess.engine.sampling import native
from sess.engine.sampling.row_invariant import BLOCK

LANES, WIDEST, MOST_GROUPS = 16, 256, 16  # decode_attention.c's limits


def usable(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel computes this model's decode attention here (building it on first use)."""
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        return False
    shape_ok = head_dim % LANES == 0 and head_dim <= WIDEST and heads % kv_heads == 0
    return shape_ok and heads // kv_heads <= MOST_GROUPS and native.library()[0] is not None


def attend(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rotation: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """Write each row's ``key`` (rotated) and ``value`` [rows, kv heads, dim] into the cache layer
    ``keys``/``values`` [blocks, rows, kv heads, BLOCK, dim] at ``positions`` [rows], and return
    the attention [rows, heads, dim] of ``query`` [rows, heads, dim] (rotated, scaled) over each
    row's columns up to its position. ``rotation`` is ``(cos, sin, q_cos, q_sin)`` [rows, 1, dim]
    (``sin`` with rotate_half's signs; the queries' carry their scaling)."""
    lib, how = native.library()
    if lib is None:
        raise RuntimeError(f"decode attention kernel: {how}")
    rows, heads, dim = query.shape
    kv_heads = key.shape[1]
    if not (keys.is_contiguous() and values.is_contiguous()) or keys.shape[1:] != (rows, kv_heads, BLOCK, dim):
        raise ValueError(f"decode attention kernel: a cache layer of shape {tuple(keys.shape)} for {rows} rows")
    query, key, value = (_rows_dense(t) for t in (query, key, value))
    cos, sin, q_cos, q_sin = (t.contiguous() for t in rotation)
    positions = positions.to(torch.int64).contiguous()
    out = query.new_empty(rows, heads, dim)
    failed = lib.sess_decode_attention(
        query.data_ptr(),
        query.stride(0),
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        q_cos.data_ptr(),
        q_sin.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        positions.data_ptr(),
        rows,
        heads,
        kv_heads,
        dim,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise RuntimeError(f"decode attention kernel failed ({failed}: -1 a shape not built, -2 out of memory)")
    return out


def _rows_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` [rows, heads, dim] with each row's heads dense (rows may be strided: a split's view)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


def status() -> str:
    """Which decode attention the engine runs, for its status."""
    if not native.built():
        return "not built yet (built on the first decode step)"
    lib, how = native.library()
    if lib is None:
        return how + "; decode attention runs as torch ops"
    return f"a C kernel for fp32 models, {how}"
