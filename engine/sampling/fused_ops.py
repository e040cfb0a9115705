"""A decode step's work besides its matmuls as C calls: attention, norms, the MLP's activation, token choice.

The lean decoder's step as torch ops is ~700 small ops at 64 rows on smollm2 besides its matmuls:
attention over the :class:`~.block_cache.BlockCache` (:func:`~.row_invariant.decode_attention`,
~20 ops a layer reading every row's cache up to the batch's longest), RMS norms of ~100 µs each,
the residual adds and ``silu(gate) * up``. ``fused_ops.c`` does each in one call over all rows:

* :func:`attend`: rotates each row's new key into its cache slot, writes its value, rotates the
  queries (scaled) and attends over the row's own columns only (the samples of a prompt read its
  columns from one row's copy: fetched from memory once, the same bits);
* :func:`prefill_attend`: a prefill's attention by the same code, each prompt token over its
  prompt's columns up to it (a prefix shared by several prompts is computed once and read by all);
* :func:`rms_norm`: the residual add and the norm after it;
* :func:`silu_mul`: the MLP's activation times its up projection;
* :func:`draw`: a sampled row's token (temperature, no top-k or top-p), by the inverse CDF of
  :func:`.token_choice.inverse_cdf` in two passes over the logits instead of ~8 ops, with its
  logprob from the same passes (torch's log_softmax would write all [rows, vocab] of its result
  to read one entry a row);
* :func:`logprobs`: that logprob for given tokens (rows the draw does not take).

Every sum runs in an order fixed by the code and the row's data (see the C file), so a row's
result does not depend on its batch, as with the torch ops, nor on the CPU's vector width (the
kernels built for AVX-512, AVX2 and SSE4 give the same bits); the results differ from the torch
ops' only in rounding. An engine uses one or the other for its whole life (the decoder decides on
first use), so its requests replay to the bit either way. Used for fp32 on CPU where
:mod:`sess.engine.native.kernels` built the kernels; attention where the shape is one the kernel covers (head dim a
multiple of 16 up to 256, at most 16 query heads a key/value head).
"""

from __future__ import annotations

import torch

from sess.engine.native import kernels as native
from sess.engine.sampling.row_invariant import BLOCK

LANES, WIDEST, MOST_GROUPS = 16, 256, 16  # fused_ops.c's limits for attention


def usable(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the kernels run for a model in ``dtype`` on ``device`` here (built on first use)."""
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        return False
    return native.library()[0] is not None


def covers_attention(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the attention kernel is built for this many heads of this size."""
    groups_ok = kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= MOST_GROUPS
    return groups_ok and head_dim % LANES == 0 and head_dim <= WIDEST


def attend(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rotation: tuple[torch.Tensor, ...],
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    places: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write each row's ``key`` (rotated) and ``value`` [rows, kv heads, dim] into the cache layer
    ``keys``/``values`` [blocks, held rows, kv heads, BLOCK, dim] at ``positions`` [rows], and
    return the attention [rows, heads, dim] of ``query`` [rows, heads, dim] (rotated, scaled) over
    each row's columns up to its position. ``rotation`` is ``(cos, sin, q_cos, q_sin)`` [rows, 1,
    dim] (``sin`` with rotate_half's signs; the queries' carry their scaling). ``shared``, int64
    ``(sources, lengths)`` [rows] (:meth:`.BlockCache.sharing`): row ``r`` reads its first
    ``lengths[r]`` columns from row ``sources[r]``, whose entries there are the same (a prompt's
    samples): read from memory once for them all, the same bits. ``places``, int64 [rows]
    ascending (:attr:`.BlockCache.places`): the cache row that holds each row's entries (None: row
    ``r`` in cache row ``r``, every cache row a row's). ``out``: a dense block to write the result
    into (:class:`Blocks`), else a new one."""
    lib = _lib()
    rows, heads, dim = query.shape
    kv_heads = key.shape[1]
    held = keys.shape[1] if places is not None else rows
    layer = (held, kv_heads, BLOCK, dim)
    if not (keys.is_contiguous() and values.is_contiguous()) or keys.shape[1:] != layer:
        raise ValueError(
            f"decode attention kernel: a cache layer of shape {tuple(keys.shape)} for {rows} rows"
        )
    query, key, value = (_rows_dense(t) for t in (query, key, value))
    cos, sin, q_cos, q_sin = (t.contiguous() for t in rotation)
    positions = _int64(positions)
    out = _into(out, query, (rows, heads, dim))
    if shared is not None:
        sources, lengths = (_int64(t) for t in shared)
        if sources.shape != (rows,) or lengths.shape != (rows,):
            raise ValueError(
                f"decode attention kernel: shared prefixes for {tuple(sources.shape)} rows, not {rows}"
            )
    if places is not None:
        places = _int64(places)
        if places.shape != (rows,):
            raise ValueError(
                f"decode attention kernel: cache places for {tuple(places.shape)} rows, not {rows}"
            )
    check(
        lib.sess_decode_attention(
            *(query, query.stride(0), key, key.stride(0), value, value.stride(0), cos, sin, q_cos, q_sin),
            *(keys, values, positions, *((sources, lengths) if shared is not None else (None, None))),
            *(places, held, keys.shape[0] * BLOCK, rows, heads, kv_heads, dim, out, torch.get_num_threads()),
        ),
        "decode attention",
    )
    return out


def prefill_attend(
    keys: torch.Tensor,
    values: torch.Tensor,
    query: torch.Tensor,
    q_cos: torch.Tensor,
    q_sin: torch.Tensor,
    columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """The attention [tokens, heads, dim] of a prefill's ``query`` [tokens, heads, dim] (rotated by
    ``q_cos``, ``q_sin`` [tokens, 1, dim], which carry the scaling) over ``keys`` (rotated) and
    ``values`` [tokens, kv heads, dim], the tokens the prefill computes. ``columns``, int64
    ``(positions, splits, lows, highs)`` [tokens]: token ``t`` attends over its prompt's columns
    ``0..positions[t]``, column ``c`` being token ``lows[t] + c`` below ``splits[t]`` (a prefix
    shared with other prompts) and ``highs[t] + c`` from there on."""
    lib = _lib()
    tokens, heads, dim = query.shape
    query = _rows_dense(query)
    keys, values, q_cos, q_sin = (t.contiguous() for t in (keys, values, q_cos, q_sin))
    positions, splits, lows, highs = (_int64(t) for t in columns)
    if any(t.shape != (tokens,) for t in (positions, splits, lows, highs)) or keys.shape[0] != tokens:
        raise ValueError(
            f"prefill attention kernel: columns for {tuple(positions.shape)} tokens, not {tokens}"
        )
    out = query.new_empty(tokens, heads, dim)
    check(
        lib.sess_prefill_attention(
            *(query, query.stride(0), q_cos, q_sin, keys, values, positions, splits, lows, highs),
            *(tokens, heads, keys.shape[1], dim, out, torch.get_num_threads()),
        ),
        "prefill attention",
    )
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    into: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, normed)``: ``h = x + residual`` (``x`` itself without one) and its RMS norm with
    ``weight``, for ``x`` [rows, n] (rows may be strided); written into the dense blocks ``into``
    (for ``h``, ``normed``; None: a new one), which must not overlap ``x`` or ``residual``."""
    lib = _lib()
    rows, n = x.shape
    x = _last_dense(x)
    weight = weight.contiguous()
    out = _into(into[1], x, (rows, n))
    total = _into(into[0], x, (rows, n)) if residual is not None else x
    if residual is not None:
        residual = _last_dense(residual)
    check(
        lib.sess_rms_norm(
            *(x, x.stride(0), *((residual, residual.stride(0)) if residual is not None else (None, 0))),
            *(weight, eps, rows, n, total if residual is not None else None, out, torch.get_num_threads()),
        ),
        "rms norm",
    )
    return total, out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate``, ``up`` [rows, n] (rows may be strided: a split's views),
    written into the dense block ``out`` (None: a new one)."""
    lib = _lib()
    gate, up = _last_dense(gate), _last_dense(up)
    rows, n = gate.shape
    out = _into(out, gate, (rows, n))
    check(
        lib.sess_silu_mul(gate, gate.stride(0), up, up.stride(0), rows, n, out, torch.get_num_threads()),
        "silu",
    )
    return out


def draw(
    logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [rows, vocab] from softmax(logits / temperature) (every
    temperature > 0, no truncation), by inverse CDF at ``u`` (float64 in [0, 1)) in the two levels
    of :func:`.token_choice.inverse_cdf`, and its logprob as :func:`logprobs` gives it (taken in the
    same pass over the row): a row's token and logprob depend on the row alone."""
    lib = _lib()
    logits = _last_dense(logits)
    rows, vocab = logits.shape
    temperature = temperature.to(torch.float32).contiguous()
    u = u.to(torch.float64).contiguous()
    tiles = torch.empty(rows, -(-vocab // 256), dtype=torch.float64)
    tokens = torch.empty(rows, dtype=torch.int64)
    chosen = torch.empty(rows, dtype=torch.float32)
    check(
        lib.sess_draw(
            *(logits, logits.stride(0), rows, vocab, temperature, u, tiles, tokens, chosen),
            torch.get_num_threads(),
        ),
        "token draw",
    )
    return tokens, chosen


def logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log-softmax of each row of ``logits`` [rows, vocab] at its id in ``tokens`` [rows], fp32:
    (x - max) - ln(sum of e^(x - max)), the sum in a fixed order of the row's own values (to
    ~1e-7 of torch's log_softmax, not its bits)."""
    lib = _lib()
    logits = _last_dense(logits)
    rows, vocab = logits.shape
    tokens = tokens.to(torch.int64).contiguous()
    out = torch.empty(rows, dtype=torch.float32)
    check(
        lib.sess_logprobs(logits, logits.stride(0), rows, vocab, tokens, out, torch.get_num_threads()),
        "logprob",
    )
    return out


def _lib():
    lib, how = native.library()
    if lib is None:
        raise RuntimeError(f"the sampler's C kernels: {how}")
    return lib


def check(failed: int, what: str) -> None:
    """Raise for a kernel's negative status, naming ``what`` and the cause."""
    if failed == -3:
        raise ValueError(f"{what} kernel: a position outside the cache or the prefill's tokens")
    if failed == -4:
        raise ValueError(f"{what} kernel: a shared prefix's source outside the rows or past a position")
    if failed == -5:
        raise ValueError(f"{what} kernel: cache places outside the cache's rows or not ascending")
    if failed == -6:
        raise ValueError(f"{what} kernel: a token id outside the vocabulary")
    if failed:
        raise RuntimeError(f"{what} kernel failed ({failed}: -1 a shape not built, -2 out of memory)")


class Blocks:
    """The blocks one pass through a model's layers writes its norms, attention and activation
    into, made on first use and written again layer after layer instead of allocated once a layer
    (~180 large allocations a 64-row decode step on smollm2). Each such malloc searches a heap
    that training and loading have left with many free chunks, whose headers the step's matmuls
    have just evicted from the caches: ~10 us a call there. The residual stream alternates
    between two blocks (a norm's sum never overlaps its input); the others hold one layer's value
    until the next layer writes it, so a pass's result (the last norm's) stays valid until the
    :class:`Blocks` writes again."""

    def __init__(self) -> None:
        self._blocks: dict[str, torch.Tensor] = {}

    def block(self, name: str, like: torch.Tensor, *shape: int) -> torch.Tensor:
        """The block ``name`` of ``shape`` (made on first use, or again for another shape)."""
        block = self._blocks.get(name)
        if block is None or block.shape != shape or block.dtype != like.dtype:
            block = self._blocks[name] = like.new_empty(shape)
        return block

    def norm(self, module: torch.nn.Module, h: torch.Tensor, residual: torch.Tensor | None):
        """:func:`rms_norm` of ``h`` plus ``residual`` with ``module``'s weight and epsilon."""
        shape = tuple(h.shape)
        total = None
        if residual is not None:  # the one of the two sums that is not h
            total = self.block("sum", h, *shape)
            if total is h:
                total = self.block("other sum", h, *shape)
        normed = self.block("normed", h, *shape)
        return rms_norm(h, module.weight, module.variance_epsilon, residual, (total, normed))


def _into(out: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``out`` where given (dense, of ``shape`` and ``like``'s dtype), else a new block."""
    if out is None:
        return like.new_empty(shape)
    if tuple(out.shape) != shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(
            f"an output block of {tuple(out.shape)} {out.dtype}, not a dense {shape} {like.dtype}"
        )
    return out


def _int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as dense int64 (itself where it is)."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _rows_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` [rows, heads, dim] with each row's heads dense (rows may be strided: a split's view)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


def _last_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` [rows, n] with each row dense (rows may be strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def status() -> str:
    """Which a decode step runs, for the engine's status."""
    if not native.built():
        return "not built yet (built when the engine first samples)"
    lib, how = native.library()
    if lib is None:
        return how + "; attention, norms and activations run as torch ops"
    return f"C kernels for fp32 models, {how}"
