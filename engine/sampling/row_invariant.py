"""Row-invariant kernels: a row's tokens and logprobs do not depend on which rows share its batch.

Continuous batching puts whatever requests are in flight into one forward pass, and which requests
those are depends on thread timing. If a row's arithmetic depended on its neighbours, the same
seeded request would return logprobs that differ in the last bits from run to run, and so would
every loss computed from them. The lean decoder (:mod:`.llama_decoder`) computes each row as a
function of the row alone with these pieces:

* **Decode attention** (:func:`decode_attention`): rows keep their KV cache from column 0
  (right-padded) in blocks of :data:`BLOCK` columns, and attention is an explicit ``q @ k^T -> mask
  -> softmax -> @ v``: masked columns add exact zeros at the end of every reduction, so neither the
  batch's width nor its other rows change a row's sums (fused SDPA kernels pick block sizes from
  the batch's shapes, so they do). A prefill runs each prompt's attention on its own, shaped exactly
  as if the prompt were prefilled alone.
* **Linear layers** (:class:`RowInvariantLinears`): BLAS libraries treat the last rows of a small
  matrix (and strided rows) with other kernels, so inputs are dense rows padded with zero rows to a
  count measured at start-up to give each row exactly its large-matrix result. Frozen base weights
  run through oneDNN, which is exact at nearly every row count here and faster than the default
  BLAS for decode-sized batches. With a prepacked copy of each weight it is faster still (a 64-row
  decode step's base linear layers on smollm2: 82 ms against 101 ms on the weights as they are, the
  same bits either way), but the copies are as large as the weights, so they are kept only where the
  engine's memory budget holds them; LoRA weights, which change, go through ``F.linear`` (exact on
  this CPU for multiples of 4 below 12 rows and for any count from 12).
* Everything else in these models (norms, rotary embeddings, activations, log-softmax) works row by
  row already.

Nothing here touches a model's modules or a library's globals: the decoder calls these functions
with the weights. Training forwards run the model's own modules; their shapes follow from their
data, so they repeat exactly anyway. On GPUs the BLAS libraries split reductions by shape, so there
this is best effort, and the oneDNN copies are CPU-only.
"""

from __future__ import annotations

import weakref
from functools import cache

import torch
import torch.nn.functional as F

BLOCK = 64  # decode attention works on cache columns in blocks of this many


def decode_bias(positions: torch.Tensor, blocks: int, kv_heads: int) -> torch.Tensor:
    """What :func:`decode_attention` adds to each row's scores: 0 for the cache columns up to and
    including the row's position, -inf after it; [blocks * rows * kv heads, 1, BLOCK]."""
    columns = torch.arange(blocks * BLOCK, device=positions.device).reshape(blocks, 1, 1, 1, BLOCK)
    bias = torch.zeros(blocks, positions.shape[0], 1, 1, BLOCK, device=positions.device)
    bias.masked_fill_(columns > positions[None, :, None, None, None], float("-inf"))
    return bias.expand(-1, -1, kv_heads, -1, -1).reshape(-1, 1, BLOCK)


def decode_attention(query, key, value, bias):
    """One new token per row over its cache columns (``bias`` from :func:`decode_bias`), with the
    query already scaled. The cache comes in blocks, ``key``/``value`` [blocks, rows, kv heads,
    BLOCK, dim]: every matmul has the same shape and memory layout whatever the batch, each block's
    sum is taken at a fixed size, and blocks are added in column order, so a row's result depends
    on its own columns only (those past its end, however many, add exact zeros)."""
    blocks, rows, kv_heads, _, dim = key.shape
    heads = query.shape[1]
    groups, count = heads // kv_heads, blocks * rows * kv_heads
    q = query.reshape(1, rows * kv_heads, groups, dim).expand(blocks, -1, -1, -1).reshape(count, groups, dim)
    scores = torch.baddbmm(bias.to(q.dtype), q, key.view(count, BLOCK, dim).transpose(1, 2))
    scores = scores.view(blocks, rows, kv_heads, groups, BLOCK)
    top = scores.amax(dim=(0, 4), keepdim=True)  # exact: max does not round
    weights = scores.sub_(top).exp_()
    sums = weights.sum(dim=-1)  # [blocks, rows, kv heads, groups]
    outs = torch.bmm(weights.view(count, groups, BLOCK), value.view(count, BLOCK, dim))
    outs = outs.view(blocks, rows, kv_heads, groups, dim)
    total, out = sums[0], outs[0]
    for block in range(1, blocks):  # in column order
        total, out = total + sums[block], out + outs[block]
    return out.div_(total[..., None]).view(rows, 1, heads, dim)


# linear layers ---------------------------------------------------------------------------------
def _good_row_counts(linear, features: int, device: torch.device) -> list[int]:
    """Row counts m <= 16 for which ``linear`` gives each of m rows exactly what it gives that row
    in a 64-row matrix (BLAS libraries treat the last rows of small matrices with other kernels)."""
    x = torch.randn(64, features, generator=torch.Generator().manual_seed(0)).to(device)
    reference = linear(x)
    return [m for m in range(1, 17) if torch.equal(linear(x[:m]), reference[:m])]


@cache
def row_padding(device: str = "cpu") -> tuple[int, ...]:
    """For m = 1..16 rows, the row count that ``F.linear`` inputs are padded to so every row's
    result is the one it gets in a large matrix (measured on this machine's BLAS)."""
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)).to(device)
    return _padding(_good_row_counts(lambda x: F.linear(x, weight), 64, torch.device(device)))


def _padding(good: list[int]) -> tuple[int, ...]:
    return tuple(next((g for g in good if g >= m), 16) for m in range(1, 17))


def pad_rows(x: torch.Tensor, padding: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """``x`` as a dense [rows, features] matrix padded with zero rows per ``padding``, and its row count."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    flat = x.reshape(rows, x.shape[-1]).contiguous()  # strided rows take other kernels too
    target = padding[rows - 1] if 0 < rows <= 16 else rows
    if target > rows:
        flat = torch.cat([flat, flat.new_zeros(target - rows, x.shape[-1])])
    return flat, rows


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's prepacked copy of a [out, in] weight, for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, packed: bool = True
) -> torch.Tensor:
    """``F.linear`` through oneDNN, each row computed as in any other batch; ``weight`` is a
    :func:`pack_weight` copy, or with ``packed=False`` the [out, in] weight itself."""
    out_features = weight.shape[0]
    flat, rows = pad_rows(x, onednn_padding(x.shape[-1], out_features, bias is not None, packed))
    out = _onednn_linear(flat, weight, bias)
    return out[:rows].reshape(*x.shape[:-1], out_features)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@cache
def onednn_padding(in_features: int, out_features: int, bias: bool, packed: bool = True) -> tuple[int, ...]:
    """:func:`row_padding` for oneDNN's linear of one shape, prepacked or not (its kernels follow
    the shape, not the values, so one probe serves every layer of that shape)."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(out_features, in_features, generator=gen)
    if packed:
        weight = pack_weight(weight)
    b = torch.randn(out_features, generator=gen) if bias else None
    return _padding(
        _good_row_counts(lambda m: _onednn_linear(m, weight, b), in_features, torch.device("cpu"))
    )


@cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (asked on first use, on the engine's
    own thread: a probe on the importing thread would start a second OpenMP team there)."""
    try:
        _onednn_linear(
            torch.randn(2, 8), torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 8), 64), None
        )
        return torch.backends.mkldnn.is_available()
    except (AttributeError, RuntimeError):
        return False


class RowInvariantLinears:
    """``F.linear`` of frozen base weights that gives each row what it gets in any other batch.

    On CPU with oneDNN each weight goes through oneDNN: while :attr:`pack` is set, through a
    prepacked copy, made on first use and again if the weight ever changes (its tensor version),
    else through the weight itself (the same bits, no copy); elsewhere inputs are padded to exact
    row counts. The copies are held per weight tensor and go when the weight does."""

    def __init__(self):
        self.pack = True  # through prepacked copies (set by :meth:`packing`)
        # id(weight) -> (a weak reference to it, its version when packed, the packed copy); tensors
        # compare element-wise, so they cannot be dictionary keys themselves
        self._packed: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32 and onednn_available():
            if self.pack:
                return packed_linear(x, self.packed(weight), bias)
            return packed_linear(x, weight, bias, packed=False)
        flat, rows = pad_rows(x, row_padding(x.device.type))
        out = F.linear(flat, weight, bias)
        return out[:rows].reshape(*x.shape[:-1], weight.shape[0])

    def release(self) -> None:
        """Drop the packed copies (made again on next use)."""
        self._packed.clear()

    def packing(self, on: bool) -> None:
        """Use prepacked copies from now on, or not (dropping those made)."""
        if not on:
            self.release()
        self.pack = on

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        key = id(weight)
        entry = self._packed.get(key)
        if entry is None or entry[0]() is not weight or entry[1] != weight._version:
            gone = weakref.ref(weight, lambda _, key=key: self._packed.pop(key, None))
            entry = self._packed[key] = (gone, weight._version, pack_weight(weight))
        return entry[2]
