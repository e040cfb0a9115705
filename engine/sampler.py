"""Batched autoregressive sampling with a KV cache.

A request's prompt is prefilled once; its cache is then repeated for the ``num_samples`` rows that
decode together. Every sampled token carries the model's own (temperature 1, untruncated)
log-probability, so it equals what ``forward`` computes for the same tokens: temperature, top-k and
top-p shape what is drawn, not what is reported, and on-policy importance ratios are exactly 1.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from .types import SampledSequence, SamplingParams


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of ``logits`` (rows, vocab) under temperature / top-k / top-p."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = scaled.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class StopChecker:
    """Decides when a row is done: an EOS / stop token id, or a stop string in the decoded tail."""

    def __init__(self, stop: str | Sequence[str] | Sequence[int] | None, eos_ids: set[int], decode: Callable):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop_ids = set(eos_ids) | {s for s in stops if isinstance(s, int)}
        self.stop_strings = [s for s in stops if isinstance(s, str) and s]
        self.window = 2 * max((len(s) for s in self.stop_strings), default=0) + 4
        self.decode = decode

    def done(self, tokens: list[int]) -> bool:
        if tokens[-1] in self.stop_ids:
            return True
        if self.stop_strings:
            tail = self.decode(tokens[-self.window :])
            return any(s in tail for s in self.stop_strings)
        return False


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt: list[int],
    num_samples: int,
    params: SamplingParams,
    *,
    eos_ids: set[int],
    decode: Callable[[list[int]], str],
) -> list[SampledSequence]:
    """Sample ``num_samples`` continuations of ``prompt`` from ``model`` (already on its adapter)."""
    device = next(model.parameters()).device
    generator = make_generator(params.seed, device)
    stopper = StopChecker(params.stop, eos_ids, decode)
    cache = DynamicCache(config=getattr(model, "config", None))
    input_ids = torch.tensor([prompt], device=device)
    out = model(input_ids=input_ids, cache=cache, use_cache=True)
    cache = out.cache
    if num_samples > 1:
        cache.batch_repeat_interleave(num_samples)
    logits = out.logits[:, -1, :].float().expand(num_samples, -1)

    tokens: list[list[int]] = [[] for _ in range(num_samples)]
    logprobs: list[list[float]] = [[] for _ in range(num_samples)]
    reasons = ["length"] * num_samples
    alive = list(range(num_samples))  # row r of the live batch is sample alive[r]
    for step in range(params.max_tokens):
        chosen = next_tokens(logits, params, generator)
        chosen_lp = logits.log_softmax(dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
        keep = []
        for row, sample_index in enumerate(alive):
            tokens[sample_index].append(int(chosen[row]))
            logprobs[sample_index].append(float(chosen_lp[row]))
            if stopper.done(tokens[sample_index]):
                reasons[sample_index] = "stop"
            else:
                keep.append(row)
        if not keep or step == params.max_tokens - 1:
            break
        if len(keep) < len(alive):
            cache.batch_select_indices(torch.tensor(keep, device=device))
            chosen = chosen[keep]
            alive = [alive[row] for row in keep]
        out = model(input_ids=chosen[:, None], cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[:, -1, :].float()
    return [
        SampledSequence(tokens=t, logprobs=lp, stop_reason=r) for t, lp, r in zip(tokens, logprobs, reasons)
    ]
