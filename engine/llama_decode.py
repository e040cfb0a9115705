"""The sampler's decode step for llama-family models (llama, qwen3), written against the weights.

A decode step of 64 rows on smollm2-135m does ~1,900 small tensor ops through transformers' and
peft's modules; the matmuls of the base model are about half of its time and the rest is module
machinery (masks built and ignored, per-layer hooks and bookkeeping, a LoRA call per projection).
This step runs the same arithmetic directly on the same weights: the base projections through the
model's own :class:`~.invariant.InvariantLinear` layers, one LoRA ``A`` matmul for the projections
that read the same input (q/k/v, gate/up), the ``B`` matmuls per projection, and attention over the
decode batch's block cache (:func:`~.invariant.decode_attention`).

Row by row this is the arithmetic of one request alone, as in the module path: every linear layer
gives each row the same result at any row count (:mod:`.invariant`), norms, rotary embeddings and
activations work per row, and each group of rows adds its own adapter's LoRA terms. So batch
invariance holds here too; the sampled logprobs equal ``forward`` to rounding (the parity tests).

:meth:`LlamaDecoder.for_model` returns None for other architectures, and :func:`supports_adapters`
is False for LoRA variants such as DoRA; the sampler keeps the module path for those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .invariant import (
    decode_attention,
    onednn_available,
    pack_weight,
    packed_linear,
    pad_rows,
    row_padding,
)
from .lora_rows import Groups, add_to_rows, take_rows

ARCHITECTURES = ("llama", "qwen3")
PACK_FROM = 1024  # LoRA B matrices with this many outputs or more go through oneDNN, prepacked
# projections that read the same input share one LoRA A matmul
BUNDLES = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


@dataclass
class _Lora:
    """One adapter's LoRA terms for a bundle of projections that read the same input: their A
    matrices stacked, and per projection its B, scaling and columns of the stacked A's output."""

    a: torch.Tensor
    parts: list[tuple[str, torch.Tensor, float, slice, bool]]  # the last: B prepacked and scaled


class LlamaDecoder:
    """The decode step of one base model; :meth:`step` takes the model each call, since peft
    wraps and unwraps its layers as adapters come and go."""

    def __init__(self, config):
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.qk_norm = config.model_type == "qwen3"
        self._plans: dict[str, tuple[list, tuple, list]] = {}  # adapter -> (modules, versions, plan)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> LlamaDecoder | None:
        """A decoder for ``model``, or None when this step does not cover its architecture."""
        config = model.config
        if getattr(config, "model_type", None) not in ARCHITECTURES:
            return None
        if getattr(config, "hidden_act", "silu") != "silu":
            return None
        return cls(config)

    # the step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self, model, groups: Groups, tokens: torch.Tensor, positions: torch.Tensor, cache
    ) -> torch.Tensor:
        """Logits [rows, vocab] for one new token per row of ``model`` (each group of rows through
        its adapter; None: base weights). ``cache`` is the batch's ``SlotCache`` with this step's
        write positions set. Call inside :func:`~.invariant.invariant_rows`."""
        plans = [(rows, self._plan(model, adapter)) for adapter, rows in groups if adapter is not None]
        inner = model.model
        count = tokens.shape[0]
        h = inner.embed_tokens(tokens)  # [rows, hidden]
        cos, sin = inner.rotary_emb(h, positions[:, None])  # [rows, 1, head_dim]
        half = self.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # rotate_half's signs
        q_cos, q_sin = cos * self.scaling, sin * self.scaling  # queries leave the rotation scaled
        step = cache.layers[0].step
        bias = step.layout.decode_bias(step.blocks, self.kv_heads)
        for index, layer in enumerate(inner.layers):
            lora = [(rows, plan[index]) for rows, plan in plans]
            attn, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(layer.input_layernorm, h)
            q, k, v = _project(attn, BUNDLES[0], x, lora, 0)
            q = q.view(count, self.heads, self.head_dim)
            k = k.view(count, self.kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
            q = q * q_cos + q.roll(half, dims=-1) * q_sin  # rotary embedding, as apply_rotary_pos_emb
            k = k * cos + k.roll(half, dims=-1) * sin
            keys, values = cache.layers[index].update(
                k[:, :, None], v.view(count, self.kv_heads, 1, self.head_dim)
            )
            out = decode_attention(q[:, :, None], keys, values, bias)
            (o,) = _project(attn, BUNDLES[1], out.reshape(count, -1), lora, 1)
            h = h + o
            x = _rms_norm(layer.post_attention_layernorm, h)
            gate, up = _project(mlp, BUNDLES[2], x, lora, 2)
            (down,) = _project(mlp, BUNDLES[3], F.silu(gate) * up, lora, 3)
            h = h + down
        h = _rms_norm(inner.norm, h)
        (logits,) = _project(model, ("lm_head",), h, [(rows, plan[-1:]) for rows, plan in plans], 0)
        return logits

    # per-adapter LoRA plans ------------------------------------------------------------------------
    def _plan(self, model, adapter: str) -> list:
        """Per layer, per bundle, the adapter's :class:`_Lora` (or None); last, the lm_head's.
        Rebuilt when any of the adapter's weights changed (a training session's after optim_step)."""
        cached = self._plans.get(adapter)
        if cached is not None and all(adapter in m.lora_A for m in cached[0]):
            if _versions(cached[0], adapter) == cached[1]:
                return cached[2]
        modules = [m for m in model.modules() if hasattr(m, "lora_A") and adapter in m.lora_A]
        plan = []
        for layer in model.model.layers:
            parents = (layer.self_attn, layer.self_attn, layer.mlp, layer.mlp)
            plan.append([_bundle(parent, names, adapter) for parent, names in zip(parents, BUNDLES)])
        plan.append(_bundle(model, ("lm_head",), adapter))
        live = {a for m in modules[:1] for a in m.lora_A}
        self._plans = {a: p for a, p in self._plans.items() if a in live}
        self._plans[adapter] = (modules, _versions(modules, adapter), plan)
        return plan


def supports_adapters(model: torch.nn.Module) -> bool:
    """Whether every LoRA layer of ``model`` is a plain, unmerged LoRA ``Linear`` (no DoRA or other
    variant), which is what :meth:`LlamaDecoder.step` computes."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import LoraLayer

    return all(
        isinstance(m, LoraLinear) and not m.merged and not m.lora_variant
        for m in model.modules()
        if isinstance(m, LoraLayer)
    )


def _versions(modules, adapter: str) -> tuple:
    return tuple(
        (id(w), w._version) for m in modules for w in (m.lora_A[adapter].weight, m.lora_B[adapter].weight)
    )


def _project(parent, names, x: torch.Tensor, lora, bundle: int) -> list[torch.Tensor]:
    """The projections ``names`` of ``parent`` on ``x``, plus each group of rows' LoRA terms."""
    outs = [_base(getattr(parent, name)).forward(x) for name in names]
    for rows, layer_plan in lora:
        terms = layer_plan[bundle]
        if terms is not None:
            _add_lora(outs, x, rows, terms, names)
    return outs


def _base(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "base_layer", module)


def _bundle(parent, names, adapter: str) -> _Lora | None:
    present = [
        (name, getattr(parent, name))
        for name in names
        if adapter in getattr(getattr(parent, name), "lora_A", {})
    ]
    if not present:
        return None
    a_parts, parts, start = [], [], 0
    for name, module in present:
        a = module.lora_A[adapter].weight
        a_parts.append(a)
        b, scaling = module.lora_B[adapter].weight, float(module.scaling[adapter])
        packed = b.is_cpu and b.shape[0] >= PACK_FROM and onednn_available()
        if packed:  # oneDNN is faster than the BLAS for these; scaling goes into the copy
            b = pack_weight(b.detach() * scaling)
        parts.append((name, b, scaling, slice(start, start + a.shape[0]), packed))
        start += a.shape[0]
    a = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts).contiguous()
    return _Lora(a=a, parts=parts)


def _add_lora(outs, x: torch.Tensor, rows, terms: _Lora, names) -> None:
    """Add each projection's ``B(A x) * scaling`` for the rows ``rows`` to its output."""
    part = take_rows(x, rows)
    padded, count = pad_rows(part, row_padding(part.device.type))
    low = F.linear(padded, terms.a)  # [padded rows, sum of ranks]
    for name, b, scaling, columns, packed in terms.parts:
        out = outs[names.index(name)]
        if packed:
            delta = packed_linear(low[:count, columns].contiguous(), b)
        else:
            delta = F.linear((low[:, columns] * scaling).contiguous(), b)[:count]
        add_to_rows(out, rows, delta)


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm (x * rsqrt(mean(x^2) + eps) * weight), in one op."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
