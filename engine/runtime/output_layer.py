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
A chunk holds at most two tensors of its logits' size (:class:`ChosenLogprobs`, :func:`logits_of`),
where the model's modules, ``log_softmax`` and autograd held three, with the same bits.

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
import torch.nn.functional as F

from sess.engine.libraries import torch_internals

LOGITS_SHARE = 1 / 4  # of the memory budget, for a chunk's logits; the decoder's activations get the rest
# a chunk holds its fp32 logits (the backward pass makes them their own gradient) and, with a LoRA on
# the output layer, one more tensor of their size: the LoRA term, then the gradient scaled for it
BYTES_PER_LOGIT = 8
LSE_ROWS = 16  # rows of a chunk whose log-softmax (and its gradient) exist at once
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


def chunk_bytes(budget: int) -> int:
    """What an output-layer chunk may hold under a memory budget of ``budget`` bytes."""
    return int(min(budget * LOGITS_SHARE, MAX_CHUNK_BYTES))


def activation_budget(budget: int) -> int:
    """What a micro-batch's activations may hold: the budget less an output-layer chunk, which
    exists beside them (so a training op's working memory stays within ``budget``)."""
    return budget - chunk_bytes(budget)


def chunk_rows(vocab_size: int, budget: int) -> int:
    """Positions per output-layer chunk under a memory budget of ``budget`` bytes."""
    logits = CHUNK_LOGITS or chunk_bytes(budget) // BYTES_PER_LOGIT
    return max(MIN_CHUNK_ROWS, logits // vocab_size)


def logits_of(head: torch.nn.Module, hidden: torch.Tensor, cap: float | None) -> torch.Tensor:
    """fp32 logits of ``hidden`` (as the model's causal-LM forward computes them, then in fp32).
    An fp32 output layer with plain LoRA terms adds them into its logits in place: two [rows x
    vocabulary] tensors at once, the logits and a LoRA term, where peft's module holds three (the
    base output, B's and B's scaled); the same arithmetic, so the same bits."""
    terms = _lora_terms(head, hidden)
    if terms is None:
        logits = head(hidden).float()
    else:
        base = getattr(head, "base_layer", head)
        logits = F.linear(hidden, base.weight, base.bias)
        for a, b, scaling in terms:  # peft's ``result + lora_B(lora_A(x)) * scaling``, in place
            logits.add_(F.linear(F.linear(hidden, a), b).mul_(scaling))
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
            chosen = ChosenLogprobs.apply(logits_of(head, x, cap), sorted_rows[lo:hi] - start, targets[pick])
            if backward:
                g = loss_grad(chosen.detach(), pick) if loss_grad is not None else grad[pick]
                torch.autograd.backward(chosen, g.to(chosen.dtype))
                hidden_grad[start : start + step] = x.grad
        out[pick] = chosen.detach()
        del chosen
    return out, hidden_grad


def _lora_terms(head: torch.nn.Module, hidden: torch.Tensor) -> list | None:
    """The (A, B, scaling) of each active LoRA of an fp32 output layer (peft's vanilla LoRA, no
    dropout), [] for a plain fp32 linear layer; None where the layer is anything else."""
    base = getattr(head, "base_layer", head)
    if (
        not isinstance(base, torch.nn.Linear)
        or torch.float32 != base.weight.dtype
        or torch.float32 != hidden.dtype
    ):
        return None
    if base is head:
        return []
    if head.disable_adapters or head.merged:
        return None
    terms = []
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        a, b = head.lora_A[name].weight, head.lora_B[name].weight
        plain = name not in getattr(head, "lora_variant", {}) and isinstance(
            head.lora_dropout[name], torch.nn.Identity
        )
        if not plain or a.dtype != torch.float32 or b.dtype != torch.float32:
            return None
        terms.append((a, b, head.scaling[name]))
    return terms


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


class ChosenLogprobs(torch.autograd.Function):
    """``logits.log_softmax(-1)[rows, targets]`` (``rows`` ascending) holding no other [rows x
    vocabulary] tensor than the logits: the forward and backward passes work :data:`LSE_ROWS` rows
    at a time, and the backward pass turns the logits into their own gradient in place. Row by row
    these are the kernels autograd runs on the whole chunk (log-softmax, the gradient scattered
    into zeros, log-softmax's backward), so the numbers are the same to the bit. The logits must be
    no other op's saved tensor, as a linear layer's output is not; autograd's version check refuses
    the backward pass otherwise."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = logits.new_empty(rows.shape)
        for block, lo, hi in _blocks(logits, rows):
            if lo < hi:
                out[lo:hi] = logits[block].log_softmax(-1)[rows[lo:hi] - block.start, targets[lo:hi]]
        ctx.save_for_backward(logits, rows, targets)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, rows, targets = ctx.saved_tensors
        for block, lo, hi in _blocks(logits, rows):
            output = logits[block].log_softmax(-1)
            scattered = torch.zeros_like(output)
            scattered.index_put_((rows[lo:hi] - block.start, targets[lo:hi]), grad[lo:hi], accumulate=True)
            logits[block] = torch_internals.log_softmax_backward(scattered, output, -1)
        return logits, None, None


def _blocks(logits: torch.Tensor, rows: torch.Tensor):
    """(rows of ``logits``, first pair, end pair) for each :data:`LSE_ROWS` rows (``rows`` ascending)."""
    count = logits.shape[0]
    edges = torch.searchsorted(rows, torch.arange(0, count + LSE_ROWS, LSE_ROWS, device=rows.device)).tolist()
    for i, start in enumerate(range(0, count, LSE_ROWS)):
        yield slice(start, start + LSE_ROWS), edges[i], edges[i + 1]
