"""Batched forward passes: per-token logprobs of right-padded datum batches and of prompts.

``chunks`` splits a batch into micro-batches whose padded logits stay under ``LOGITS_BUDGET``
floats, so a long batch never needs all its logits in memory at once (the losses are token sums,
so backward per micro-batch gives the same gradients).
"""

from __future__ import annotations

import torch

from .decoding import prompt_logprobs_from
from .types import Datum

LOGITS_BUDGET = 1 << 27  # floats of logits per micro-batch: bounds memory on long batches


def chunks(datums: list[Datum], token_budget: int) -> list[list[int]]:
    """Group datum indices so each padded micro-batch holds at most ``token_budget`` positions."""
    chunks, current, width = [], [], 0
    for i, datum in enumerate(datums):
        wider = max(width, datum.model_input.length)
        if current and wider * (len(current) + 1) > token_budget:
            chunks.append(current)
            current, wider = [], datum.model_input.length
        current.append(i)
        width = wider
    if current:
        chunks.append(current)
    return chunks


def token_logprobs(model, datums: list[Datum], targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """log p(target_i | input_0..i) for each datum, right-padded into one batch."""
    device = next(model.parameters()).device
    lengths = [d.model_input.length for d in datums]
    width = max(lengths)
    ids = torch.zeros(len(datums), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(datums), width, dtype=torch.long, device=device)
    tgt = torch.zeros(len(datums), width, dtype=torch.long, device=device)
    for row, (datum, target) in enumerate(zip(datums, targets)):
        ids[row, : lengths[row]] = torch.tensor(datum.model_input.to_ints(), device=device)
        mask[row, : lengths[row]] = 1
        tgt[row, : lengths[row]] = target.to(device=device, dtype=torch.long)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = logits.gather(-1, tgt[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return [lp[row, :n] for row, n in enumerate(lengths)]


def prompt_logprobs(model, prompt: list[int], topk: int | None):
    with torch.no_grad():
        device = next(model.parameters()).device
        logits = model(input_ids=torch.tensor([prompt], device=device)).logits[0].float()
        return prompt_logprobs_from(logits, prompt, topk or 0)
