"""The few-row matmul kernel: one and two rows get the bits oneDNN's 64-row call gives them, and
where the kernel cannot be built or does not match, the rows go through oneDNN with the same bits."""

import functools

import pytest
import torch

from sess.engine.native import kernels as native
from sess.engine.sampling import few_rows, onednn
from sess.engine.sampling.onednn import CHUNK
from sess.engine.sampling.row_invariant import PackedMatmul, RowInvariantLinears

pytestmark = pytest.mark.skipif(not onednn.available(), reason="no oneDNN in this torch build")

# (out, in): a hidden size each way, a LoRA-rank-sized output whose packed tile is padded, and an
# output that is not a multiple of any tile width
SHAPES = [(96, 576), (576, 1536), (24, 64), (100, 64)]


def _reference(matmul: PackedMatmul, x: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` as oneDNN gives them in a call of CHUNK rows (the rest random)."""
    full = torch.cat([x, torch.randn(CHUNK - x.shape[0], x.shape[1])])
    return onednn.linear(full, matmul.weight, None)[: x.shape[0]]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_one_and_two_rows_get_the_bits_of_a_64_row_call(out_features, in_features):
    torch.manual_seed(out_features + in_features)
    matmul = PackedMatmul.of(torch.randn(out_features, in_features))
    assert matmul is not None
    if native.library()[0] is None:
        pytest.skip(f"the kernel is not built here: {native.library()[1]}")
    if matmul.few is None:
        pytest.skip(f"oneDNN's order at {in_features}->{out_features} on this CPU is not one the kernel knows")
    for rows in (1, 2):
        x = torch.randn(rows, in_features)
        got = matmul(x)
        assert got.shape == (rows, out_features)
        assert torch.equal(got, _reference(matmul, x))
        assert torch.equal(got, matmul.few(x))  # and it was the kernel that gave them
    x = torch.randn(1, 1, in_features)  # leading dimensions kept
    assert torch.equal(matmul(x), _reference(matmul, x[0]).view(1, 1, out_features))


def test_the_lean_decoders_linears_use_it_without_bias_and_keep_their_bits():
    torch.manual_seed(0)
    weight, biased_weight, bias = torch.randn(96, 576), torch.randn(96, 576), torch.randn(96)
    linears = RowInvariantLinears()
    x = torch.randn(2, 576)
    plain = linears(x, weight)
    copy = next(iter(linears._packed.values()))
    if native.library()[0] is not None and few_rows.order(576, 96) is not None:
        assert copy.few is not None and torch.equal(plain, copy.few(x))
    full = torch.cat([x, torch.randn(CHUNK - 2, 576)])
    assert torch.equal(plain, linears(full, weight)[:2])  # alone or among 63 others: the same bits
    biased = linears(x, biased_weight, bias)
    assert linears._packed[id(biased_weight)].few is None  # with a bias: oneDNN
    assert torch.equal(biased, linears(full, biased_weight, bias)[:2])


def test_without_a_compiler_the_build_says_why_and_the_rows_go_through_onednn(monkeypatch, tmp_path):
    monkeypatch.setenv("SESS_KERNEL_CACHE", str(tmp_path / "cache"))  # nothing built there yet
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    lib, why = native.library.__wrapped__()
    assert lib is None and why.startswith("not built: false failed")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SESS_KERNEL_CACHE", str(tmp_path / "file" / "cache"))  # nowhere to build
    monkeypatch.setenv("CC", "cc")
    lib, why = native.library.__wrapped__()
    assert lib is None and why.startswith("not built: ") and str(tmp_path / "file") in why
    monkeypatch.setenv("CC", "/nonexistent/cc")
    lib, why = native.library.__wrapped__()
    assert lib is None and "no C compiler" in why

    torch.manual_seed(1)
    weight, x = torch.randn(96, 576), torch.randn(1, 576)
    with_kernel = PackedMatmul.of(weight)(x)
    monkeypatch.setattr(native, "library", functools.cache(lambda: (None, why)))
    fallback = PackedMatmul.of(weight)
    assert fallback.few is None
    assert torch.equal(fallback(x), with_kernel)
    assert few_rows.status() == why + "; one- and two-row matmuls go through oneDNN"


def test_a_shape_whose_layout_the_kernel_does_not_know_keeps_onednn(monkeypatch):
    """Calibration compares the packed bytes with the weight before it trusts a layout: where none
    matches (as on a CPU whose oneDNN packs otherwise), the shape has no order and no kernel."""
    monkeypatch.setattr(few_rows, "_orders", {})
    monkeypatch.setattr(few_rows, "_laid_out", lambda packed, weight, tile: False)
    torch.manual_seed(2)
    matmul = PackedMatmul.of(torch.randn(96, 576))
    assert matmul.few is None and few_rows.order(576, 96) is None
    x = torch.randn(1, 576)
    assert torch.equal(matmul(x), _reference(matmul, x))
    if native.library()[0] is not None:
        assert "matches oneDNN at 0 of 1 shapes met" in few_rows.status()
