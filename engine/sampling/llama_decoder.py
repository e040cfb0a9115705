"""The lean decoder for llama-family models (llama, qwen3): prefill and decode steps on the weights.

A decode step through transformers' and peft's modules spends about half its time in module
machinery (masks, hooks, a LoRA call a projection); this decoder runs the same arithmetic directly
on the same weights, and attention over the batch's :class:`~.block_cache.BlockCache`. Each group of
rows goes through its adapter's plan (kept by :mod:`.llama_plans`, made by :mod:`.lora_plans`):
merged (an fp32 base on CPU, the default there: one matmul a bundle of projections, q/k/v, o,
gate/up, down) or the base projections for every row (:class:`~.row_invariant.RowInvariantLinears`) plus each group's LoRA terms. A prefill
lays the new prompts end to end (no padding), runs each prompt's attention on its own, and writes
each prompt's keys and values into the rows of its samples. For fp32 on CPU a step's attention,
norms and activation are C calls (:mod:`.fused_ops`), each row's sums in an order of its own; a
prefill's attention is the same code, a prefix that prompts of one adapter share is computed once
for them all (:class:`Layout`), and one of an earlier prompt of the same weights is read from the
:mod:`.prefix_cache`.

Row by row this is the arithmetic of one request alone: every linear layer gives each row the same
result at any row count (:mod:`.row_invariant`), norms, rotary embeddings and activations work per
row, and which form an adapter's plan takes is decided per engine, not per batch. So the batch is
invariant, and the sampled logprobs equal ``forward``'s to rounding (the parity tests).

It computes exactly the models :func:`unsupported` accepts; anything else (rope scaling, attention
bias, sliding windows, other architectures) decodes through the model's own modules instead
(:mod:`.module_decoder`). The decoder reads the model's modules but never changes them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from sess.engine.libraries import torch_internals
from sess.engine.sampling import few_row_step, fused_ops, prefix_cache
from sess.engine.sampling.block_cache import BlockCache
from sess.engine.sampling.decoder import Prefill, full_attention_only
from sess.engine.sampling.llama_plans import BUNDLES, LlamaPlans
from sess.engine.sampling.lora_plans import add_terms, base_of, run_merged
from sess.engine.sampling.prefill_layout import Layout
from sess.engine.sampling.row_invariant import RowInvariantLinears, decode_attention
from sess.engine.sampling.rows import groups_of

MODELS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # model_type -> its class
# the most columns a new cache holds past its longest prompt for the requests' max_tokens: a cache
# that grows is copied whole, and one that never needs them holds memory for nothing
AHEAD = 128


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the lean decoder does not compute ``model`` exactly (None: it does)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in MODELS:
        return f"architecture {model_type!r} (the lean decoder covers {', '.join(MODELS)})"
    if type(model).__name__ != MODELS[model_type]:
        return f"model class {type(model).__name__} (expected {MODELS[model_type]})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "attention or MLP biases"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope scaling {rope.get('rope_type', rope.get('type'))!r}"
    if not full_attention_only(model):
        return "sliding-window attention"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "tensor-parallel pretraining slices (pretraining_tp)"
    if getattr(config, "quantization_config", None):
        return "quantized weights"
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return "logit soft-capping"
    return None


class LlamaDecoder:
    """Prefill and decode steps of one base model, merging every request into one batch (``model_of()``
    gives the model at each call: peft wraps and unwraps its layers as adapters come and go)."""

    merges = True

    def __init__(self, model_of: Callable[[], torch.nn.Module], pack_budget: Callable[[], int] | None = None):
        """``pack_budget()``: the bytes the prepacked copies of the base weights may take (the
        engine's memory budget); they are kept only where all of them fit (None: always)."""
        self.model_of = model_of
        self.plans = LlamaPlans(model_of, pack_budget)  # which weights each row runs through
        # a step's attention, norms and activation as C calls (:mod:`.fused_ops`; None: decided on first use)
        self.kernels: bool | None = None
        config = model_of().config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.qk_norm = config.model_type == "qwen3"
        self.attention_kernel = fused_ops.covers_attention(self.heads, self.kv_heads, self.head_dim)
        self.linear = RowInvariantLinears()
        self.prefix = prefix_cache.PrefixCache(prefix_cache.budget_of(pack_budget))  # prompts' entries
        # (batch shape, its few-row step or None where one does not cover it), dropped before any
        # weight it reads could change (:mod:`.few_row_step`)
        self._few_step: tuple | None = None
        self.plans.on_change = self.linear.on_change = self._drop_few_step

    # which weights each row runs through (:mod:`.llama_plans`) -------------------------------------
    @property
    def merge_lora(self) -> bool | None:
        """Adapters' plans merged or as terms (None: decided on first use; set it to choose)."""
        return self.plans.merge_lora

    @merge_lora.setter
    def merge_lora(self, merged: bool | None) -> None:
        self.plans.merge_lora = merged

    def packs(self) -> bool:
        """Whether the base projections run through prepacked copies (:meth:`.LlamaPlans.packs`)."""
        return self.plans.packs()

    def copy_bytes(self) -> int | None:
        """Bytes all prepacked copies of the base weights take (None until :meth:`packs` measured it)."""
        return self.plans.copy_bytes()

    def merges_lora(self) -> bool:
        """Whether adapters' plans are merged weights (:meth:`.LlamaPlans.merges_lora`)."""
        return self.plans.merges_lora()

    def adapter_slots(self) -> int | None:
        """How many adapters' merged plans the copy budget holds (:meth:`.LlamaPlans.adapter_slots`)."""
        return self.plans.adapter_slots()

    def plan(self, adapter: str) -> list:
        """``adapter``'s decode plan (made now if it is not kept): per layer its four bundles of
        projections (q/k/v, o, gate/up, down), each merged matmuls or terms (:mod:`.lora_plans`) or
        None, then the lm_head's."""
        return self.plans.plan(self.model_of(), adapter)

    def planned(self, adapter: str) -> bool:
        """Whether ``adapter``'s decode plan is made and kept (see :meth:`release_memory`)."""
        return self.plans.planned(adapter)

    def release_memory(self, keep: set[str] = frozenset()) -> None:
        """Drop the prepacked copies of the base weights (as large as the weights) and the plans
        of adapters not in ``keep`` (a plan holds the adapter's A matrices stacked and its large B
        matrices prepacked: 45 MB for smollm2 at rank 32, ~1 s to make); both are made again on
        the next decode step. The engine calls this before a training op, keeping the plans of
        adapters that running requests sample from."""
        self.linear.release()
        self.plans.keep_only(keep)
        self.prefix.forget(keep=lambda weights: weights[0] in keep)

    def forget(self, adapter: str) -> None:
        """Drop ``adapter``'s plan (merged copies as large as its weights): the engine removed it."""
        self.plans.forget(adapter)
        self.prefix.forget(keep=lambda weights: weights[0] != adapter)

    def finished(self, cache: BlockCache, row: int, job, tokens: list[int]) -> None:
        """Keep a finished row's entries, its weights those of its prefill still (:mod:`.prefix_cache`)."""
        if job.prefix_key is not None and job.prefix_key == self._weights(self.model_of(), [job])[0]:
            prefix_cache.store_row(self.prefix, job.prefix_key, cache, row, job, tokens)

    # prefill ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, jobs: list) -> Prefill:
        """Run the prompts of ``jobs`` (each with ``prompt``, ``num_samples``, ``adapter``,
        ``prompt_logprobs`` and ``params.max_tokens``); a job that wants prompt logprobs comes alone.
        With the attention kernel, a prefix that prompts of one adapter begin with (a system prompt,
        a task's instructions) is computed once for them all (:class:`Layout`)."""
        model = self.model_of()
        self.linear.packing(self.packs())
        device = model.model.embed_tokens.weight.device
        fused = self.uses_kernels() and self.attention_kernel
        weights = self._weights(model, jobs) if fused and prefix_cache.enabled() else None
        found, cached = prefix_cache.lookup(self.prefix, weights, jobs)
        layout = Layout.of(jobs, share=fused and not jobs[0].prompt_logprobs, found=found)
        tokens, positions = (torch.tensor(x, device=device) for x in (layout.tokens, layout.positions))
        if fused:  # where each token's columns are, for the kernel (cached entries' first)
            columns = tuple(torch.tensor(x) for x in prefix_cache.dummy_columns(layout))
        lengths = [len(job.prompt) for job in jobs]
        starts = [sum(lengths[:i]) for i in range(len(jobs))]
        keys, values = [], []

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation) -> torch.Tensor:
            if fused:  # each token over its prompt's columns, shared or its own, by the decode step's code
                cos, sin, q_cos, q_sin = rotation
                k = _rotated(k, cos, sin)
                k, v = prefix_cache.joined(cached, layer, k, v)
                keys.append(k)
                values.append(v)
                q, q_cos, q_sin = (prefix_cache.padded(x, layout.cached) for x in (q, q_cos, q_sin))
                return fused_ops.prefill_attend(k, v, q, q_cos, q_sin, columns)[layout.cached :]
            q, k = _rotate(q, k, *rotation)
            keys.append(k)
            values.append(v)
            out = torch.empty_like(q)
            for start, n in zip(starts, lengths):  # each prompt on its own, shaped as if alone
                span = slice(start, start + n)
                out[span] = F.scaled_dot_product_attention(
                    q[span].transpose(0, 1)[None].contiguous(),
                    k[span].transpose(0, 1)[None].contiguous(),
                    v[span].transpose(0, 1)[None].contiguous(),
                    is_causal=True,
                    scale=self.scaling,
                    enable_gqa=True,
                )[0].transpose(0, 1)
            return out

        plans = self.plans.group_plans(model, groups_of(layout.owners, device))
        h = self._layers(model, plans, tokens, positions, attend, scale_queries=fused)
        rows = list(range(lengths[0])) if jobs[0].prompt_logprobs else layout.last
        plans = self.plans.group_plans(model, groups_of([layout.owners[row] for row in rows], device))
        logits = self._output(model, h[rows], plans)
        if layout.shared:  # each prompt's entries laid end to end, its shared prefix's first
            order = torch.tensor(layout.order, device=device)
            keys, values = ([t.index_select(0, order) for t in entries] for entries in (keys, values))
        prefix_cache.store(self.prefix, jobs, keys, values)
        spans = [(start, n, job.num_samples) for start, n, job in zip(starts, lengths, jobs)]
        room = max(min(job.params.max_tokens, AHEAD) for job in jobs)  # growing copies the cache
        # the steps read it through the kernel, by place
        cache = BlockCache.from_prompts(
            keys, values, spans, capacity=max(lengths) + max(room, 16), by_place=fused
        )
        if jobs[0].prompt_logprobs:
            return Prefill(cache, logits[-1:], logits)
        return Prefill(cache, logits)

    def _weights(self, model, jobs: list) -> list[tuple]:
        """Per job, what its entries depend on: its adapter's weights' versions, or the base model's."""
        made = {a: self.plans.made(model, a) for a in {j.adapter for j in jobs} if a}
        w = model.model.embed_tokens.weight
        base = (id(w), torch_internals.version_of(w), torch.get_num_threads(), self.packs())
        return [(job.adapter or "", made.get(job.adapter), *base) for job in jobs]

    def _output(self, model, h: torch.Tensor, plans: list) -> torch.Tensor:
        """Logits of the final-normed states ``h``, each group of rows of ``plans`` (from
        :meth:`.LlamaPlans.group_plans`) through its adapter's lm_head."""
        plans = [(rows, p[-1:] if p else p) for rows, p in plans]
        (logits,) = self._project(model, ("lm_head",), h, plans, 0)
        return logits

    # decode step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self, cache: BlockCache, adapters: list[str | None], tokens: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Logits [rows, vocab] for one new token per row (row ``r`` through ``adapters[r]``),
        written into ``cache`` at ``positions``."""
        model = self.model_of()
        self.linear.packing(self.packs())
        step = cache.set_positions(positions)
        fused = self.uses_kernels() and self.attention_kernel
        shared = cache.sharing() if fused else None
        blocks = fused_ops.Blocks() if self.uses_kernels() else None

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation) -> torch.Tensor:
            if fused:
                keys, values = cache.layer(layer)
                out = blocks.block("attention", q, *q.shape)
                return fused_ops.attend(
                    keys, values, step.positions, q, k, v, rotation, shared, cache.places, out
                )
            q, k = _rotate(q, k, *rotation)
            keys, values = cache.update(layer, k, v)
            return decode_attention(q[:, :, None], keys, values, step.bias(self.kv_heads)).view(q.shape)

        plans = self.plans.group_plans(model, groups_of(adapters, tokens.device))
        few = self._few_step_for(model, plans, adapters) if fused else None
        if few is not None:  # one or two rows: the same C calls, made ready once
            return few(cache, *self._embedded(model, tokens, positions, scale_queries=True), step.positions)
        h = self._layers(model, plans, tokens, positions, attend, scale_queries=True, blocks=blocks)
        return self._output(model, h, plans)

    def _few_step_for(self, model, plans: list, adapters: list[str | None]):
        """The :class:`~.few_row_step.FewRowStep` for this batch shape (made on first use), or None."""
        key = (tuple(adapters), torch.get_num_threads(), self.linear.pack)
        if self._few_step is None or self._few_step[0] != key:
            self._few_step = None
            made = few_row_step.make(self, model, plans, len(adapters))
            self._few_step = (key, made)
        return self._few_step[1]

    def _drop_few_step(self) -> None:
        self._few_step = None

    def _layers(
        self, model, plans: list, tokens, positions, attend, *, scale_queries: bool, blocks=None
    ) -> torch.Tensor:
        """The decoder layers on one token per row of ``tokens`` (rows at ``positions``), each group
        of rows of ``plans`` (from :meth:`.LlamaPlans.group_plans`) through its adapter's, with
        ``attend(layer, q, k, v, rotation)`` doing the rotary embedding (``q, k`` as they come out of
        their projections and norms, [rows, heads, dim] each; ``rotation`` for :func:`_rotate`) and
        attention; returns the final-normed states. With the C kernels, the norms and activation
        write into ``blocks`` (:class:`~.fused_ops.Blocks`; new ones where None), the returned
        states too."""
        inner = model.model
        count = tokens.shape[0]
        h, rotation = self._embedded(model, tokens, positions, scale_queries)
        kernels = self.uses_kernels()
        if kernels and blocks is None:
            blocks = fused_ops.Blocks()
        norm = blocks.norm if kernels else _add_norm
        pending = None  # the residual the next norm adds first
        for index, layer in enumerate(inner.layers):
            lora = [(rows, plan[index] if plan else plan) for rows, plan in plans]
            attn, mlp = layer.self_attn, layer.mlp
            h, x = norm(layer.input_layernorm, h, pending)
            q, k, v = self._project(attn, BUNDLES[0], x, lora, 0)
            q = q.view(count, self.heads, self.head_dim)
            k = k.view(count, self.kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
            out = attend(index, q, k, v.view(count, self.kv_heads, self.head_dim), rotation)
            (o,) = self._project(attn, BUNDLES[1], out.reshape(count, -1), lora, 1)
            h, x = norm(layer.post_attention_layernorm, h, o)
            gate, up = self._project(mlp, BUNDLES[2], x, lora, 2)
            act = (
                fused_ops.silu_mul(gate, up, blocks.block("act", gate, *gate.shape))
                if kernels
                else F.silu(gate) * up
            )
            (pending,) = self._project(mlp, BUNDLES[3], act, lora, 3)
        return norm(inner.norm, h, pending)[1]

    def _embedded(self, model, tokens, positions, scale_queries: bool) -> tuple[torch.Tensor, tuple]:
        """``(h, rotation)``: the embedded ``tokens`` [rows, hidden] and the rotary tables at
        ``positions`` for :func:`_rotate` (the queries' scaled where ``scale_queries``)."""
        inner = model.model
        h = inner.embed_tokens(tokens)  # [rows, hidden]
        cos, sin = inner.rotary_emb(h, positions[:, None])  # [rows, 1, head_dim]
        half = self.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # rotate_half's signs
        # decode attention takes its queries scaled, so the rotation scales them on the way
        q_cos, q_sin = (cos * self.scaling, sin * self.scaling) if scale_queries else (cos, sin)
        return h, (cos, sin, q_cos, q_sin)

    def _project(self, parent, names, x: torch.Tensor, lora, bundle: int) -> list[torch.Tensor]:
        """The projections ``names`` of ``parent`` on ``x``, each group of rows with its adapter's."""
        if self.merges_lora():
            return run_merged(self.linear, parent, names, x, lora, bundle)
        outs = []
        for name in names:
            base = base_of(getattr(parent, name))
            outs.append(self.linear(x, base.weight, base.bias))
        for rows, layer_plan in lora:
            terms = layer_plan[bundle]
            if terms is not None:
                add_terms(outs, x, rows, terms, names)
        return outs

    def uses_kernels(self) -> bool:
        """Whether steps run their norms, activation and (where :attr:`attention_kernel`) decode
        attention through the C kernels (:mod:`.fused_ops`) or as torch ops: decided on first use
        and kept for the engine's life, so a request's arithmetic never depends on when it ran."""
        if self.kernels is None:
            weight = self.model_of().model.embed_tokens.weight
            self.kernels = fused_ops.usable(weight.dtype, weight.device)
        return self.kernels


def _rotate(q, k, cos, sin, q_cos, q_sin) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of ``q`` and ``k`` [rows, heads, dim], as apply_rotary_pos_emb
    (``sin`` with rotate_half's signs; ``q_cos``, ``q_sin`` the queries', which may carry a scale)."""
    return _rotated(q, q_cos, q_sin), _rotated(k, cos, sin)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, heads, dim] rotated: x * cos + rotate_half(x) * sin (``sin`` with its signs)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def _add_norm(norm: torch.nn.Module, h: torch.Tensor, residual: torch.Tensor | None):
    """``(h, normed)``: ``h`` plus ``residual`` (None: nothing to add) and its RMS norm."""
    if residual is not None:
        h = h + residual
    return h, _rms_norm(norm, h)


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm (x * rsqrt(mean(x^2) + eps) * weight), in one op."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
