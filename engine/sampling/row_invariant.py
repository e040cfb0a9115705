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
  the batch's shapes, so they do). Where the sampler's C kernels are built, one C call a layer
  does a step's attention instead, each row reading only its own columns in a fixed order
  (:mod:`.fused_ops`). A prefill runs each prompt's attention on its own, shaped exactly as
  if the prompt were prefilled alone.
* **Linear layers** (:func:`rowwise`): BLAS libraries and oneDNN pick kernels by a matmul's
  shape, and a small row count or the last rows of a matrix can go through code that sums each
  dot product in another order. Which counts do differs between CPUs, library builds and thread
  counts (on one CPU every count from 12 is exact; on another the BLAS treats most counts that
  are not multiples of 4 differently at any size), so nothing is assumed: the first time the
  engine meets a kernel at a shape it *calibrates* it on its own thread (:func:`calibrate`), and
  from then on runs it in calls of 64 rows and one call of the rest, padded with zero rows to a
  row count calibration found to give every row exactly its 64-row result. Frozen base weights
  run through oneDNN, faster than the BLAS for decode-sized batches, and through a prepacked copy
  of each weight where the engine's memory budget holds the copies (the same bits, less time; the
  copies are as large as the weights). An adapter's weights, which change, are prepacked in its
  plan (:mod:`.lora_plans`: merged into copies of the weights, or LoRA matrices) where oneDNN's
  packed kernel is row-invariant at their shape (:class:`PackedMatmul`, made again when the
  adapter changes), else go through the BLAS, or through oneDNN at a shape where only oneDNN is
  row-invariant (:func:`lora_linear`). Calls of one or two rows against a prepacked copy (a
  request decoding alone) go through :mod:`.few_rows`, which gives each row its 64-row oneDNN bits
  at close to memory speed. Every row
  count from 1 to CHUNK is calibrated: a decode batch meets them all as its rows finish. A prefill's
  many rows go in calls of :data:`WIDE` rows where a call of that many gives each row exactly its
  CHUNK-row bits (calibrated the first time a call is that wide; oneDNN's kernels block a matmul's
  rows, not its sums, so they do), which runs a long prompt's projections at the rate of one
  large matmul rather than of many small ones. A kernel
  whose 64-row result depends on a row's place is reported (:func:`report`): the engine says so
  at start and in ``sess engine status``.
* Everything else in these models (norms, rotary embeddings, activations, log-softmax) works row by
  row already.

Nothing here touches a model's modules or a library's globals: the decoder calls these functions
with the weights. Training forwards run the model's own modules; their shapes follow from their
data, so they repeat exactly anyway. On GPUs the BLAS libraries split reductions by shape, so there
this is best effort, and the oneDNN copies are CPU-only.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sess.engine.libraries import torch_internals
from sess.engine.sampling import few_rows, onednn
from sess.engine.sampling.onednn import CHUNK

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
# the row counts calibration tries: every count, since a decode batch meets every count as its rows
# finish (most steps of an 8 x 8 batch run at 62-64 rows); a count found exact runs unpadded
COUNTS = tuple(range(1, CHUNK + 1))


# row counts of one call beyond CHUNK, widest first, each used where calibration finds it gives every
# row its CHUNK-row bits; a call's output stays within WIDE_BYTES (an output layer's are wide)
WIDE = (1024, 512, 256, 128)
WIDE_BYTES = 64 << 20


class WideCalls:
    """Which of the :data:`WIDE` row counts give each row of a call exactly what it gets in a
    CHUNK-row call, for one kernel at one shape: each count measured the first time a call of that
    many rows could be made (``make()`` builds the kernel again on a random weight of the shape, so
    no weight is held between measurements)."""

    def __init__(self, make: Callable[[], Callable], in_features: int, out_features: int, dtype, device):
        self._make, self._shape, self._on = make, (in_features, out_features), (dtype, device)
        self._found: dict[int, bool] = {}

    def widest(self, rows: int) -> int:
        """The widest count of :data:`WIDE` up to ``rows`` found exact (0: none)."""
        for wide in WIDE:
            if wide <= rows and wide * self._shape[1] * 4 <= WIDE_BYTES and self.exact(wide):
                return wide
        return 0

    def exact(self, wide: int) -> bool:
        if wide not in self._found:
            fn, gen = self._make(), torch.Generator().manual_seed(4)
            x = torch.randn(wide, self._shape[0], generator=gen).to(device=self._on[1], dtype=self._on[0])
            chunked = torch.cat([fn(x[start : start + CHUNK]) for start in range(0, wide, CHUNK)])
            self._found[wide] = torch.equal(fn(x), chunked)
        return self._found[wide]


@dataclass(frozen=True)
class RowCounts:
    """What calibration found for one kernel at one shape: for m = 1..CHUNK rows, the row count a
    call of m rows is padded to (``padded[m - 1]``), whether a row's result in a CHUNK-row
    call was the same at every place in it (without that no padding helps), and which calls
    wider than CHUNK rows give each row its CHUNK-row bits (:class:`WideCalls`; None: none)."""

    padded: tuple[int, ...]
    exact: bool
    wide: WideCalls | None = field(default=None, compare=False)


# (kernel, in features, out features, dtype, device type, bias, threads) -> its RowCounts
_calibrated: dict[tuple, RowCounts] = {}


def calibrate(
    fn: Callable[[torch.Tensor], torch.Tensor],
    in_features: int,
    dtype,
    device,
    make: Callable[[], Callable] | None = None,
) -> RowCounts:
    """Measure ``fn`` (a matmul over rows, on the engine's thread and thread count): which row
    counts give each row exactly what it gets in a CHUNK-row call, first rows and last rows alike,
    and whether rows shifted in a CHUNK-row call come out shifted and otherwise unchanged. The
    kernels follow the shape, not the values, so one measurement serves every weight of a shape.
    Wider calls are measured when first wanted (:class:`WideCalls`), on ``make()`` (a kernel like
    ``fn``; without it, ``fn`` itself, held until then)."""
    x = torch.randn(CHUNK, in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(device=device, dtype=dtype)
    reference = fn(x)
    exact = all(torch.equal(fn(x.roll(s, 0)).roll(-s, 0), reference) for s in (1, 5, 27))
    good = [
        m
        for m in COUNTS
        if m == CHUNK
        or (torch.equal(fn(x[:m].clone()), reference[:m]) and torch.equal(fn(x[-m:].clone()), reference[-m:]))
    ]
    wide = WideCalls(make or (lambda: fn), in_features, reference.shape[-1], dtype, device) if exact else None
    return RowCounts(tuple(next(g for g in good if g >= m) for m in range(1, CHUNK + 1)), exact, wide)


def _kernel(kernel: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Callable:
    """The matmul ``kernel`` names, over ``weight`` (and ``bias``): a function of the rows."""
    if kernel == "blas":
        return lambda rows: F.linear(rows, weight, bias)
    if kernel == "onednn packed":
        weight = onednn.pack_weight(weight)
    return lambda rows: onednn.linear(rows, weight, bias)


def row_counts(kernel: str, in_features: int, out_features: int, x: torch.Tensor, bias: bool) -> RowCounts:
    """The calibration of ``kernel`` at this shape for inputs like ``x``, made on first use with a
    random weight of the shape: the kernels follow the shape, not the values, and a real weight could
    hide what they do (a fresh adapter's zero B gives exact zeros at any row count)."""
    key = (kernel, in_features, out_features, x.dtype, x.device.type, bias, torch.get_num_threads())
    found = _calibrated.get(key)
    if found is None:

        def make() -> Callable:
            gen = torch.Generator().manual_seed(2)
            weight = torch.randn(out_features, in_features, generator=gen).to(device=x.device, dtype=x.dtype)
            b = torch.randn(out_features, generator=gen).to(device=x.device, dtype=x.dtype) if bias else None
            return _kernel(kernel, weight, b)

        found = _calibrated[key] = calibrate(make(), in_features, x.dtype, x.device, make)
    return found


def report() -> dict:
    """Whether every kernel calibrated so far gives each row the same bits in any batch, for the
    engine's status: ``exact``, ``kernels`` (how many shapes were measured), ``inexact`` (those
    that are not: sampled logprobs may then differ in their last bits between batch compositions,
    while replays of the same requests stay exact) and ``few_rows`` (:func:`.few_rows.status`)."""
    inexact = [
        f"{kernel} {k}->{n} {str(dtype).removeprefix('torch.')} on {device}"
        for (kernel, k, n, dtype, device, _, _), counts in _calibrated.items()
        if not counts.exact
    ]
    return {
        "exact": not inexact,
        "kernels": len(_calibrated),
        "inexact": inexact,
        "few_rows": few_rows.status(),
    }


def self_check(device: str = "cpu") -> dict:
    """Calibrate the kernels the lean decoder uses at a few typical shapes (a hidden size and a
    LoRA rank each way) and :func:`report`; the engine runs it at start, on its own thread."""
    linears = RowInvariantLinears()
    gen = torch.Generator().manual_seed(3)
    for k, n in ((64, 24), (576, 96), (32, 576), (576, 1536)):
        x = torch.randn(1, k, generator=gen).to(device)
        weight = torch.randn(n, k, generator=gen).to(device)
        linears(x, weight)
        lora_linear(x, weight)
    return report()


def rowwise(
    fn, x: torch.Tensor, counts: RowCounts, out_features: int, few: few_rows.FewRows | None = None
) -> torch.Tensor:
    """``fn`` over the rows of ``x`` [..., in] in calls of CHUNK rows and one of the rest, padded
    with zero rows to a calibrated count: each row gets its result in a CHUNK-row call. Many rows
    go first in calls of the widest count of :data:`WIDE` that gives each row those bits. With
    ``few`` (the same packed weight's few-row kernel), fp32 calls of up to few_rows.FEW rows go
    through it instead: the same bits, faster."""
    flat_in = x.dim() == 2  # a decoder's rows (no reshaping either way)
    rows = x.shape[0] if flat_in else x.numel() // x.shape[-1] if x.shape[-1] else 0
    if few is not None and 0 < rows <= few_rows.FEW and x.dtype == torch.float32:
        return few(x)
    flat = x if flat_in else x.reshape(rows, x.shape[-1])
    if not flat.is_contiguous() or flat.data_ptr() % 64:  # as calibrated: dense, aligned rows
        flat = flat.clone(memory_format=torch.contiguous_format)
    if 0 < rows <= CHUNK and counts.padded[rows - 1] == rows:  # one call as it is (most decode steps)
        out = fn(flat)
        return out if flat_in else out.reshape(*x.shape[:-1], out_features)
    outs, done = [], 0
    while counts.wide is not None and rows - done >= 2 * CHUNK:  # a prefill's rows: wide calls
        wide = counts.wide.widest(rows - done)
        if not wide:
            break
        outs.append(fn(flat[done : done + wide]))
        done += wide
    for start in range(done, rows, CHUNK):
        part = flat[start : start + CHUNK]
        n = part.shape[0]
        target = counts.padded[n - 1]
        if target > n:
            part = torch.cat([part, part.new_zeros(target - n, part.shape[1])])
        outs.append(fn(part)[:n])
    out = outs[0] if len(outs) == 1 else torch.cat(outs) if outs else x.new_zeros(0, out_features)
    return out.reshape(*x.shape[:-1], out_features)


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, packed: bool = True
) -> torch.Tensor:
    """``F.linear`` through oneDNN, each row computed as in any other batch; ``weight`` is a
    :func:`.onednn.pack_weight` copy (its out features first), or with ``packed=False`` the [out, in]
    weight itself."""
    kernel = "onednn packed" if packed else "onednn"
    counts = row_counts(kernel, x.shape[-1], weight.shape[0], x, bias is not None)
    return rowwise(lambda rows: onednn.linear(rows, weight, bias), x, counts, weight.shape[0])


def blas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (the BLAS), each row computed as in any other batch."""
    counts = row_counts("blas", x.shape[-1], weight.shape[0], x, bias is not None)
    return rowwise(_kernel("blas", weight, bias), x, counts, weight.shape[0])


def lora_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A LoRA matmul (weights that change, so never prepacked): through the BLAS where it is
    row-invariant at this shape, else through oneDNN where that is."""
    kernel, counts = "blas", row_counts("blas", x.shape[-1], weight.shape[0], x, False)
    if not counts.exact and x.is_cpu and x.dtype == torch.float32 and onednn.available():
        through_onednn = row_counts("onednn", x.shape[-1], weight.shape[0], x, False)
        if through_onednn.exact:
            kernel, counts = "onednn", through_onednn
    return rowwise(_kernel(kernel, weight, None), x, counts, weight.shape[0])


@dataclass(frozen=True)
class PackedMatmul:
    """A fixed weight prepacked for oneDNN with its calibration, for a LoRA plan: ``self(x)`` is
    ``F.linear(x, weight)`` with each row computed as in any other batch, with no lookup per call."""

    weight: torch.Tensor  # the prepacked copy
    out_features: int
    counts: RowCounts
    few: few_rows.FewRows | None = None  # calls of up to few_rows.FEW rows, where it matches

    @classmethod
    def of(cls, weight: torch.Tensor) -> PackedMatmul | None:
        """``weight`` [out, in] packed, where oneDNN's packed kernel gives each row the same bits at
        this shape on this machine (None where it does not, or without oneDNN)."""
        if not (weight.is_cpu and weight.dtype == torch.float32 and onednn.available()):
            return None
        counts = row_counts("onednn packed", weight.shape[1], weight.shape[0], weight, False)
        if not counts.exact:
            return None
        packed = onednn.pack_weight(weight)
        return cls(packed, weight.shape[0], counts, few_rows.FewRows.of(packed, *weight.shape))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rowwise(self._call, x, self.counts, self.out_features, self.few)

    def _call(self, rows: torch.Tensor) -> torch.Tensor:
        return onednn.linear(rows, self.weight)


class _PackedCopy(NamedTuple):
    """A weight's prepacked copy with the call on it and its calibration, valid while ``weight()``
    is that tensor at ``version``."""

    weight: weakref.ref
    version: int
    packed: torch.Tensor
    call: Callable[[torch.Tensor], torch.Tensor]
    counts: RowCounts
    few: few_rows.FewRows | None  # calls of up to few_rows.FEW rows (no bias), where it matches


class RowInvariantLinears:
    """``F.linear`` of frozen base weights that gives each row what it gets in any other batch.

    On CPU with oneDNN each weight goes through oneDNN: while :attr:`pack` is set, through a
    prepacked copy, made on first use and again if the weight ever changes (its tensor version),
    else through the weight itself (the same bits, no copy); elsewhere through the BLAS. Either
    way in calibrated row counts (:func:`rowwise`). The copies are held per weight tensor and go
    when the weight does."""

    def __init__(self):
        self.pack = True  # through prepacked copies (set by :meth:`packing`)
        self._threads = torch.get_num_threads()  # the thread count the copies' calibrations hold for
        # id(weight) -> its copy; tensors compare element-wise, so they cannot be dictionary keys
        self._packed: dict[int, _PackedCopy] = {}
        self.on_change: Callable[[], None] | None = None  # called before any copy is dropped or made

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32 and onednn.available():
            if self.pack:  # the copy, its kernel and its calibration, looked up once per weight
                copy = self._copy(weight, bias, x)
                return rowwise(copy.call, x, copy.counts, weight.shape[0], copy.few)
            return packed_linear(x, weight, bias, packed=False)
        return blas_linear(x, weight, bias)

    def packed_bytes(self) -> int:
        """Bytes the packed copies held now take."""
        return sum(copy.packed.numel() * copy.packed.element_size() for copy in self._packed.values())

    def few_of(self, weight: torch.Tensor) -> few_rows.FewRows | None:
        """The few-row kernel over ``weight``'s prepacked copy (made now if it is not held), where
        the copies are on and the kernel matches oneDNN at its shape; else None."""
        if not (self.pack and weight.device.type == "cpu" and weight.dtype == torch.float32):
            return None
        if not onednn.available():
            return None
        return self._copy(weight, None, weight[:1]).few

    def release(self) -> None:
        """Drop the packed copies (made again on next use)."""
        if self.on_change is not None:
            self.on_change()
        self._packed.clear()

    def packing(self, on: bool) -> None:
        """Use prepacked copies from now on, or not (dropping those made). Called before every
        decode step: a change of the thread count drops the copies with their calibrations."""
        threads = torch.get_num_threads()
        if not on or threads != self._threads:
            self.release()
        self.pack, self._threads = on, threads

    def _copy(self, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> _PackedCopy:
        key = id(weight)
        copy = self._packed.get(key)
        if copy is None or copy.weight() is not weight or copy.version != torch_internals.version_of(weight):
            if self.on_change is not None:
                self.on_change()
            gone = weakref.ref(weight, lambda _, key=key: self._packed.pop(key, None))
            packed = onednn.pack_weight(weight)
            counts = row_counts("onednn packed", weight.shape[1], weight.shape[0], x, bias is not None)
            fn = functools.partial(onednn.linear, packed=packed, bias=bias)
            few = few_rows.FewRows.of(packed, *weight.shape) if bias is None and counts.exact else None
            copy = self._packed[key] = _PackedCopy(
                gone, torch_internals.version_of(weight), packed, fn, counts, few
            )
        return copy
