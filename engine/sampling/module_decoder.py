"""Decoding through the model's own modules, one request at a time: every other architecture.

Models the lean decoder does not compute exactly (gpt_oss with its sliding windows, llama configs
with attention bias or rope scaling, any other architecture) decode here, through transformers' and
peft's own forward with transformers' own cache and attention. A request's samples share its
prompt's prefill and decode together; requests take turns, so no request ever shares a batch with
another and its tokens and logprobs do not depend on what else is in flight. Correct for any model
transformers runs; slower than the lean decoder, which merges requests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicCache

from sess.engine.sampling.decoder import Prefill

Activate = Callable[[str | None], contextlib.AbstractContextManager[torch.nn.Module]]


class ModuleCache:
    """transformers' cache of one request's sample rows."""

    def __init__(self, cache: DynamicCache):
        self.cache = cache

    def keep(self, rows: torch.Tensor, width: int) -> None:
        self.cache.batch_select_indices(rows)

    def append(self, other: ModuleCache) -> None:
        raise RuntimeError("the module decoder runs one request at a time")


class ModuleDecoder:
    """``activate(adapter)`` gives the model to call with that adapter active (None: the base)."""

    merges = False

    def __init__(self, activate: Activate):
        self.activate = activate

    def adapter_slots(self) -> None:
        """No limit: one request decodes at a time, through peft's own modules."""
        return None

    @torch.no_grad()
    def prefill(self, jobs: list) -> Prefill:
        (job,) = jobs
        with self.activate(job.adapter) as model:
            device = next(model.parameters()).device
            out = model(
                input_ids=torch.tensor([job.prompt], device=device),
                cache=DynamicCache(config=model.config),
                use_cache=True,
                logits_to_keep=0 if job.prompt_logprobs else 1,
            )
        cache = out.cache
        if job.num_samples > 1:
            cache.batch_select_indices(torch.zeros(job.num_samples, dtype=torch.long, device=device))
        logits = out.logits[0]
        return Prefill(ModuleCache(cache), logits[-1:], logits if job.prompt_logprobs else None)

    @torch.no_grad()
    def step(
        self, cache: ModuleCache, adapters: list[str | None], tokens: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        with self.activate(adapters[0]) as model:
            out = model(
                input_ids=tokens[:, None], position_ids=positions[:, None], cache=cache.cache, use_cache=True
            )
        cache.cache = out.cache
        return out.logits[:, -1]
