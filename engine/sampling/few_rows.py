"""Matmuls of one or two rows at memory speed, each row with the bits oneDNN's 64-row call gives it.

At one row a decode step is one pass over every weight of the model (538 MB of fp32 on smollm2),
so batch-1 decoding runs at the speed its matmuls stream weights at. oneDNN's prepacked kernel
streams them at ~18 GB/s at one row on a 2-core host whose memory reads at ~32. The kernel here
(``few_rows.c``) reads the same prepacked copy (no memory of its own) at close to the memory's
speed, and sums each output in the order oneDNN's packed kernel does at 64 rows: ``k`` in blocks, a
chain of fused multiply-adds within a block, the blocks' sums added in order. The block size and the
tile width of the packed layout are not assumed: :func:`order` finds them per shape by comparing
bits with oneDNN (calibration, as :mod:`.row_invariant` does for row counts), and a shape where
none matches keeps oneDNN. So a row's result is the same bits as before, alone or in any batch.

The kernel is C, built with the sampler's other kernels once per machine for its CPU
(:mod:`sess.engine.native.kernels`). Where it cannot be built or loaded, the rows go through
oneDNN as before: the same numbers, slower at one row. :func:`status` says which, for the engine's status.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sess.engine.libraries import torch_internals
from sess.engine.native import kernels as native
from sess.engine.sampling.onednn import CHUNK, linear, pack_weight

FEW = 2  # calls of at most this many rows go through the kernel (more: oneDNN is faster)
TILES = (64, 48, 32, 24, 16, 8)  # packed layouts' tile widths the kernel reads (few_rows.c)


@dataclass(frozen=True)
class Order:
    """How oneDNN's packed kernel lays out and sums one shape: ``tile`` output features a tile of
    the packed layout (the last tile padded: ``width`` features in all), and ``k`` summed in
    blocks of ``block``."""

    tile: int
    width: int
    block: int


# (in features, out features, threads) -> the shape's Order, or None where the kernel cannot match
_orders: dict[tuple[int, int, int], Order | None] = {}


def order(in_features: int, out_features: int) -> Order | None:
    """oneDNN's order at this shape, measured on first use (None: the kernel does not match it)."""
    key = (in_features, out_features, torch.get_num_threads())
    if key not in _orders:
        _orders[key] = _calibrate(in_features, out_features)
    return _orders[key]


def _calibrate(k: int, n: int) -> Order | None:
    """Pack a random weight of the shape, find the tile width its packed bytes are laid out in,
    then the block size with which the kernel gives 64 random rows exactly oneDNN's 64-row result."""
    lib, _ = native.library()
    if lib is None:
        return None
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(n, k, generator=gen)
    packed = pack_weight(weight)
    layout = next((t for t in TILES if _laid_out(packed, weight, t)), None)
    if layout is None:
        return None
    x = torch.randn(CHUNK, k, generator=gen)
    reference = linear(x, packed, None)
    for block in [k] + [2**i for i in range(3, 14) if 2**i < k]:
        found = Order(layout, -(-n // layout) * layout, block)
        few = FewRows(packed, _address(packed), n, found, lib.sess_few_rows)
        if torch.equal(few(x[:FEW]), reference[:FEW]) and torch.equal(few(x), reference):
            return found
    return None


def _laid_out(packed: torch.Tensor, weight: torch.Tensor, tile: int) -> bool:
    """Whether ``packed`` holds ``weight`` [n, k] as tiles of ``tile`` output features, k-major
    within a tile ([n / tile][k][tile], the last tile padded)."""
    n, k = weight.shape
    width = -(-n // tile) * tile
    if _nbytes(packed) != width * k * 4:
        return False
    raw = torch.frombuffer((ctypes.c_float * (width * k)).from_address(_address(packed)), dtype=torch.float32)
    return torch.equal(raw.view(width // tile, k, tile).transpose(1, 2).reshape(width, k)[:n], weight)


def _nbytes(packed: torch.Tensor) -> int:
    return torch_internals.onednn_nbytes(packed)


def _address(packed: torch.Tensor) -> int:
    return torch.ops.mkldnn.data_ptr(packed)


@dataclass(frozen=True)
class FewRows:
    """One prepacked weight's few-row matmul: ``self(x)`` is the packed weight's ``F.linear`` of the
    rows ``x`` (fp32), each with the bits a 64-row oneDNN call gives it."""

    packed: torch.Tensor  # holds the bytes ``address`` points at
    address: int
    out_features: int
    order: Order
    call: Callable[..., int]  # the typed sess_few_rows (sess.engine.native.kernels)

    @classmethod
    def of(cls, packed: torch.Tensor, out_features: int, in_features: int) -> FewRows | None:
        """The kernel over ``packed`` (a :func:`.onednn.pack_weight` copy), where it is built
        and matches oneDNN at this shape; else None."""
        lib, _ = native.library()
        if lib is None or not packed.is_mkldnn:
            return None
        found = order(in_features, out_features)
        if found is None or _nbytes(packed) != found.width * in_features * 4:
            return None
        return cls(packed, _address(packed), out_features, found, lib.sess_few_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1]).contiguous()
        out = flat.new_empty(rows, self.order.width)
        failed = self.call(
            *(flat, rows, flat.shape[1], self.address),
            *(self.order.width, self.order.tile, self.order.block, out, torch.get_num_threads()),
        )
        if failed:
            raise RuntimeError(f"few-row kernel: tile width {self.order.tile} not built")
        if self.order.width != self.out_features:  # the padded last tile's extra features go
            out = out[:, : self.out_features].contiguous()
        return out.view(*x.shape[:-1], self.out_features)


def status() -> str:
    """Whether the kernel runs on this machine and at how many of the shapes met so far it matches
    oneDNN (it is built on first use, not by asking)."""
    if not native.built():
        return "not built yet (built on the first matmul of one or two rows)"
    lib, how = native.library()
    if lib is None:
        return how + "; one- and two-row matmuls go through oneDNN"
    matched = sum(o is not None for o in _orders.values())
    return f"{how}; matches oneDNN at {matched} of {len(_orders)} shapes met"
