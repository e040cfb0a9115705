"""Which weights each row of the lean decoder (:mod:`.llama_decoder`) runs through: the base
projections, through prepacked copies where their bytes fit the memory budget, and per adapter its
decode plan (:mod:`.lora_plans`: merged matmuls, or LoRA terms beside the base projections), made
on first use, kept while the adapter's weights are unchanged, and dropped oldest first beyond the
adapter slots the copy budget holds. Which form plans take is decided once per engine, so a
request's arithmetic never depends on what else is sampling."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from sess.engine.sampling import onednn
from sess.engine.sampling.lora_plans import Kept, base_of, count, lora_layers, merged_of, terms_of, versions
from sess.engine.sampling.rows import Groups

# projections that read the same input share one LoRA A matmul
BUNDLES = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


class LlamaPlans:
    """The base copies' budget and the adapters' decode plans of one base model (``model_of()``
    gives the model at each call: peft wraps and unwraps its layers as adapters come and go)."""

    def __init__(self, model_of: Callable[[], torch.nn.Module], pack_budget: Callable[[], int] | None = None):
        """``pack_budget()``: the bytes the prepacked copies of the base weights may take (the
        engine's memory budget); they are kept only where all of them fit (None: always)."""
        self.model_of = model_of
        self.pack_budget = pack_budget
        self._copy_bytes: int | None = None
        self.merge_lora: bool | None = None  # adapters' plans merged or as terms (None: decided on first use)
        self._plans: dict[str, Kept] = {}  # adapter -> its plan and what it was made from
        self.on_change: Callable[[], None] | None = None  # called before any plan is dropped or made

    def packs(self) -> bool:
        """Whether the base projections run through prepacked copies: where their bytes (as many as
        the weights': 538 MB on smollm2) fit in the memory budget. A decode step is faster with
        them (:mod:`.row_invariant`); without them sampling holds no second copy of the model."""
        if self.pack_budget is None:
            return True
        if self._copy_bytes is None:
            model = self.model_of()
            weights = [base_of(getattr(p, n)).weight for p, names in self.bundles(model) for n in names]
            self._copy_bytes = sum(w.numel() * w.element_size() for w in weights)
        return self._copy_bytes <= self.pack_budget()

    def copy_bytes(self) -> int | None:
        """Bytes all prepacked copies of the base weights take (None until :meth:`packs` measured it)."""
        return self._copy_bytes

    def planned(self, adapter: str) -> bool:
        """Whether ``adapter``'s decode plan is made and kept."""
        return adapter in self._plans

    def keep_only(self, keep: set[str]) -> None:
        """Drop the plans of adapters not in ``keep``."""
        self._changing()
        self._plans = {adapter: plan for adapter, plan in self._plans.items() if adapter in keep}

    def forget(self, adapter: str) -> None:
        """Drop ``adapter``'s plan."""
        self._changing()
        self._plans.pop(adapter, None)

    def merges_lora(self) -> bool:
        """Whether adapters' plans are merged weights (:mod:`.lora_plans`): for an fp32 base model on
        CPU with oneDNN, where the copy budget holds two copies of the base weights (the base copies and
        one adapter's merged plan). Decided on first use (unless
        :attr:`merge_lora` was set) and kept for the engine's life, so a request's arithmetic never
        depends on what else is sampling."""
        if self.merge_lora is None:
            weight = self.model_of().model.embed_tokens.weight
            room = self.packs() and (self.pack_budget is None or 2 * self._copy_bytes <= self.pack_budget())
            fp32_cpu = weight.dtype == torch.float32 and weight.is_cpu
            self.merge_lora = bool(fp32_cpu and onednn.available() and room)
        return self.merge_lora

    def adapter_slots(self) -> int | None:
        """How many adapters' merged plans the copy budget holds beside the base copies (at least
        one): the decode batch admits requests of at most this many adapters at once. None: no
        limit (plans of LoRA terms are small)."""
        if not self.merges_lora() or self.pack_budget is None:
            return None
        return max(1, self.pack_budget() // max(self._copy_bytes or 1, 1) - 1)

    def group_plans(self, model, groups: Groups) -> list:
        """``(rows, plan)`` for each group of rows: its adapter's plan; base-model rows (plan None)
        are listed too where plans are merged (they then run apart from the adapters' rows)."""
        merged = self.merges_lora()
        return [
            (rows, self.plan(model, adapter) if adapter is not None else None)
            for adapter, rows in groups
            if adapter is not None or merged
        ]

    def made(self, model, adapter: str) -> tuple:
        """What ``adapter``'s plan (made now if it is not kept) was made from: its form and its
        weights' versions."""
        self.plan(model, adapter)
        return self._plans[adapter].made

    def plan(self, model, adapter: str) -> list:
        """Per layer, per bundle, the adapter's merged matmuls or :class:`~.lora_plans.Terms` (or
        None); last, the lm_head's. Made again when any of the adapter's weights changed (a training
        session's after optim_step); merged plans beyond :meth:`adapter_slots` go, oldest first."""
        cached = self._plans.pop(adapter, None)
        if cached is not None and cached.holds(model, adapter, self.merges_lora()):
            self._plans[adapter] = cached  # the most recently used last (threads included)
            return cached.plan
        cached = None  # its copies go before the new ones are made
        self._changing()
        modules = [m for m in model.modules() if hasattr(m, "lora_A") and adapter in m.lora_A]
        live = {a for m in modules[:1] for a in m.lora_A}
        self._plans = {a: p for a, p in self._plans.items() if a in live}
        slots = self.adapter_slots()  # the oldest go before the new copies are made
        while slots is not None and len(self._plans) >= slots:
            self._plans.pop(next(iter(self._plans)))
        if self.merges_lora():
            largest = max(
                sum(base_of(getattr(parent, name)).weight.numel() for name in names)
                for parent, names in self.bundles(model)
            )
            make = functools.partial(merged_of, scratch=torch.empty(largest, dtype=torch.float32))
        else:
            make = terms_of
        made = [make(parent, names, adapter) for parent, names in self.bundles(model)]
        plan = [made[i : i + len(BUNDLES)] for i in range(0, len(made) - 1, len(BUNDLES))] + made[-1:]
        if count(plan) != len(modules):
            raise RuntimeError(f"adapter {adapter}: LoRA on modules the lean decoder does not cover")
        anchor = modules[0] if modules else model
        first = next(name for name, m in model.named_modules() if m is anchor)
        layers = lora_layers(modules, adapter)
        self._plans[adapter] = Kept(plan, first, anchor, layers, (self.merges_lora(), versions(layers)))
        return plan

    def _changing(self) -> None:
        if self.on_change is not None:
            self.on_change()

    @staticmethod
    def bundles(model) -> list:
        """``(parent, names)`` of every bundle of projections in model order, the lm_head last."""
        bundles = [
            (parent, names)
            for layer in model.model.layers
            for parent, names in zip((layer.self_attn, layer.self_attn, layer.mlp, layer.mlp), BUNDLES)
        ]
        return bundles + [(model, ("lm_head",))]
