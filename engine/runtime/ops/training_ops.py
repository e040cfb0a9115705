"""Training ops: ``forward``, ``forward_backward`` (token-sum losses) and ``optim_step`` (AdamW).

A batch runs in micro-batches (:func:`~.batched_forward.plan`) sized by the engine's memory budget
(:mod:`sess.engine.runtime.memory.training_budget`): the losses are token sums, so backward per micro-batch accumulates the
same gradients as one pass over the whole batch. Datums that share a prefix (an RL group's prompt)
run it once. A micro-batch that cannot be made to fit (one long datum) runs with activation
checkpointing; one that would not fit even so is refused before anything runs. Logprobs and the
loss's gradient go through the output layer in chunks (:mod:`.output_layer`), so no
[tokens x vocabulary] logits are ever held. Gradients accumulate in the adapter's parameters until
``optim_step`` applies and clears them. A datum with (N, K) ``target_tokens`` and ``weights``
(cross_entropy's K targets per position) runs as K datums of one column each, whose prefix the
micro-batch plan shares, so its loss is exactly the sum of K one-target datums'; its logprobs come
back as (N, K).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import torch

from sess.engine.protocol import loss_registry
from sess.engine.protocol import requests as rq
from sess.engine.protocol.data_checks import MULTI_TARGET_INPUTS, check_data, check_loss_fn
from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.types import Datum, ForwardBackwardOutput, TensorData
from sess.engine.runtime.batched_forward import positions, shared_prefix_pairs, token_pairs
from sess.engine.runtime.losses import compute_loss
from sess.engine.runtime.memory.malloc_tuning import allocator, resident_bytes, trim
from sess.engine.runtime.memory.training_budget import checkpointing, format_bytes
from sess.engine.runtime.output_layer import (
    activation_budget,
    backward_from,
    chunk_bytes,
    decoder_and_head,
    logprobs,
    token_loss_grad,
)
from sess.engine.runtime.placement import held_bytes, local
from sess.engine.runtime.recompute import recomputing
from sess.engine.runtime.runtime import Runtime

T = TypeVar("T")

# Losses whose gradient at a token depends on that token's logprob and inputs alone: their gradient
# goes through the output layer in the same pass as the logprobs. Any other loss takes two passes
# (logprobs, then the loss's gradient over the micro-batch, then the output layer again).
PER_TOKEN_LOSSES = loss_registry.PER_TOKEN_LOSSES


def forward(runtime: Runtime, owner: str, request: rq.ForwardRequest) -> dict:
    """Per-token logprobs and the loss's metrics, without gradients."""
    return _run(runtime, owner, request, backward=False)


def forward_backward(runtime: Runtime, owner: str, request: rq.ForwardRequest) -> dict:
    """:func:`forward`, and the loss's gradients added to the adapter's."""
    return _run(runtime, owner, request, backward=True)


def _run(runtime: Runtime, owner: str, request: rq.ForwardRequest, *, backward: bool) -> dict:
    session = runtime.session(owner, request.session)
    host = runtime.hosts[session.base_model]
    loss_fn, config = check_loss_fn(request.loss_fn, request.loss_fn_config)
    check_data(request.data, loss_fn, vocab_size=host.vocab_size)
    datums, columns = _one_target_each(request.data, MULTI_TARGET_INPUTS.get(loss_fn, ()))
    for index, datum in enumerate(request.data):
        if datum.model_input.length > host.max_context:
            raise InvalidRequest(
                f"data[{index}]: the datum is too long: {datum.model_input.length} tokens, over the "
                f"model's context window of {host.max_context} tokens; split it"
            )
    inputs = [{k: v.to_torch() for k, v in d.loss_fn_inputs.items()} for d in datums]
    all_lps: list[torch.Tensor | None] = [None] * len(datums)
    targets = [x["target_tokens"] for x in inputs]
    placement = runtime.placement  # with several ranks, this one's share of the datums (distributed/)
    # several ranks: the model's root FSDP unit (embeddings, final norm, output layer) gathered for the
    # op, since training runs the decoder and the output layer apart (output_layer.py)
    with (
        host.activate(session.adapter) as model,
        placement.root_gathered(host.model),
        placement.adapter_gathered(session),
    ):
        if backward:
            host.release_sampling_memory()  # the decoder's packed weight copies: made again when it samples
        decoder, head, cap = decoder_and_head(model)
        cost, budget = host.activation_cost(model), runtime.memory_budget  # measured by the first op
        if backward and not runtime.decoding:
            runtime.entering("train")  # from sampling, the heap's free pages go back first
        room = activation_budget(budget)  # the rest is the output layer's chunk
        # without gradients a position holds about one layer's activations at a time
        per_position = cost.plain if backward else cost.layer
        capacity = int(room // per_position)
        repeat = cost.repeated / per_position if backward else 0.0  # saved copies of a group's prefix KV
        batches = placement.plan(datums, capacity, share_prefixes=host.shares_prefixes, repeat_cost=repeat)
        for index in placement.checked_first(datums) if backward else []:  # several ranks refuse alike
            _check_fits(datums, ([index], []), cost, budget, ceiling=runtime.memory_ceiling)
        checkpointed = [
            backward
            and bool(padded or groups)
            and _check_fits(datums, (padded, groups), cost, budget, repeat, runtime.memory_ceiling)
            for padded, groups in batches
        ]
        # on glibc's heap, free pages go back between a micro-batch's phases where needed: see _Heap
        heap = _Heap(budget) if runtime.device == "cpu" and allocator() == "glibc" else None
        # several ranks: each micro-batch's decoder pass runs through the adapter's FSDP2 unit, which
        # reduce-scatters the gradients after the last round's backward pass (distributed/adapter_shards.py)
        shard = session.shard if backward else None  # None in one process
        run = shard.forward if shard is not None else _call
        with (
            torch.set_grad_enabled(backward),
            session.accumulating() if backward else contextlib.nullcontext(),
        ):
            for round_, ((padded, groups), checkpoint) in enumerate(zip(batches, checkpointed)):
                if shard is not None:
                    shard.backward_round(last=round_ == len(batches) - 1)
                if not padded and not groups:  # a rank with fewer micro-batches joins the others' gathers
                    placement.idle_round(decoder, backward, run)
                    continue
                settle = partial(heap.settle, always=checkpoint) if heap is not None else _nothing
                settle()
                with checkpointing(model, checkpoint):
                    # with a backward pass, the decoder's graph keeps recipes for what is cheap to
                    # make again (recompute.py); checkpointed, it keeps only each layer's input
                    with recomputing(backward and not checkpoint):
                        if groups:
                            indices = [i for idx, _ in groups for i in idx]
                            members = [
                                ([datums[i] for i in idx], [targets[i] for i in idx], shared)
                                for idx, shared in groups
                            ]
                            pairs = run(partial(shared_prefix_pairs, decoder, members))
                        else:
                            indices = padded
                            picked = [datums[i] for i in indices], [targets[i] for i in indices]
                            pairs = run(partial(token_pairs, decoder, *picked))
                    batch_inputs = [inputs[i] for i in indices]
                    lps = _logprobs(head, cap, pairs, budget, loss_fn, config, batch_inputs, backward, settle)
                for i, span in zip(indices, pairs.spans):
                    all_lps[i] = lps[span]
                del pairs
    all_lps = placement.gather_logprobs(all_lps, datums)
    with torch.no_grad():
        _, metrics = compute_loss(loss_fn, config, all_lps, inputs)
    per_datum = [
        torch.stack([all_lps[j] for j in c], dim=1) if len(c) > 1 or multi else all_lps[c[0]]
        for c, multi in columns
    ]
    outputs = [{"logprobs": TensorData.from_torch(lp.float())} for lp in per_datum]
    return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics).to_wire()


def _one_target_each(
    data: list[Datum], multi: tuple[str, ...]
) -> tuple[list[Datum], list[tuple[list[int], bool]]]:
    """``data`` with each (N, K) datum split into K datums of one column of its ``multi`` inputs;
    and for each datum of ``data``, the indices of its datums in the result and whether it was (N, K)."""
    out: list[Datum] = []
    columns: list[tuple[list[int], bool]] = []
    for datum in data:
        arrays = {k: datum.loss_fn_inputs[k].to_numpy() for k in multi if k in datum.loss_fn_inputs}
        if not arrays or next(iter(arrays.values())).ndim == 1:
            columns.append(([len(out)], False))
            out.append(datum)
            continue
        k = next(iter(arrays.values())).shape[1]
        columns.append((list(range(len(out), len(out) + k)), True))
        for j in range(k):
            inputs = {**datum.loss_fn_inputs, **{key: a[:, j].copy() for key, a in arrays.items()}}
            out.append(Datum(datum.model_input, inputs))
    return out, columns


def _logprobs(
    head,
    cap,
    pairs,
    budget: int,
    loss_fn: str,
    config: dict,
    inputs: list[dict],
    backward: bool,
    settle: Callable[[], None],
) -> torch.Tensor:
    """One micro-batch's logprobs (pair order); with ``backward``, the loss's gradients too.
    ``settle`` runs before the output layer and before the backward pass."""
    if not backward:
        return logprobs(head, cap, pairs, budget)[0]
    device = pairs.hidden.device
    flat = {
        key: torch.cat([x[key][: span.stop - span.start] for x, span in zip(inputs, pairs.spans)]).to(device)
        for key in inputs[0]
        if key != "target_tokens"
    }

    def loss(lps: list[torch.Tensor], pair_inputs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return compute_loss(loss_fn, config, lps, pair_inputs)[0]

    settle()
    if loss_fn in PER_TOKEN_LOSSES:
        lps, hidden_grad = logprobs(head, cap, pairs, budget, loss_grad=token_loss_grad(loss, flat))
    else:
        lps, _ = logprobs(head, cap, pairs, budget)
        leaf = lps.detach().requires_grad_(True)
        per_datum = [leaf[span] for span in pairs.spans]
        value = compute_loss(loss_fn, config, per_datum, inputs)[0]
        (grad,) = torch.autograd.grad(value, leaf, allow_unused=True)
        lps, hidden_grad = logprobs(
            head, cap, pairs, budget, grad=torch.zeros_like(leaf) if grad is None else grad
        )
    settle()
    backward_from(pairs.hidden, hidden_grad)
    return lps


class _Heap:
    """glibc's heap through one training op, which hands its free pages back (:func:`sess.engine.runtime.memory.malloc_tuning.trim`)
    before a micro-batch's forward, its output layer and its backward pass where it must.

    glibc serves a block from any free hole it fits, even one over its mmap threshold, so blocks of
    changing sizes (micro-batches of other lengths, the output layer's chunks, the backward pass's
    gradients) leave holes whose pages stay resident in a heap never trimmed while the engine works
    (:mod:`sess.engine.runtime.memory.malloc_tuning`): on smollm2 a GRPO step's live bytes rose by the budget and its resident memory
    by ~0.3 GiB more. So where the op's resident memory has grown by more than its budget since it
    began, the next phase starts with a trim. An op whose blocks reuse pages resident already
    (training ops in a row) never gets there and pays nothing; the first op after sampling, whose
    heap the switch trimmed, does. A trim's pages fault in again, which is why not every phase
    trims. On smollm2 the default ``sess run`` engine peaks about a tenth lower with these trims
    (benchmarks/README.md has the figures).

    A checkpointed micro-batch (a datum longer than the budget allows) trims before every phase: its
    long datum's large blocks take the holes earlier steps left, and its many hidden-sized blocks then
    grow the heap. An SFT step of 4 x 1024 tokens after a GRPO step peaks lower with these trims;
    checkpointing trades speed for memory already. jemalloc strands far less between live blocks and
    hands pages back by itself (the same step peaks the same with or without the trims), so an engine
    on it has no :class:`_Heap`."""

    def __init__(self, budget: int):
        start = resident_bytes()
        self.ceiling = None if start is None else start + budget

    def settle(self, *, always: bool) -> None:
        """Before a micro-batch's phase: a trim where ``always`` or where the op has grown past its
        budget."""
        if always or self.grown():
            trim()

    def grown(self) -> bool:
        now = resident_bytes()
        return self.ceiling is not None and now is not None and now > self.ceiling


def _nothing() -> None:
    pass


def _call(fn: Callable[[], T]) -> T:
    return fn()


def _check_fits(datums, batch, cost, budget: int, repeat: float = 0.0, ceiling: int | None = None) -> bool:
    """Whether ``batch`` needs activation checkpointing to stay in the share of ``budget`` that
    activations get; raises when it does not fit even then, nor checkpointed within ``ceiling`` (the
    engine's memory ceiling; None: ``budget``), before anything of the op has run."""
    room = activation_budget(budget)
    count = positions(datums, batch)
    if cost.fits(positions(datums, batch, repeat), room):
        return False
    if ceiling is not None and ceiling > budget:  # the output layer's chunks stay the budget's size
        budget, room = ceiling, ceiling - chunk_bytes(budget)
    if cost.fits_checkpointed(count, room):
        return True
    members = batch[0] or [i for idx, _ in batch[1] for i in idx]
    index = max(members, key=lambda i: datums[i].model_input.length)
    raise InvalidRequest(
        f"data[{index}]: {datums[index].model_input.length} tokens need about "
        f"{format_bytes(count * cost.checkpointed)} of activations even with activation checkpointing "
        f"({format_bytes(cost.checkpointed)} a token), over the {format_bytes(room)} that the engine's "
        f"memory budget of {format_bytes(budget)} leaves them beside the output layer; split the datum "
        f"or start the engine with a larger --memory-budget"
    )


def optim_step(runtime: Runtime, owner: str, request: rq.OptimStep) -> dict:
    """One AdamW step on the accumulated gradients (clipped to ``grad_clip_norm`` when set).

    With several ranks each holds its shards of the gradients (already summed over the ranks) and
    of the AdamW moments: the norm is the whole adapter's (the shards' combined), and each rank
    steps its shards. ``adapter_state_bytes`` is what the session's adapter and AdamW moments hold
    in this rank's memory (every rank's shards are about the same size)."""
    session = runtime.session(owner, request.session)
    adam = request.adam_params
    params = session.trainable()
    grads = [local(p.grad) for p in params if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads, foreach=False) if grads else torch.tensor(0.0)
    if grads:  # several ranks: each holds a slice's gradient; the whole adapter's norm
        grad_norm = runtime.placement.combined_norm(grad_norm)
    if not torch.isfinite(grad_norm):
        session.optimizer.zero_grad(set_to_none=True)
        raise InvalidRequest(
            "gradients are not finite (NaN or inf); they were discarded and the weights left unchanged"
        )
    if adam.grad_clip_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, grad_norm, foreach=False)
    for group in session.optimizer.param_groups:
        group.update(
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
    session.optimizer.step()
    session.optimizer.zero_grad(set_to_none=True)
    session.step += 1
    held = _state_bytes(runtime, session)
    return {
        "metrics": {
            "grad_norm": float(grad_norm),
            "learning_rate": adam.learning_rate,
            "step": session.step,
            "adapter_state_bytes": held,
        }
    }


def _state_bytes(runtime: Runtime, session) -> int:
    """Bytes the session's adapter weights and AdamW moments hold in this process."""
    host = runtime.hosts[session.base_model]
    tensors = session.trainable() + list(host.adapter_params(session.adapter).values())
    for state in session.optimizer.state.values():
        tensors += [v for k, v in state.items() if k != "step"]
    return held_bytes(tensors)
