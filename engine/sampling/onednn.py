"""oneDNN's prepacked fp32 linear on CPU, as torch exposes it: the calls :mod:`.row_invariant`'s
matmuls and :mod:`.few_rows`' kernel share (the kernel reads the packed copies and is calibrated
against the 64-row call)."""

from __future__ import annotations

import functools

import torch

from sess.engine.libraries import torch_internals

CHUNK = 64  # the most rows one matmul call takes; more run as several calls


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's prepacked copy of a [out, in] weight, for :func:`linear`."""
    return torch_internals.onednn_pack_linear_weight(weight, CHUNK)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of ``x`` with a :func:`pack_weight` copy (and ``bias``), through oneDNN."""
    return _linear_pointwise()(x, packed, bias, "none", [], "")


@functools.cache
def _linear_pointwise():
    """The op's one overload, looked up once (a decode step makes ~120 calls), on first use: a
    torch build without it fails in :func:`available`, not on import."""
    return torch_internals.onednn_linear()


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (asked on first use, on the engine's
    own thread: a probe on the importing thread would start a second OpenMP team there)."""
    try:
        linear(torch.randn(2, 8), pack_weight(torch.randn(8, 8)), None)
        return torch.backends.mkldnn.is_available()
    except (AttributeError, RuntimeError):
        return False
