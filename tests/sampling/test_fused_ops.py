"""A decode step's attention, norms and activation as C calls (engine/sampling/fused_ops.py, fused_ops.c)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sess.engine.native import kernels as native
from sess.engine.sampling import fused_ops
from sess.engine.sampling.block_cache import BlockCache
from sess.engine.sampling.llama_decoder import _rotate
from sess.engine.sampling.prefill_layout import Layout
from sess.engine.sampling.row_invariant import BLOCK, decode_attention


def _built():
    lib, why = native.library()
    if lib is None:
        pytest.skip(f"the kernels are not built here: {why}")


def _step(rows: int, heads: int, kv_heads: int, dim: int, positions: list[int], blocks: int, seed: int = 0):
    """A cache layer of random entries and one step's q, k, v (split views, as the decoder's) and
    rotation for ``rows`` rows at ``positions``."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(blocks, rows, kv_heads, BLOCK, dim, generator=gen)
    values = torch.randn(blocks, rows, kv_heads, BLOCK, dim, generator=gen)
    q, k, v = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).split(
        [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1
    )
    cos, sin = torch.randn(rows, 1, dim, generator=gen), torch.randn(rows, 1, dim, generator=gen)
    rotation = (cos, sin, cos * dim**-0.5, sin * dim**-0.5)
    q, k, v = q.view(rows, heads, dim), k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim)
    return keys, values, torch.tensor(positions), q, k, v, rotation


def _torch_ops(keys, values, positions, q, k, v, rotation):
    """The same step as the decoder's torch ops: rotate, write the cache, blocked attention."""
    cache = BlockCache([keys], [values])
    step = cache.set_positions(positions)
    q, k = _rotate(q, k, *rotation)
    keys, values = cache.update(0, k, v)
    return decode_attention(q[:, :, None], keys, values, step.bias(k.shape[1])).view(q.shape), cache


def _kernel(keys, values, positions, q, k, v, rotation):
    return fused_ops.attend(keys, values, positions, q, k, v, rotation)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (8, 8, 32), (4, 1, 128)])
def test_the_kernel_writes_the_cache_as_the_torch_ops_and_attends_to_rounding(heads, kv_heads, dim):
    """The new keys are rotated into the cache to the bit (the same IEEE operations as torch's
    elementwise ops), values copied, and attention equals the torch ops' in float64 to float32
    rounding, at positions on both sides of a block's edge. (The reference is float64: the float32
    torch ops' first call in a process came out up to 5.8e-5 off in 6 processes of 80, their
    weights' exp up to 1.5e-4 off, and the same call exact after it.)"""
    _built()
    positions = [0, 5, 63, 64, 100, 127]
    keys, values, pos, q, k, v, rotation = _step(len(positions), heads, kv_heads, dim, positions, blocks=2)
    _, cache = _torch_ops(keys.clone(), values.clone(), pos, q, k, v, rotation)
    wide_keys, wide_values, wide_q, wide_k, wide_v = (t.double() for t in (keys, values, q, k, v))
    expected, _ = _torch_ops(
        wide_keys, wide_values, pos, wide_q, wide_k, wide_v, tuple(t.double() for t in rotation)
    )
    got = _kernel(keys, values, pos, q, k, v, rotation)
    assert torch.equal(keys, cache.keys[0]) and torch.equal(values, cache.values[0])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _hsum16(p: torch.Tensor) -> torch.Tensor:
    """fused_ops.c's hsum16 of each [..., 16]: lanes l + (l + 8), those + 4 apart, then
    (q0 + q2) + (q1 + q3)."""
    h = p[..., :8] + p[..., 8:]
    q = h[..., :4] + h[..., 4:]
    return (q[..., 0] + q[..., 2]) + (q[..., 1] + q[..., 3])


def _exp_neg16(x: torch.Tensor) -> torch.Tensor:
    """fused_ops.c's exp_neg16, op by op in float32."""
    below = x < -87.0
    x = torch.where(below, _f32(-87.0), x)
    shift = _f32(12582912.0)
    n = (x * _f32(1.44269504088896341) + shift) - shift
    r = x - n * _f32(0.693359375)
    r = r - n * _f32(-2.12194440e-4)
    z = r * r
    y = torch.full_like(x, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * r + _f32(c)
    y = y * z + r + _f32(1.0)
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(below, _f32(0.0), y * scale)


def _stated_attention(keys, values, positions, q, rotation) -> torch.Tensor:
    """Decode attention over a written cache layer as the comment atop fused_ops.c states its
    arithmetic, one float32 op at a time: each score a dot product in 16 lane sums over dim, then
    hsum16; the row's maximum subtracted, exp_neg16, the weights summed in 16 lane sums over
    columns (those past the row padded with exact zeros), then hsum16; weight * value added in
    column order, then divided by that sum."""
    _, _, q_cos, q_sin = rotation
    rows, heads, dim = q.shape
    kv_heads = keys.shape[2]
    groups = heads // kv_heads
    queries = q * q_cos + q.roll(dim // 2, dims=-1) * q_sin
    out = torch.empty(rows, heads, dim)
    for r in range(rows):
        n = int(positions[r]) + 1
        columns = torch.arange(n)
        row_keys = keys[columns // BLOCK, r, :, columns % BLOCK]  # [n, kv heads, dim]
        row_values = values[columns // BLOCK, r, :, columns % BLOCK]
        for head in range(heads):
            query, h = queries[r, head], head // groups
            p = query[:16] * row_keys[:, h, :16]
            for d in range(16, dim, 16):
                p = p + query[d : d + 16] * row_keys[:, h, d : d + 16]
            scores = _hsum16(p)
            weights = _exp_neg16(scores - scores.max())
            lanes = torch.zeros(16)
            for start in range(0, n, 16):
                chunk = weights[start : start + 16]
                lanes = lanes + torch.cat([chunk, torch.zeros(16 - chunk.shape[0])])
            acc = torch.zeros(dim)
            for c in range(n):
                acc = acc + weights[c] * row_values[c, h]
            out[r, head] = acc / _hsum16(lanes)
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 32), (5, 1, 64), (4, 2, 128), (3, 3, 48)])
def test_decode_attention_is_the_arithmetic_its_source_states_to_the_bit(heads, kv_heads, dim):
    """The kernel's attention equals, to the bit, a float32 re-statement of the order its source
    fixes (scores of several columns reduced together, values read once for several heads, the
    next row's entries fetched ahead: none of it may change a bit)."""
    _built()
    positions = [0, 7, 8, 63, 64, 100, 127]
    keys, values, pos, q, k, v, rotation = _step(
        len(positions), heads, kv_heads, dim, positions, blocks=2, seed=7
    )
    got = _kernel(keys, values, pos, q, k, v, rotation)  # writes the step's entries into the cache
    assert torch.equal(got, _stated_attention(keys, values, pos, q, rotation))


def test_a_row_gets_the_same_bits_alone_as_among_others_of_any_length():
    """Each row reads its own columns only: its result alone (in a cache just long enough) and in
    a batch of longer and shorter rows (in a larger cache) is the same to the bit."""
    _built()
    positions = [40, 3, 130, 64, 77]
    keys, values, pos, q, k, v, rotation = _step(len(positions), 9, 3, 64, positions, blocks=4, seed=1)
    together = _kernel(keys.clone(), values.clone(), pos, q, k, v, rotation)
    for row, position in enumerate(positions):
        blocks = position // BLOCK + 1
        alone = _kernel(
            keys[:blocks, row : row + 1].contiguous(),
            values[:blocks, row : row + 1].contiguous(),
            pos[row : row + 1],
            q[row : row + 1],
            k[row : row + 1],
            v[row : row + 1],
            tuple(t[row : row + 1] for t in rotation),
        )
        assert torch.equal(alone[0], together[row]), row


def test_a_prompts_samples_read_its_entries_from_one_row_with_the_same_bits():
    """Rows of one prompt hold its entries over its first columns; with ``shared`` each reads them
    from its prompt's first row: the same cache writes and the same bits as reading its own copy,
    and a row's own copy of the prompt's columns is not read at all."""
    _built()
    prompt, positions = 40, [41, 70, 45, 100, 66, 64]  # rows 0-2 one prompt, 3-4 another, 5 its own
    keys, values, pos, q, k, v, rotation = _step(len(positions), 9, 3, 64, positions, blocks=2, seed=2)
    for first, rows in ((0, [1, 2]), (3, [4])):  # the samples' copies of their prompt's columns
        keys[:, rows] = keys[:, first : first + 1]
        values[:, rows] = values[:, first : first + 1]
    sources = torch.tensor([0, 0, 0, 3, 3, 5])
    lengths = torch.tensor([prompt, prompt, prompt, 30, 30, 0])
    own = _kernel(keys.clone(), values.clone(), pos, q, k, v, rotation)
    shared_keys, shared_values = keys.clone(), values.clone()
    got = fused_ops.attend(shared_keys, shared_values, pos, q, k, v, rotation, (sources, lengths))
    assert torch.equal(got, own)
    written_keys, written_values = keys.clone(), values.clone()
    _kernel(written_keys, written_values, pos, q, k, v, rotation)
    assert torch.equal(shared_keys, written_keys) and torch.equal(shared_values, written_values)
    keys[0, 1, :, :prompt] = float("nan")  # row 1's copy of the prompt: never read with sharing
    values[0, 4, :, :30] = float("nan")
    assert torch.equal(fused_ops.attend(keys, values, pos, q, k, v, rotation, (sources, lengths)), own)
    with pytest.raises(ValueError, match="shared prefix"):  # past row 0's position (41)
        fused_ops.attend(keys, values, pos, q, k, v, rotation, (sources, torch.tensor([42] * 6)))
    with pytest.raises(ValueError, match="shared prefix"):
        fused_ops.attend(keys, values, pos, q, k, v, rotation, (sources + 1, lengths))
    with pytest.raises(ValueError, match="shared prefixes for"):
        fused_ops.attend(keys, values, pos, q, k, v, rotation, (sources[:3], lengths[:3]))


def test_rows_read_by_place_get_the_bits_of_a_compacted_cache_and_nothing_of_the_rows_that_left():
    """Rows that left the batch stay in the cache (:attr:`BlockCache.places`): the rows still in
    it write and attend where their entries are, with the same bits as in a cache holding only
    them, and the rows that left are never read; places out of the cache or out of order are
    refused."""
    _built()
    positions = [41, 70, 45, 100, 66, 64]  # held rows; rows 1 and 4 have left the batch
    keys, values, _, q, k, v, rotation = _step(len(positions), 9, 3, 64, positions, blocks=2, seed=3)
    places = torch.tensor([0, 2, 3, 5])
    pos = torch.tensor(positions)[places]
    q, k, v = q[places], k[places], v[places]
    rotation = tuple(t[places] for t in rotation)
    compact_keys, compact_values = keys[:, places].clone(), values[:, places].clone()
    expected = _kernel(compact_keys, compact_values, pos, q, k, v, rotation)
    keys[:, [1, 4]] = float("nan")  # the rows that left: never read
    values[:, [1, 4]] = float("nan")
    got = fused_ops.attend(keys, values, pos, q, k, v, rotation, places=places)
    assert torch.equal(got, expected)
    assert torch.equal(keys[:, places], compact_keys) and torch.equal(values[:, places], compact_values)
    sources, lengths = torch.tensor([0, 0, 2, 3]), torch.tensor([0, 30, 0, 0])  # rows 0, 1 one prompt
    keys[:, 2, :, :30], values[:, 2, :, :30] = keys[:, 0, :, :30], values[:, 0, :, :30]
    own = fused_ops.attend(keys.clone(), values.clone(), pos, q, k, v, rotation, places=places)
    shared = fused_ops.attend(keys, values, pos, q, k, v, rotation, (sources, lengths), places)
    assert torch.equal(shared, own)
    for bad in ([0, 2, 3, 6], [0, 3, 2, 5], [0, 2, 2, 5]):
        with pytest.raises(ValueError, match="cache places"):
            fused_ops.attend(keys, values, pos, q, k, v, rotation, places=torch.tensor(bad))
    with pytest.raises(ValueError, match="cache layer"):  # without places every held row is a row
        fused_ops.attend(keys, values, pos, q, k, v, rotation)


def test_a_prompts_samples_read_its_entries_from_its_first_row_and_the_next_one_when_that_leaves():
    """A cache the kernel reads by place holds a prompt's entries in its first row only, the
    others' columns left unwritten (here NaN, so a read of them shows): each row attends with the
    bits of a cache where every row holds its own copy, before and after each prompt's first row
    leaves the batch (the next one that stays gets the entries), and after a compaction."""
    _built()
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, dim = 9, 3, 64
    keys, values = (torch.randn(10, kv_heads, dim, generator=gen) for _ in range(2))  # prompts of 6 and 4
    spans, lengths = [(0, 6, 3), (6, 4, 3)], [6, 6, 6, 4, 4, 4]
    own = BlockCache.from_prompts([keys.clone()], [values.clone()], spans, BLOCK + 8)
    read = BlockCache.from_prompts([keys.clone()], [values.clone()], spans, BLOCK + 8, by_place=True)
    for entries in (read.keys[0], read.values[0]):
        for row, length in enumerate(lengths):
            entries[0, row, :, 0 if row not in (0, 3) else length :] = float("nan")
        entries[1:] = float("nan")

    def attends(rows: list[int], seed: int) -> None:
        _, _, _, q, k, v, rotation = _step(
            len(rows), heads, kv_heads, dim, [0] * len(rows), blocks=1, seed=seed
        )
        pos = torch.tensor([lengths[row] for row in rows])  # each row's first step after its prompt
        expected = fused_ops.attend(*own.layer(0), pos, q, k, v, rotation)
        got = fused_ops.attend(*read.layer(0), pos, q, k, v, rotation, read.sharing(), read.places)
        assert torch.equal(got, expected)

    attends([0, 1, 2, 3, 4, 5], seed=1)
    for cache in (own, read):  # each prompt's first row leaves: 4 of 6 stay, in place where read by place
        cache.keep(torch.tensor([1, 2, 4, 5]), width=8)
    assert read.places.tolist() == [1, 2, 4, 5] and [t.tolist() for t in read.sharing()] == [
        [0, 0, 2, 2],
        [6, 6, 4, 4],
    ]
    attends([1, 2, 4, 5], seed=2)
    for cache in (own, read):  # 2 of 6 held rows stay: compacted
        cache.keep(torch.tensor([1, 3]), width=8)
    assert read.places is None
    attends([2, 5], seed=3)


def _prefill(prompts: dict[tuple[int, ...], torch.Tensor], share: bool, heads: int = 9, kv_heads: int = 3):
    """Each prompt's prefill attention from one :func:`fused_ops.prefill_attend` call over the
    tokens a :class:`Layout` of ``prompts`` computes ({token ids: its tokens' q, k, v rows
    [n, heads + 2 kv_heads, dim]}, rows equal where the ids are), and the layout."""
    jobs = [SimpleNamespace(prompt=list(ids), adapter="a") for ids in prompts]
    layout = Layout.of(jobs, share)
    dim = next(iter(prompts.values())).shape[-1]
    rows = torch.empty(len(layout.tokens), heads + 2 * kv_heads, dim)
    spans, start = [], 0
    for ids, qkv in prompts.items():
        spans.append(torch.tensor(layout.order[start : start + len(ids)]))
        rows[spans[-1]] = qkv  # a shared prefix's rows written by each prompt: the same values
        start += len(ids)
    q, k, v = rows.split([heads, kv_heads, kv_heads], dim=1)
    gen = torch.Generator().manual_seed(5)
    angles = torch.rand(max(layout.positions) + 1, 1, dim, generator=gen)[layout.positions]
    columns = tuple(torch.tensor(x) for x in (layout.positions, layout.splits, layout.lows, layout.highs))
    out = fused_ops.prefill_attend(k, v, q, angles.cos() * dim**-0.5, angles.sin() * dim**-0.5, columns)
    return [out[span] for span in spans], layout


def test_the_prefill_kernel_attends_as_causal_attention_to_rounding():
    """Each prompt token over its prompt's columns up to it: as torch's causal attention over the
    queries rotated and the keys given (already rotated), grouped query heads included."""
    _built()
    gen = torch.Generator().manual_seed(3)
    prompts = {
        tuple(range(i * 100, i * 100 + n)): torch.randn(n, 15, 64, generator=gen)
        for i, n in enumerate((7, 70))
    }
    got, _ = _prefill(prompts, share=True)
    for out, qkv in zip(got, prompts.values()):
        q, k, v = qkv.split([9, 3, 3], dim=1)
        angles = torch.rand(len(qkv), 1, 64, generator=torch.Generator().manual_seed(5))
        q = _rotate(q, q, angles.cos(), angles.sin(), angles.cos(), angles.sin())[0]
        expected = F.scaled_dot_product_attention(
            *(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, enable_gqa=True
        )[0].transpose(0, 1)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_prompts_prefill_has_the_same_bits_alone_beside_others_and_on_a_shared_prefix():
    """Prompts that begin with the same 30 tokens: prefilled together the prefix is computed once
    (each keeps at least its last token, so one of 31 tokens shares 30), and every prompt's
    attention is the same to the bit as prefilled alone or beside the others unshared."""
    _built()
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randn(30, 15, 64, generator=gen)
    prompts = {
        tuple([7] * 30 + [100 + i] * n): torch.cat([prefix, torch.randn(n, 15, 64, generator=gen)])
        for i, n in enumerate((5, 9, 1))
    }
    together, layout = _prefill(prompts, share=True)
    assert layout.shared and len(layout.tokens) == 30 + 5 + 9 + 1
    unshared, layout = _prefill(prompts, share=False)
    assert not layout.shared and len(layout.tokens) == 35 + 39 + 31
    for i, (ids, qkv) in enumerate(prompts.items()):
        (alone,), _ = _prefill({ids: qkv}, share=True)
        assert torch.equal(alone, together[i]) and torch.equal(alone, unshared[i]), i


def test_a_prefill_token_has_the_same_bits_whatever_tokens_share_its_tile():
    """The kernel attends consecutive tokens a few at a time (each key read once for them): a
    token's bits are those it gets as its prompt's last token, alone in its tile, at every place
    in a tile and for head sizes 64 and 128."""
    _built()
    for dim in (64, 128):
        gen = torch.Generator().manual_seed(6)
        qkv = torch.randn(23, 15, dim, generator=gen)
        (whole,), _ = _prefill({tuple(range(23)): qkv}, share=False)
        for n in range(1, 24):
            (part,), _ = _prefill({tuple(range(n)): qkv[:n]}, share=False)
            assert torch.equal(part, whole[:n]), (dim, n)


def test_a_prefill_reading_outside_its_tokens_is_refused():
    _built()
    q, k, v = torch.randn(4, 15, 64).split([9, 3, 3], dim=1)
    rotation = torch.ones(4, 1, 64), torch.zeros(4, 1, 64)
    columns = [torch.tensor(x) for x in ([0, 1, 2, 3], [0] * 4, [0] * 4, [0] * 4)]
    fused_ops.prefill_attend(k, v, q, *rotation, tuple(columns))
    for which, bad in ((0, [0, 1, 2, 4]), (3, [0, 0, 0, 1]), (1, [0, 0, 0, 5]), (0, [0, 1, -1, 3])):
        wrong = list(columns)
        wrong[which] = torch.tensor(bad)
        with pytest.raises(ValueError, match="outside"):
            fused_ops.prefill_attend(k, v, q, *rotation, tuple(wrong))


def test_the_cache_knows_which_rows_share_a_prompt_as_rows_leave_and_join():
    entries = [torch.randn(10, 3, 64)]  # a prefill of prompts of 6 and 4 tokens
    cache = BlockCache.from_prompts(list(entries), [e.clone() for e in entries], [(0, 6, 3), (6, 4, 2)], 16)
    sources, lengths = cache.sharing()
    assert sources.tolist() == [0, 0, 0, 3, 3] and lengths.tolist() == [6, 6, 6, 4, 4]
    cache.keep(torch.tensor([1, 2, 4]), width=20)  # a prompt's first row left: the next one is read
    assert [t.tolist() for t in cache.sharing()] == [[0, 0, 2], [6, 6, 4]]
    other = [torch.randn(4, 3, 64)]
    cache.append(BlockCache.from_prompts(list(other), [e.clone() for e in other], [(0, 4, 2)], 16))
    assert [t.tolist() for t in cache.sharing()] == [[0, 0, 2, 3, 3], [6, 6, 4, 4, 4]]
    own = BlockCache([torch.zeros(1, 2, 3, BLOCK, 64)], [torch.zeros(1, 2, 3, BLOCK, 64)])
    assert [t.tolist() for t in own.sharing()] == [[0, 1], [0, 0]]  # rows of their own


def test_shapes_and_caches_it_does_not_cover_are_refused():
    _built()
    assert fused_ops.usable(torch.float32, "cpu") and fused_ops.covers_attention(9, 3, 64)
    assert not fused_ops.covers_attention(4, 2, 8)  # head dim < 16
    assert not fused_ops.covers_attention(9, 2, 64)  # heads % kv heads
    assert not fused_ops.usable(torch.bfloat16, "cpu")
    assert not fused_ops.usable(torch.float32, torch.device("meta"))
    keys, values, pos, q, k, v, rotation = _step(3, 9, 3, 64, [1, 2, 3], blocks=1)
    with pytest.raises(ValueError, match="cache layer"):
        _kernel(keys[:, :2].contiguous(), values[:, :2].contiguous(), pos, q, k, v, rotation)
    with pytest.raises(ValueError, match="outside the cache"):  # one block: columns 0..63
        _kernel(keys, values, torch.tensor([1, 64, 3]), q, k, v, rotation)
    with pytest.raises(ValueError, match="outside the cache"):
        _kernel(keys, values, torch.tensor([-1, 2, 3]), q, k, v, rotation)


def test_without_the_kernels_the_decoder_keeps_the_torch_ops_and_says_so(monkeypatch):
    why = "not built: no C compiler (cc or $CC)"
    monkeypatch.setattr(native, "library", functools.cache(lambda: (None, why)))
    assert not fused_ops.usable(torch.float32, "cpu")
    assert fused_ops.status() == why + "; attention, norms and activations run as torch ops"
    with pytest.raises(RuntimeError, match="no C compiler"):
        _kernel(*_step(1, 9, 3, 64, [1], blocks=1))


@pytest.mark.parametrize("n", [576, 64, 50])
def test_the_norm_adds_the_residual_to_the_bit_and_norms_each_row_on_its_own(n):
    """``h + residual`` is torch's add to the bit; the norm equals F.rms_norm to rounding, and a
    row's bits are the same alone as among others (rows strided, as a split's views are)."""
    _built()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 2 * n, generator=gen)[:, :n]  # strided rows
    residual, weight = torch.randn(7, n, generator=gen), torch.randn(n, generator=gen)
    total, normed = fused_ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(normed, F.rms_norm(x + residual, (n,), weight, 1e-5), rtol=1e-5, atol=1e-5)
    same, plain = fused_ops.rms_norm(x, weight, 1e-5)
    assert same is x
    torch.testing.assert_close(plain, F.rms_norm(x, (n,), weight, 1e-5), rtol=1e-5, atol=1e-5)
    for row in range(7):
        alone = fused_ops.rms_norm(x[row : row + 1], weight, 1e-5, residual[row : row + 1])[1]
        assert torch.equal(alone[0], normed[row]), row


def test_the_activation_is_silu_times_up_to_rounding_over_the_whole_range():
    _built()
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(5, 2 * 300, generator=gen) * 20
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30])
    gate, up = gate_up.split(300, dim=-1)
    got = fused_ops.silu_mul(gate, up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-30)
    assert torch.equal(fused_ops.silu_mul(gate[2:3], up[2:3])[0], got[2])


def test_outputs_written_into_given_blocks_have_the_bits_of_new_ones():
    """The norm, activation and attention write into blocks a pass reuses layer after layer
    (:class:`fused_ops.Blocks`) with the bits they give in new ones; the residual stream alternates
    between two blocks, never the norm's own input; a block of another shape is refused."""
    _built()
    gen = torch.Generator().manual_seed(5)
    x, residual = torch.randn(6, 96, generator=gen), torch.randn(6, 96, generator=gen)
    norm = torch.nn.RMSNorm(96, eps=1e-5)
    torch.nn.init.normal_(norm.weight, generator=gen)
    norm.variance_epsilon = norm.eps
    blocks = fused_ops.Blocks()
    expected = fused_ops.rms_norm(x, norm.weight, 1e-5, residual)
    total, normed = blocks.norm(norm, x, residual)
    assert torch.equal(total, expected[0]) and torch.equal(normed, expected[1])
    again, normed_again = blocks.norm(norm, total, residual)  # the next layer's: total is its input
    assert again.data_ptr() != total.data_ptr() and normed_again.data_ptr() == normed.data_ptr()
    assert torch.equal(again, expected[0] + residual)
    third, _ = blocks.norm(norm, again, residual)
    assert third.data_ptr() == total.data_ptr()  # two blocks in turn
    first, plain = blocks.norm(norm, x, None)
    assert first is x and torch.equal(plain, fused_ops.rms_norm(x, norm.weight, 1e-5)[1])

    gate, up = (torch.randn(6, 2 * 50, generator=gen) * 5).split(50, dim=-1)
    act = blocks.block("act", gate, 6, 50)
    assert fused_ops.silu_mul(gate, up, act) is act
    assert torch.equal(act, fused_ops.silu_mul(gate, up))

    keys, values, pos, q, k, v, rotation = _step(3, 9, 3, 64, [4, 70, 127], blocks=2, seed=6)
    fresh = fused_ops.attend(keys.clone(), values.clone(), pos, q, k, v, rotation)
    out = blocks.block("attention", q, *q.shape)
    assert fused_ops.attend(keys, values, pos, q, k, v, rotation, out=out) is out
    assert torch.equal(out, fresh)
    with pytest.raises(ValueError, match="output block"):
        fused_ops.silu_mul(gate, up, torch.empty(6, 49))
    with pytest.raises(ValueError, match="output block"):
        fused_ops.rms_norm(x, norm.weight, 1e-5, residual, (torch.empty(96, 6).t(), None))


@pytest.mark.parametrize("vocab", [49152, 3000, 7])
def test_the_draw_picks_what_the_torch_inverse_cdf_picks_and_each_row_alone_the_same(vocab):
    """The C draw follows token_choice.inverse_cdf (softmax of logits / temperature, tiles of 256,
    float64 running sums): the same tokens but where rounding puts u at a boundary (its weights
    are its own exp, not torch's), and a row's token is the same alone as among others. The
    logprob it gives with each token is the model's own (temperature 1) to 1e-6 of a float64
    log-softmax, the bits ``fused_ops.logprobs`` gives for that token, and a row's alone too."""
    _built()
    from sess.engine.sampling.token_choice import inverse_cdf

    gen = torch.Generator().manual_seed(5)
    rows = 48
    logits = torch.randn(rows, vocab, generator=gen) * 4
    temperature = torch.tensor([0.3, 0.7, 1.0, 1.5] * (rows // 4))
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    got, logprobs = fused_ops.draw(logits, temperature, u)
    expected = inverse_cdf((logits / temperature[:, None]).softmax(dim=-1), u)
    assert (got == expected).sum() >= rows - 1, (got, expected)
    assert ((got >= 0) & (got < vocab)).all()
    exact = logits.double().log_softmax(-1).gather(-1, got[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.double(), exact, rtol=0, atol=1e-6)
    assert torch.equal(fused_ops.logprobs(logits, got), logprobs)
    for row in range(0, rows, 7):
        one = slice(row, row + 1)
        token, logprob = fused_ops.draw(logits[one], temperature[one], u[one])
        assert (token.item(), logprob.item()) == (got[row].item(), logprobs[row].item())


def test_logprobs_refuse_a_token_outside_the_vocabulary_and_leave_a_nan_row_nan():
    """A token id past the vocabulary (or negative) is refused before any row is read; a row with
    a NaN logit (a model gone wrong) gets a NaN logprob, as from torch's log_softmax, not a number."""
    _built()
    logits = torch.randn(3, 300)
    for bad in (300, -1):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            fused_ops.logprobs(logits, torch.tensor([0, bad, 2]))
    logits[1, 7] = float("nan")
    got = fused_ops.logprobs(logits, torch.tensor([0, 1, 2]))
    assert got[1].isnan() and not got[[0, 2]].isnan().any()
    _, drawn = fused_ops.draw(
        logits, torch.tensor([1.0, 0.7, 1.0]), torch.full((3,), 0.5, dtype=torch.float64)
    )
    assert drawn[1].isnan() and not drawn[[0, 2]].isnan().any()


def test_builds_for_older_cpus_give_the_same_bits(monkeypatch):
    """Every operation in fused_ops.c is IEEE arithmetic in an order the source fixes (no fused
    multiply-adds, no library exp), so the kernels built for an AVX2 or an SSE4 CPU give exactly
    what the build for this one gives: a run's attention, norms, activation, draws and logprobs are the same
    bits on every x86-64 host (its matmuls are calibrated per host)."""
    import platform
    import shutil

    _built()
    compiler = shutil.which("cc")
    if platform.machine() != "x86_64" or compiler is None:
        pytest.skip("x86-64 -march levels")

    def outputs():
        gen = torch.Generator().manual_seed(6)
        keys, values, pos, q, k, v, rotation = _step(5, 9, 3, 64, [0, 17, 63, 64, 120], blocks=2, seed=6)
        x, weight = torch.randn(7, 576, generator=gen), torch.randn(576, generator=gen)
        logits = torch.randn(16, 49152, generator=gen) * 3
        u = torch.rand(16, generator=gen, dtype=torch.float64)
        return (
            _kernel(keys, values, pos, q, k, v, rotation),
            fused_ops.rms_norm(x, weight, 1e-5, x * 0.5)[1],
            fused_ops.silu_mul(x * 10, x),
            *fused_ops.draw(logits, torch.full((16,), 0.7), u),
            fused_ops.logprobs(logits, logits.argmax(-1)),
        )

    reference = outputs()
    for arch in ("x86-64-v3", "x86-64-v2"):
        lib, how = native.load(arch)
        assert lib is not None, how
        monkeypatch.setattr(native, "library", functools.cache(lambda lib=lib, arch=arch: (lib, arch)))
        for got, expected in zip(outputs(), reference):
            assert torch.equal(got, expected), arch
