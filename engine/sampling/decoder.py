"""What the decode batch needs of a decoder: a prefill of new prompts and a step for every row.

Two decoders implement it: :class:`~.llama_decoder.LlamaDecoder` (llama-family models, every
request merged into one batch) and :class:`~.module_decoder.ModuleDecoder` (any other model, one
request at a time through its own modules). The engine picks one per base model when it loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class Prefill:
    """What a prefill hands the decode batch: a cache with one row per sample (in job order), each
    prompt's last-position logits [prompts, vocab], and (when asked) the first prompt's logits at
    every position [prompt length, vocab]."""

    cache: Any  # the decoder's own cache; it can keep(rows, width) and append(other)
    last_logits: torch.Tensor
    prompt_logits: torch.Tensor | None = None


class Decoder(Protocol):
    merges: bool  # whether requests share one batch (else one request decodes at a time)

    def prefill(self, jobs: list) -> Prefill:
        """Run the prompts of ``jobs`` (SampleJob: prompt, num_samples, adapter, prompt_logprobs);
        a job that wants prompt logprobs comes alone."""
        ...

    def step(
        self, cache: Any, adapters: list[str | None], tokens: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Logits [rows, vocab] of one new token per row (row ``r`` through ``adapters[r]``, at
        cache column ``positions[r]``)."""
        ...

    def adapter_slots(self) -> int | None:
        """How many adapters' requests may decode at once (None: any number)."""
        ...


def full_attention_only(model: torch.nn.Module) -> bool:
    """Whether every attention layer of ``model`` sees all earlier positions (no sliding window):
    then a prefix's KV cache, computed once, serves every sequence that starts with it."""
    config = (
        model.config.get_text_config(decoder=True)
        if hasattr(model.config, "get_text_config")
        else model.config
    )
    layer_types = getattr(config, "layer_types", None) or []
    if not getattr(config, "sliding_window", None):
        return True
    return bool(layer_types) and all(t == "full_attention" for t in layer_types)
