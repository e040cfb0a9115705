"""A decode step of one or two rows as a fixed list of C calls: batch-1 decoding at the speed its weights stream.

At one row a decode step is one pass over every weight (538 MB of fp32 on smollm2) through the
few-row kernel (:mod:`.few_rows`), with ~120 other C calls (norms, attention, activation) between
them. Each call made through the lean decoder's general step goes through Python that finds the
adapter's plan for the rows, looks up and checks every tensor, allocates the output and splits
it: together about a third of a one-row step's time, during which no weight streams from memory
(benchmarks/README.md, ``decode_profile.py``). A
:class:`FewRowStep` does that work once for a batch shape (its rows, their adapter, the thread
count): it holds each layer's kernels, their blocks of output (the residual stream alternates
between two), and each call's arguments with their addresses already checked, so a step is the
same C calls on the same inputs in the same order (the same bits: the parity and batch-invariance
tests run through it) with only the per-step inputs (the embedding, rotary tables, positions and
the cache's layers) filled in.

The decoder makes one where it covers a step (:func:`make`: fp32 on CPU with the C kernels, a
llama model without q/k norms, every row through one merged plan or the base model, every matmul
with a few-row kernel) and drops it whenever a weight it reads could change: an adapter's plan
made again or dropped, the base copies released (:class:`~.llama_plans.LlamaPlans` and
:class:`~.row_invariant.RowInvariantLinears` call the decoder's hook first, so no freed weight is
ever read and no copy is held past its plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sess.engine.native import kernels as native
from sess.engine.sampling import few_rows, fused_ops
from sess.engine.sampling.lora_plans import Fused, base_of
from sess.engine.sampling.row_invariant import BLOCK


@dataclass(frozen=True)
class Matmul:
    """One few-row call: ``args`` for the kernel's C function (the input block, its weight, the
    output block [rows, width]), and ``parts``, views of the output's first columns, one for each
    projection the call computes."""

    kernel: few_rows.FewRows
    args: tuple
    parts: tuple[torch.Tensor, ...]


def bundle_kernels(linear, parent, names, merged) -> list[tuple[few_rows.FewRows, tuple[int, ...]]] | None:
    """The few-row kernels that compute the projections ``names`` of ``parent`` for rows of one
    merged plan's bundle (``merged``: a :class:`~.lora_plans.Fused`, a list per projection, or
    None for the base model) as the general step computes them, each with the sizes of the
    projections its output holds; None where one has no few-row kernel."""
    if isinstance(merged, Fused):
        few = merged.matmul.few
        return None if few is None else [(few, merged.sizes)]
    found = []
    for index, name in enumerate(names):
        fn = merged[index] if merged is not None else None
        if fn is None:
            base = base_of(getattr(parent, name))
            few = linear.few_of(base.weight) if base.bias is None else None
        else:
            few = getattr(fn, "few", None)
        if few is None:
            return None
        found.append((few, (few.out_features,)))
    return found


@dataclass(frozen=True)
class Layer:
    """One decoder layer's calls: its two norms, its four bundles' matmuls, and the fixed
    arguments of its attention (the q/k/v views' addresses and strides) and activation (all but
    the thread count)."""

    norms: tuple[torch.nn.Module, torch.nn.Module]
    qkv: list[Matmul]
    o: list[Matmul]
    gate_up: list[Matmul]
    down: list[Matmul]
    attend: tuple
    silu: tuple


class FewRowStep:
    """One batch shape's decode step as C calls (see the module docstring): ``self(cache, h,
    rotation, positions)`` gives the logits the lean decoder's general step gives, to the bit."""

    def __init__(self, decoder, model, kernels: list, rows: int):
        """``kernels``: per layer its four bundles' :func:`bundle_kernels`, then the lm_head's."""
        self.decoder, self.rows = decoder, rows
        self.threads = torch.get_num_threads()
        lib, _ = native.library()
        self.few, self.norm = lib.sess_few_rows.c_function, lib.sess_rms_norm.c_function
        self.attention, self.silu = lib.sess_decode_attention.c_function, lib.sess_silu_mul.c_function
        inner = model.model
        hidden = inner.embed_tokens.weight.shape[1]
        self.sums = [torch.empty(rows, hidden) for _ in range(2)]  # the residual stream, alternating
        self.normed = torch.empty(rows, hidden)
        self.attended = torch.empty(rows, decoder.heads * decoder.head_dim)
        self.acts: dict[int, torch.Tensor] = {}  # the activation's block, by its width
        self.layers = []
        for layer, bundles in zip(inner.layers, kernels[:-1]):
            width = sum(sum(sizes) for _, sizes in bundles[2]) // 2
            act = self.acts.setdefault(width, torch.empty(rows, width))
            inputs = (self.normed, self.attended, self.normed, act)
            qkv, o, gate_up, down = (self._matmuls(b, x) for b, x in zip(bundles, inputs))
            q, k, v = (part for m in qkv for part in m.parts)
            gate, up = (part for m in gate_up for part in m.parts)
            self.layers.append(
                Layer(
                    (layer.input_layernorm, layer.post_attention_layernorm),
                    *(qkv, o, gate_up, down),
                    attend=(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0)),
                    silu=(
                        gate.data_ptr(),
                        gate.stride(0),
                        up.data_ptr(),
                        up.stride(0),
                        rows,
                        width,
                        act.data_ptr(),
                    ),
                )
            )
        (self.head,) = self._matmuls(kernels[-1], self.normed)
        self.final = inner.norm

    def _matmuls(self, kernels, x: torch.Tensor) -> list[Matmul]:
        made = []
        for kernel, sizes in kernels:
            out = torch.empty(self.rows, kernel.order.width)
            parts = tuple(out[:, : sum(sizes)].split(sizes, dim=-1))
            o = kernel.order
            args = (x.data_ptr(), self.rows, x.shape[1], kernel.address, o.width, o.tile, o.block)
            made.append(Matmul(kernel, (*args, out.data_ptr(), self.threads), parts))
        return made

    def _run(self, matmuls: list[Matmul]) -> None:
        """The few-row calls of one bundle (their outputs are the blocks :attr:`Matmul.parts` view)."""
        for m in matmuls:
            if self.few(*m.args):
                raise RuntimeError(f"few-row kernel: tile width {m.kernel.order.tile} not built")

    def _norm(self, module, x: torch.Tensor, residual: torch.Tensor | None, total: torch.Tensor | None):
        """:func:`.fused_ops.rms_norm` of ``x`` (+ ``residual``) into ``total`` and :attr:`normed`."""
        added = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
        fused_ops.check(
            self.norm(
                *(x.data_ptr(), x.stride(0), *added, module.weight.data_ptr(), module.variance_epsilon),
                *(self.rows, x.shape[1], total.data_ptr() if total is not None else None),
                *(self.normed.data_ptr(), self.threads),
            ),
            "rms norm",
        )
        return total if total is not None else x

    def _attend(self, layer: Layer, common: tuple, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The layer's decode attention (:func:`.fused_ops.attend`) into :attr:`attended`."""
        positions, q_tables, shared, held, rows = common
        d = self.decoder
        fused_ops.check(
            self.attention(
                *(*layer.attend, *q_tables, keys.data_ptr(), values.data_ptr(), positions, *shared, held),
                *(keys.shape[0] * BLOCK, rows, d.heads, d.kv_heads, d.head_dim),
                *(self.attended.data_ptr(), self.threads),
            ),
            "decode attention",
        )

    def _head(self) -> torch.Tensor:
        """The lm_head's logits of :attr:`normed`, in a new tensor."""
        head = self.head
        order = head.kernel.order
        logits = torch.empty(self.rows, order.width)
        if self.few(*head.args[:-2], logits.data_ptr(), self.threads):
            raise RuntimeError(f"few-row kernel: tile width {order.tile} not built")
        width = head.kernel.out_features
        return logits if order.width == width else logits[:, :width].contiguous()

    @torch.no_grad()
    def __call__(self, cache, h: torch.Tensor, rotation, positions: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the embedded tokens ``h`` [rows, hidden] at ``positions`` (the
        cache's :meth:`~.block_cache.BlockCache.set_positions` made for this step), with the
        step's ``rotation`` (cos, sin, q_cos, q_sin [rows, 1, dim])."""
        d, rows = self.decoder, self.rows
        rotation = [t.contiguous() for t in rotation]  # held until the step ends
        positions = positions.to(torch.int64).contiguous()
        shared = cache.sharing()
        places = cache.places
        if any(t.shape != (rows,) for t in (*shared, *([places] if places is not None else []))):
            raise ValueError(f"decode attention kernel: sharing or places of a cache not of {rows} rows")
        held = cache.held if places is not None else rows
        common = (
            positions.data_ptr(),
            tuple(t.data_ptr() for t in rotation),
            (*(t.data_ptr() for t in shared), places.data_ptr() if places is not None else None),
            held,
            rows,
        )
        h = h.contiguous()
        pending, which = None, 0
        for index, layer in enumerate(self.layers):
            first, second = layer.norms
            total = self.sums[which] if pending is not None else None
            h = self._norm(first, h, pending, total)
            which ^= pending is not None
            self._run(layer.qkv)
            keys, values = cache.layer(index)
            if keys.shape[1:] != (held, d.kv_heads, BLOCK, d.head_dim):
                raise ValueError(f"decode attention kernel: a cache layer of shape {tuple(keys.shape)}")
            self._attend(layer, common, keys, values)
            self._run(layer.o)
            h = self._norm(second, h, layer.o[0].parts[0], self.sums[which])
            which ^= 1
            self._run(layer.gate_up)
            fused_ops.check(self.silu(*layer.silu, self.threads), "silu")
            self._run(layer.down)
            pending = layer.down[0].parts[0]
        self._norm(self.final, h, pending, self.sums[which])
        return self._head()


def make(decoder, model, plans: list, rows: int) -> FewRowStep | None:
    """The :class:`FewRowStep` for ``rows`` rows that all run through the one plan of ``plans``
    (:meth:`.LlamaPlans.group_plans`; empty or a None plan: the base model), or None where it does
    not cover the step (more rows, plans as LoRA terms, a matmul without a few-row kernel)."""
    if rows > few_rows.FEW or decoder.qk_norm or len(plans) > 1:
        return None
    plan = plans[0][1] if plans else None
    if plan is not None and not decoder.merges_lora():
        return None
    bundles = decoder.plans.bundles(model)
    found = []
    for index, (parent, names) in enumerate(bundles):
        merged = None
        if plan is not None:
            merged = plan[-1] if index == len(bundles) - 1 else plan[index // 4][index % 4]
        kernels = bundle_kernels(decoder.linear, parent, names, merged)
        if kernels is None:
            return None
        found.append(kernels)
    layers = [found[i : i + 4] for i in range(0, len(found) - 1, 4)]
    return FewRowStep(decoder, model, [*layers, found[-1]], rows)
