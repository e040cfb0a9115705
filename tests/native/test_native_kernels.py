"""The kernels' typed boundary (engine/native/kernels.py, kernels.h): every kernel's C types read
from the one header, and a call with a wrong dtype, rank, layout or value raises a Python error
naming the kernel and the argument, instead of handing C a pointer it misreads."""

from __future__ import annotations

import ctypes

import pytest
import torch

from sess.engine.native import kernels
from sess.engine.sampling import fused_ops


def _lib():
    lib, why = kernels.library()
    if lib is None:
        pytest.skip(f"the kernels are not built here: {why}")
    return lib


def test_the_header_declares_every_kernel_with_exact_widths():
    declared = kernels.declarations()
    assert set(declared) == set(kernels.TENSORS)
    attention = dict(declared["sess_decode_attention"])
    assert len(attention) == 24
    assert attention["q_stride"] == attention["held"] == attention["columns"] == "int64_t"
    assert attention["positions"] == "int64_t *" and attention["rows"] == "int"
    assert dict(declared["sess_rms_norm"])["eps"] == "float"
    lib = _lib()
    argtypes = lib.sess_decode_attention.c_function.argtypes
    assert argtypes[1] is ctypes.c_int64 and argtypes[18] is ctypes.c_int


def test_a_header_and_table_that_disagree_fail_loudly(tmp_path, monkeypatch):
    header = tmp_path / "kernels.h"
    text = kernels.HEADERS[0].read_text().replace("const float *gate", "const float *gates")
    header.write_text(text)
    monkeypatch.setattr(kernels, "HEADERS", (header,))
    kernels.declarations.cache_clear()
    try:
        with pytest.raises(TypeError, match="sess_silu_mul's pointers"):
            kernels.declarations()
    finally:
        monkeypatch.undo()
        kernels.declarations.cache_clear()


def test_a_wrong_dtype_rank_layout_or_value_names_the_argument():
    lib = _lib()
    gate, up, out = torch.randn(3, 40), torch.randn(3, 40), torch.empty(3, 40)
    assert lib.sess_silu_mul(gate, 40, up, 40, 3, 40, out, 1) == 0
    with pytest.raises(
        ValueError, match=r"sess_silu_mul: argument 'gate' must be a rows torch.float32 tensor"
    ):
        lib.sess_silu_mul(gate.double(), 40, up, 40, 3, 40, out, 1)
    with pytest.raises(ValueError, match=r"argument 'out' must be a dense torch.float32 tensor of rank 2"):
        lib.sess_silu_mul(gate, 40, up, 40, 3, 40, out.view(-1), 1)
    with pytest.raises(ValueError, match=r"argument 'out' must be a dense"):
        lib.sess_silu_mul(gate, 40, up, 40, 3, 40, out.t(), 1)
    with pytest.raises(ValueError, match=r"argument 'up' must be a rows"):
        lib.sess_silu_mul(gate, 40, torch.randn(40, 3).t(), 40, 3, 40, out, 1)
    with pytest.raises(TypeError, match=r"argument 'up' must be a tensor, not int"):
        lib.sess_silu_mul(gate, 40, up.data_ptr(), 40, 3, 40, out, 1)
    with pytest.raises(TypeError, match=r"sess_silu_mul: argument 'rows'"):
        lib.sess_silu_mul(gate, 40, up, 40, "3", 40, out, 1)
    with pytest.raises(ValueError, match=r"sess_logprobs: argument 'tokens' must be a dense torch.int64"):
        lib.sess_logprobs(gate, 40, 3, 40, torch.zeros(3, dtype=torch.int32), torch.empty(3), 1)


def test_the_samplers_calls_pass_the_boundary_and_a_wrong_dtype_is_refused_there():
    _lib()
    logits = torch.randn(4, 300)
    got = fused_ops.logprobs(logits, torch.tensor([0, 5, 299, 7]))
    assert torch.allclose(got, logits.log_softmax(-1)[torch.arange(4), [0, 5, 299, 7]], atol=1e-5)
    with pytest.raises(ValueError, match=r"sess_logprobs: argument 'logits' must be a rows torch.float32"):
        fused_ops.logprobs(logits.double(), torch.tensor([0, 5, 299, 7]))
    x, weight = torch.randn(2, 64), torch.randn(64)
    with pytest.raises(ValueError, match=r"sess_rms_norm: argument 'weight' must be a dense torch.float32"):
        fused_ops.rms_norm(x, weight.half(), 1e-5)
    _, normed = fused_ops.rms_norm(x, weight, 1e-5)  # an optional residual left out: None passes
    assert torch.allclose(normed, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight, atol=1e-5)
