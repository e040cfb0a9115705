"""Training ops: ``forward``, ``forward_backward`` (token-sum losses) and ``optim_step`` (AdamW).

A batch runs in micro-batches (:func:`~.batched_forward.plan`): the losses are token sums, so
backward per micro-batch accumulates the same gradients as one pass over the whole batch. Datums
that share a prefix (an RL group's prompt) run it once. Gradients accumulate in the adapter's
parameters until ``optim_step`` applies and clears them.
"""

from __future__ import annotations

import torch

from sess.engine.runtime.batched_forward import plan, shared_prefix_logprobs, token_logprobs
from sess.engine.runtime.losses import compute_loss
from sess.engine.runtime.runtime import Runtime
from sess.engine.sdk import requests as rq
from sess.engine.sdk.data_checks import check_data, check_loss_fn
from sess.engine.sdk.errors import InvalidRequest
from sess.engine.sdk.types import ForwardBackwardOutput, TensorData


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
    datums = request.data
    check_data(datums, loss_fn, vocab_size=host.vocab_size)
    longest = max(d.model_input.length for d in datums)
    if longest > host.max_context:
        raise InvalidRequest(
            f"data: a datum of {longest} tokens exceeds the model's context of {host.max_context}"
        )
    inputs = [{k: v.to_torch() for k, v in d.loss_fn_inputs.items()} for d in datums]
    all_lps: list[torch.Tensor | None] = [None] * len(datums)
    targets = [x["target_tokens"] for x in inputs]
    ranks = runtime.ranks  # with several ranks, this one's share of the datums (distributed.py)
    batches = (
        ranks.plan(datums, host.vocab_size)
        if ranks
        else plan(datums, host.vocab_size, share_prefixes=host.shares_prefixes)
    )
    with host.activate(session.adapter) as model, torch.set_grad_enabled(backward):
        for padded, groups in batches:
            if not padded and not groups:  # a rank with fewer micro-batches joins the others' gathers
                ranks.idle_round(model, backward)
                continue
            if groups:
                per_group = shared_prefix_logprobs(
                    model,
                    [([datums[i] for i in idx], [targets[i] for i in idx], shared) for idx, shared in groups],
                )
                indices = [i for idx, _ in groups for i in idx]
                lps = [lp for group in per_group for lp in group]
            else:
                indices = padded
                lps = token_logprobs(model, [datums[i] for i in indices], [targets[i] for i in indices])
            if backward:
                loss, _ = compute_loss(loss_fn, config, lps, [inputs[i] for i in indices])
                loss.backward()
            for i, lp in zip(indices, lps):
                all_lps[i] = lp.detach()
    if ranks:
        all_lps = ranks.gather_logprobs(all_lps, datums)
    with torch.no_grad():
        _, metrics = compute_loss(loss_fn, config, all_lps, inputs)
    outputs = [{"logprobs": TensorData.from_torch(lp.float())} for lp in all_lps]
    return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics).to_wire()


def optim_step(runtime: Runtime, owner: str, request: rq.OptimStep) -> dict:
    """One AdamW step on the accumulated gradients (clipped to ``grad_clip_norm`` when set)."""
    session = runtime.session(owner, request.session)
    adam = request.adam_params
    params = list(session.params.values())
    if runtime.ranks:  # each rank holds its share's token-sum gradients: sum them, never average
        runtime.ranks.sum_grads(params)
    grads = [p.grad for p in params if p.grad is not None]
    grad_norm = (
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if grads
        else torch.tensor(0.0)
    )
    if not torch.isfinite(grad_norm):
        session.optimizer.zero_grad(set_to_none=True)
        raise InvalidRequest(
            "gradients are not finite (NaN or inf); they were discarded and the weights left unchanged"
        )
    if adam.grad_clip_norm > 0 and grads:
        torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
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
    return {
        "metrics": {"grad_norm": float(grad_norm), "learning_rate": adam.learning_rate, "step": session.step}
    }
