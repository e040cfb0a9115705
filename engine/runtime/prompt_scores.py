"""A sample request's scores beyond the sampled tokens' own logprobs, from forward passes of the model
it samples: the top-k of every sampled position (``topk_sample_logprobs``), chosen ids' logprobs at
prompt positions (``target_prompt_logprobs``), independent draws from each prompt position's
next-token distribution (``prompt_alt_tokens_k``), and prompt logprobs kept for the last N prompt
tokens only (``prompt_logprobs_last_n``).

Every value is a logprob of the model's own distribution (temperature 1, no top-k or top-p), from the
same forward pass and output-layer chunks as ``compute_logprobs`` (:func:`.batched_forward.prompt_logprobs`),
so the two agree; only the draws of ``prompt_alt_tokens_k`` use the request's temperature.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from sess.engine.protocol import requests as rq
from sess.engine.protocol.types import SampleResponse
from sess.engine.runtime.output_layer import chunk_rows, decoder_and_head, logits_of, output_size


def next_token_logprobs(
    model, tokens: list[int], first: int, budget: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(position, logprobs [rows x vocabulary]) chunks for positions ``first`` .. len(tokens) - 1: row r
    is the distribution of the token at ``position + r`` given the tokens before it."""
    decoder, head, cap = decoder_and_head(model)
    with torch.no_grad():
        device = decoder.get_input_embeddings().weight.device
        hidden = decoder(input_ids=torch.tensor([tokens], device=device), use_cache=False).last_hidden_state[
            0
        ]
        step = chunk_rows(output_size(head), budget)
        for start in range(first - 1, len(tokens) - 1, step):
            stop = min(start + step, len(tokens) - 1)
            yield start + 1, logits_of(head, hidden[start:stop], cap).log_softmax(-1)


def wants_scores(request: rq.SampleRequest) -> bool:
    """Whether the request asks for anything :func:`add_scores` computes."""
    return bool(request.topk_sample_logprobs or request.target_prompt_logprobs or request.prompt_alt_tokens_k)


def add_scores(model, request: rq.SampleRequest, response: SampleResponse, budget: int) -> None:
    """Fill in what ``request`` asks beyond the sampled tokens, through ``model`` (its adapter active)."""
    prompt = request.prompt
    if request.topk_sample_logprobs:
        for sequence in response.sequences:
            rows: list[list[tuple[int, float]]] = []
            for _, logp in next_token_logprobs(model, prompt + sequence.tokens, len(prompt), budget):
                values, ids = logp.topk(min(request.topk_sample_logprobs, logp.shape[-1]), dim=-1)
                rows += [list(zip(i.tolist(), v.tolist())) for i, v in zip(ids, values)]
            sequence.topk_logprobs = rows
    if request.target_prompt_logprobs or request.prompt_alt_tokens_k:
        targets, alt_tokens, alt_logprobs = [], [], []
        generator = torch.Generator().manual_seed(request.sampling_params.seed or 0)
        seeded = request.sampling_params.seed is not None
        for position, logp in next_token_logprobs(model, prompt, 1, budget):
            if request.target_prompt_logprobs:
                ids = torch.tensor(
                    request.target_prompt_logprobs[position - 1 : position - 1 + logp.shape[0]]
                )
                picked = logp.gather(-1, ids.clamp(min=0).to(logp.device))
                targets += torch.where(ids.to(logp.device) < 0, 0.0, picked).tolist()
            if request.prompt_alt_tokens_k:
                drawn = _draws(
                    logp,
                    request.prompt_alt_tokens_k,
                    request.sampling_params.temperature,
                    generator if seeded else None,
                )
                alt_tokens += drawn.tolist()
                alt_logprobs += logp.gather(-1, drawn.to(logp.device)).tolist()
        if request.target_prompt_logprobs:
            response.target_prompt_logprobs = targets
        if request.prompt_alt_tokens_k:
            response.prompt_alt_tokens = {"tokens": alt_tokens, "logprobs": alt_logprobs}


def _draws(logp: torch.Tensor, k: int, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """``k`` ids per row, with replacement, from ``softmax(logits / temperature)`` (0: the argmax)."""
    if temperature == 0:
        return logp.argmax(-1, keepdim=True).expand(-1, k).cpu()
    probs = torch.softmax(logp.float().cpu() / temperature, dim=-1)
    return torch.multinomial(probs, k, replacement=True, generator=generator)


def keep_last_n(values: list | None, last_n: int | None) -> list | None:
    """``values`` with every entry before the last ``last_n`` set to None (``prompt_logprobs_last_n``)."""
    if values is None or last_n is None:
        return values
    cut = len(values) - last_n
    return [None] * cut + list(values[cut:])
