"""One base model in memory with any number of LoRA adapters on it (peft multi-adapter).

Sessions and loaded checkpoints are adapters of one ``PeftModel`` wrapped around the shared base
weights; an op activates its adapter, so no base weight is ever copied. Adapter state moves in and
out as PEFT state dicts (the keys ``adapter_model.safetensors`` uses), and a merged model is computed
from the base weights plus each layer's delta without touching the shared weights. The host picks
its base model's decoder for sampling (:mod:`sess.engine.sampling`): the lean llama decoder where it
computes the model exactly, the model's own modules otherwise. Nothing here changes a library's
classes or globals: peft wraps this host's own model instance, and that is all.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from sess.engine.runtime import recompute
from sess.engine.runtime.memory.training_budget import ActivationCost, measure_cost, transformer_layers
from sess.engine.runtime.models.catalog import load_model, lora_targets
from sess.engine.runtime.output_layer import decoder_and_head
from sess.engine.runtime.session import flat_views
from sess.engine.sampling.decoder import Decoder, full_attention_only
from sess.engine.sampling.llama_decoder import LlamaDecoder, unsupported
from sess.engine.sampling.module_decoder import ModuleDecoder


class ModelHost:
    def __init__(
        self,
        name: str,
        home: Path,
        device: str,
        max_checkpoint_adapters: int = 8,
        dtype: torch.dtype = torch.float32,
        memory_budget: Callable[[], int] | None = None,
        copy_budget: Callable[[], int] | None = None,
    ):
        """``memory_budget()``: the training budget; ``copy_budget()``: the bytes the sampler's
        prepacked weight copies may take (None: the training budget)."""
        self.name = name
        self.dtype = dtype
        self.model, self.tokenizer, self.path = load_model(name, home=home, device=device, dtype=dtype)
        self.model.requires_grad_(False)
        recompute.prepare(self.model)  # training keeps recipes for cheap activations (recompute.py)
        self.layers = len(transformer_layers(self.model))
        _page_in(self.model)
        self._activation_cost: ActivationCost | None = None
        self.peft: PeftModel | None = None
        self.checkpoint_adapters: OrderedDict[str, str] = OrderedDict()  # checkpoint uri -> adapter name
        self.pinned: Callable[[], set[str]] = set  # adapters in use by running sample requests
        self.max_checkpoint_adapters = max_checkpoint_adapters
        # released checkpoint adapters kept for reuse: adapter name -> its LoRA layout (_layout)
        self.spare_adapters: dict[str, str] = {}
        self.max_spare_adapters = 1  # an RL loop's next sampler save reuses the one it released
        config = self.model.config
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        eos = getattr(self.model.generation_config, "eos_token_id", None) or config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = set(eos)
        # sliding-window layers crop their cache, so a repeated prefix cache is only exact without them
        self.shares_prefixes = full_attention_only(self.model)
        self._checkpoint_counter = 0
        # why the lean decoder does not apply (None: it does)
        self.lean_unsupported = unsupported(self.model)
        self.decoder: Decoder = (
            ModuleDecoder(self.activate)
            if self.lean_unsupported
            else LlamaDecoder(lambda: self.model, pack_budget=copy_budget or memory_budget)
        )

    # memory -------------------------------------------------------------------------------------
    def activation_cost(self, model: torch.nn.Module) -> ActivationCost:
        """What a training position holds (measured once, through ``model`` with its adapter)."""
        if self._activation_cost is None:
            decoder, _, _ = decoder_and_head(model)
            self._activation_cost = measure_cost(model, decoder, self.vocab_size)
        return self._activation_cost

    def release_sampling_memory(self) -> None:
        """Drop what only sampling uses and the decoder makes again on demand (its prepacked copies
        of the base weights, as large as the weights themselves, and the LoRA plans of adapters no
        running request samples from)."""
        release = getattr(self.decoder, "release_memory", None)
        if release is not None:
            release(keep=self.pinned())

    # adapters -----------------------------------------------------------------------------------
    def lora_config(
        self, rank: int, alpha: float, train_attn: bool, train_mlp: bool, train_unembed: bool
    ) -> LoraConfig:
        targets = lora_targets(
            self.model, train_attn=train_attn, train_mlp=train_mlp, train_unembed=train_unembed
        )
        return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", **targets)

    def add_adapter(self, adapter: str, config: LoraConfig, seed: int) -> None:
        """Create ``adapter`` with LoRA A drawn from ``seed`` (B starts at zero, as LoRA does)."""
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # the engine never re-ties weights or checkpoints activations: these notices are noise
            warnings.filterwarnings("ignore", message=".*ensure_weight_tying.*")
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            torch.manual_seed(seed)
            if self.peft is None:
                self.peft = get_peft_model(self.model, config, adapter_name=adapter)
            else:
                self.peft.add_adapter(adapter, config)
        self.peft.eval()  # new LoRA modules start in training mode; dropout is 0 but peft checks the flag
        self.peft.base_model_name_or_path = str(self.path)

    def remove_adapter(self, adapter: str) -> None:
        forget = getattr(self.decoder, "forget", None)  # the decoder's plan of it, if it keeps one
        if forget is not None:
            forget(adapter)
        if self.peft is None or adapter not in self.peft.peft_config:
            return
        if len(self.peft.peft_config) == 1:
            # peft cannot run with zero adapters; unloading restores the untouched base modules.
            self.model = self.peft.unload()
            self.peft = None
            self.checkpoint_adapters.clear()
            self.spare_adapters.clear()
        else:
            if self.peft.active_adapter == adapter:
                other = next(a for a in self.peft.peft_config if a != adapter)
                self.peft.set_adapter(other)
            self.peft.delete_adapter(adapter)
        self.spare_adapters.pop(adapter, None)

    def adapter_params(self, adapter: str) -> dict[str, torch.nn.Parameter]:
        marker = f".{adapter}."
        return {n: p for n, p in self.peft.named_parameters() if marker in n}

    def get_state(self, adapter: str) -> dict[str, torch.Tensor]:
        state = get_peft_model_state_dict(self.peft, adapter_name=adapter, save_embedding_layers=False)
        return {k: v.detach().clone() for k, v in state.items()}

    def set_state(self, adapter: str, state: dict[str, torch.Tensor]) -> None:
        device = next(self.peft.parameters()).device
        result = set_peft_model_state_dict(
            self.peft, {k: v.to(device) for k, v in state.items()}, adapter_name=adapter
        )
        missing = [k for k in result.missing_keys if f".{adapter}." in k and "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"adapter weights do not fit this session's LoRA layout "
                f"(missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})"
            )

    def adapter_config(self, adapter: str) -> dict:
        config = self.peft.peft_config[adapter].to_dict()
        config["base_model_name_or_path"] = str(self.path)
        for key, value in list(config.items()):
            if isinstance(value, set):
                config[key] = sorted(value)
        return config

    def checkpoint_adapter(self, uri: str, state: dict[str, torch.Tensor], config: dict) -> str:
        """An adapter holding a checkpoint's weights, kept in an LRU of ``max_checkpoint_adapters``.

        A released adapter of the same LoRA layout is reused (its weights overwritten) rather than
        a new one built: peft takes ~0.25 s on smollm2 to add an adapter, and an RL loop loads a
        new sampler every step."""
        if uri in self.checkpoint_adapters:
            self.checkpoint_adapters.move_to_end(uri)
            return self.checkpoint_adapters[uri]
        layout = _layout(config)
        adapter = next((a for a, key in self.spare_adapters.items() if key == layout), None)
        if adapter is not None:
            del self.spare_adapters[adapter]
        else:
            self._checkpoint_counter += 1
            adapter = f"ckpt{self._checkpoint_counter}"
            keys = {f.name for f in LoraConfig.__dataclass_fields__.values()}
            lora = LoraConfig(
                **{k: v for k, v in config.items() if k in keys and k not in ("peft_type", "task_type")}
            )
            self.add_adapter(adapter, lora, seed=0)
        self._hold_weights(adapter)
        try:
            self.set_state(adapter, state)
        except BaseException:
            self._spare(adapter, layout)  # its weights are overwritten before any use
            raise
        self.peft.base_model_name_or_path = str(self.path)
        self.checkpoint_adapters[uri] = adapter
        pinned = self.pinned()
        for old_uri in [u for u, a in self.checkpoint_adapters.items() if a not in pinned and a != adapter]:
            if len(self.checkpoint_adapters) <= self.max_checkpoint_adapters:
                break
            self.release_checkpoint(old_uri)
        return adapter

    def release_checkpoints(self, uris: list[str]) -> set[str]:
        """:meth:`release_checkpoint` each of ``uris`` that no running or waiting request samples
        from; returns those that one does (they stay)."""
        in_use = self.pinned()
        kept = {uri for uri in uris if self.checkpoint_adapters.get(uri) in in_use}
        for uri in uris:
            if uri not in kept:
                self.release_checkpoint(uri)
        return kept

    def release_checkpoint(self, uri: str) -> None:
        """Stop serving ``uri`` from memory; its adapter is kept for reuse (a few at most). The
        caller makes sure no running request samples from it."""
        adapter = self.checkpoint_adapters.pop(uri, None)
        if adapter is not None and self.peft is not None and adapter in self.peft.peft_config:
            self._spare(adapter, _layout(self.adapter_config(adapter)))

    def _spare(self, adapter: str, layout: str) -> None:
        """Keep ``adapter``'s modules for reuse, without its weights (:meth:`_hold_weights` gives it
        new ones): a spare costs no memory while the engine trains."""
        for param in self.adapter_params(adapter).values():
            param.data = param.new_zeros(1).expand(param.shape)  # the shape, in 4 bytes
        self.spare_adapters[adapter] = layout
        self._trim_spares()

    def _hold_weights(self, adapter: str) -> None:
        """Give checkpoint adapter ``adapter``'s weights one buffer of their own, with what they hold
        (a spare's hold nothing yet). Its ~400 small tensors would land in the holes that a training
        step leaves in the heap and keep them from the next one; one buffer is mapped on its own and
        goes back whole when the adapter is released."""
        params = list(self.adapter_params(adapter).values())
        if not params or len({(p.dtype, p.device) for p in params}) > 1:
            return
        flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        for param, view in zip(params, flat_views(flat, params)):
            param.data = view.copy_(param.data)

    def _trim_spares(self) -> None:
        while len(self.spare_adapters) > self.max_spare_adapters:
            adapter = next(iter(self.spare_adapters))
            del self.spare_adapters[adapter]
            self.remove_adapter(adapter)

    def forget_checkpoint(self, uri: str) -> None:
        adapter = self.checkpoint_adapters.pop(uri, None)
        if adapter is not None:
            self.remove_adapter(adapter)

    @contextlib.contextmanager
    def activate(self, adapter: str | None) -> Iterator[torch.nn.Module]:
        """The model to call with ``adapter`` active, or the plain base model for ``None``."""
        if adapter is None:
            if self.peft is None:
                yield self.model
            else:
                with self.peft.disable_adapter():
                    yield self.peft
            return
        if self.peft.active_adapter != adapter:
            self.peft.set_adapter(adapter)
        yield self.peft

    # merged models ------------------------------------------------------------------------------
    def merged_state(
        self, adapter: str, whole: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """Base weights with ``adapter``'s deltas added, under the plain transformers key names.
        ``whole`` makes a base weight whole (an engine of several ranks gathers its shards; the
        adapter's own modules must hold whole weights already).

        Returns the state and whether the output embedding must be untied (it took a delta)."""
        base = self.peft.get_base_model()
        deltas: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for module_name, module in base.named_modules():
                if not isinstance(module, BaseTunerLayer) or adapter not in getattr(module, "lora_A", {}):
                    continue
                parameter_name = getattr(module, "parameter_name", None) or "weight"
                key = f"{module_name}.{parameter_name}"
                deltas[key] = module.get_delta_weight(adapter).detach()
        state: dict[str, torch.Tensor] = {}
        for key, tensor in base.state_dict().items():
            if "lora_" in key:
                continue
            clean = key.replace(".base_layer", "")
            state[clean] = whole(tensor.detach()).clone()
        for key, delta in deltas.items():
            clean = key.replace(".base_layer", "")
            state[clean] = state[clean] + delta.to(state[clean].dtype)
        untie = False
        if getattr(base.config, "tie_word_embeddings", False):
            output_key = next((k for k in deltas if k.replace(".base_layer", "").startswith("lm_head")), None)
            untie = output_key is not None
            if not untie:
                state.pop("lm_head.weight", None)
        return state, untie


def _page_in(model: torch.nn.Module) -> None:
    """Read every weight once, so a loaded model is in memory rather than mapped from its file on
    first use (safetensors loads lazily): the first request pays no disk reads, and RSS after
    loading is the model's true footprint."""
    with torch.no_grad():
        for param in model.parameters():
            if param.device.type == "cpu" and param.numel():
                param.view(-1)[:: max(1, 4096 // param.element_size())].sum()


def _layout(config: dict) -> str:
    """What must match for one adapter's modules to hold another's weights: the LoRA config minus
    names and paths."""
    skip = {"base_model_name_or_path", "revision", "inference_mode", "peft_type", "task_type"}
    return json.dumps({k: v for k, v in config.items() if k not in skip}, sort_keys=True, default=str)
