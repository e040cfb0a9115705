"""Logprobs through the output layer in chunks of positions: no [tokens x vocabulary] logits held.

A training forward runs the model's decoder to its final (normed) hidden states and stops there;
the output layer (the model's ``lm_head``, LoRA included when the adapter trains it) then runs over
chunks of positions whose logits fit in a share of the engine's memory budget (:func:`chunk_rows`):
a micro-batch whose logits fit runs as one chunk, as fast as the unchunked pass (smaller chunks
cost the output layer's matmuls their efficiency: on smollm2 with its 49k vocabulary, 16 MB chunks
made training ~10 % slower). Each chunk's logits exist only while the chunk is
worked on: the logprobs of its targets are kept, and with a backward pass the loss's gradient with
respect to those logprobs goes through the output layer at once, which leaves the gradient with
respect to the chunk's hidden states ([positions x hidden], small) and adds the output layer's
LoRA gradients. The decoder's backward then runs from the hidden states (:func:`backward_from`).

The gradient with respect to a chunk's logprobs must be known while its logits are alive. For the
token-sum losses it is (``dloss/dlp_i`` depends on token ``i`` alone: :func:`token_loss_grad`);
any other loss gets it in two passes: the logprobs first, then the loss's gradient over the whole
micro-batch, then the chunks again with that gradient (one more pass of the output layer).

A logprob is a pair (hidden row, target): rows that several datums share (an RL group's prompt)
are computed once and read by each datum with its own target, as the shared-prefix forward
(:mod:`.batched_forward`) lays them out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LOGITS_SHARE = 0.5  # of the memory budget, for a chunk's logits (the decoder's activations use the budget)
BYTES_PER_LOGIT = 12  # a chunk holds fp32 logits, their log-softmax and, training, its gradient
MAX_CHUNK_BYTES = 1 << 30  # bounds the logits where the budget is tens of GB (a GPU's half of free memory)
CHUNK_LOGITS: int | None = None  # a fixed chunk size in logits instead (None: from the budget)
MIN_CHUNK_ROWS = 64  # fewer rows per matmul than this waste the output layer's time on big vocabularies

LossGrad = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logprobs, pair indices) -> dloss/dlp


@dataclass
class Pairs:
    """The logprobs a micro-batch asks for: pair ``p`` is row ``rows[p]`` of the hidden states and
    token ``targets[p]``; datum ``d``'s positions are the pairs ``spans[d]`` in order."""

    hidden: torch.Tensor  # [unique rows, hidden size], with the decoder's graph when training
    rows: torch.Tensor  # [pairs] long
    targets: torch.Tensor  # [pairs] long
    spans: list[slice]


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, float | None]:
    """The model's decoder (input ids to final hidden states), its output layer, and its final logit
    soft-cap (None: none). Through peft, both run with the active adapter's LoRA layers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    cap = getattr(config, "final_logit_softcapping", None)
    return base.get_decoder(), base.get_output_embeddings(), cap


def chunk_rows(vocab_size: int, budget: int) -> int:
    """Positions per output-layer chunk under a memory budget of ``budget`` bytes."""
    logits = CHUNK_LOGITS or int(min(budget * LOGITS_SHARE, MAX_CHUNK_BYTES)) // BYTES_PER_LOGIT
    return max(MIN_CHUNK_ROWS, logits // vocab_size)


def logits_of(head: torch.nn.Module, hidden: torch.Tensor, cap: float | None) -> torch.Tensor:
    """fp32 logits of ``hidden`` (as the model's causal-LM forward computes them, then in fp32)."""
    logits = head(hidden).float()
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def logprobs(
    head: torch.nn.Module,
    cap: float | None,
    pairs: Pairs,
    budget: int,
    *,
    loss_grad: LossGrad | None = None,
    grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each pair's logprob [pairs] (detached), chunk by chunk over the hidden rows (chunks sized by
    the memory budget ``budget``).

    With ``loss_grad`` (the loss's gradient from a chunk's logprobs) or ``grad`` (the gradient of
    every pair, known before), the gradient also goes back through the output layer chunk by chunk:
    its LoRA weights accumulate theirs, and the gradient with respect to ``pairs.hidden`` is
    returned for :func:`backward_from`."""
    hidden, rows, targets = pairs.hidden, pairs.rows, pairs.targets
    backward = loss_grad is not None or grad is not None
    order = torch.argsort(rows, stable=True)
    sorted_rows = rows[order]
    step = chunk_rows(output_size(head), budget)
    edges = torch.searchsorted(sorted_rows, torch.arange(0, hidden.shape[0] + step, step, device=rows.device))
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device)
    hidden_grad = torch.zeros_like(hidden) if backward else None
    for chunk, start in enumerate(range(0, hidden.shape[0], step)):
        lo, hi = int(edges[chunk]), int(edges[chunk + 1])
        if lo == hi:
            continue
        pick = order[lo:hi]
        x = hidden[start : start + step].detach()
        if backward:
            x.requires_grad_(True)
        with torch.set_grad_enabled(backward):
            lsm = logits_of(head, x, cap).log_softmax(-1)
            chosen = lsm[sorted_rows[lo:hi] - start, targets[pick]]
            if backward:
                g = loss_grad(chosen.detach(), pick) if loss_grad is not None else grad[pick]
                torch.autograd.backward(chosen, g.to(chosen.dtype))
                hidden_grad[start : start + step] = x.grad
        out[pick] = chosen.detach()
        del lsm, chosen
    return out, hidden_grad


def output_size(head: torch.nn.Module) -> int:
    """The output layer's vocabulary (a peft LoRA layer keeps the original as ``base_layer``)."""
    return int(getattr(head, "base_layer", head).out_features)


def backward_from(hidden: torch.Tensor, hidden_grad: torch.Tensor) -> None:
    """The decoder's backward pass from its hidden states' gradient (the output layer's is done)."""
    if hidden.requires_grad:
        torch.autograd.backward(hidden, hidden_grad)


def token_loss_grad(
    loss: Callable[[list[torch.Tensor], list[dict[str, torch.Tensor]]], torch.Tensor],
    inputs: dict[str, torch.Tensor],
) -> LossGrad:
    """The gradient of a token-sum loss with respect to any subset of its logprobs: ``inputs`` holds
    each per-token input for every pair (``inputs[k][p]``), and ``loss(logprobs, inputs)`` is the
    loss over the pairs given."""

    def grad(lp: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
        leaf = lp.detach().requires_grad_(True)
        with torch.enable_grad():
            value = loss([leaf], [{k: v[pick] for k, v in inputs.items()}])
            (g,) = torch.autograd.grad(value, leaf, allow_unused=True)
        return torch.zeros_like(leaf) if g is None else g

    return grad
