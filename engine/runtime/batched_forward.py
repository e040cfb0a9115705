"""Batched forward passes: per-token logprobs of datum batches and of prompts.

:func:`plan` splits a batch into micro-batches of at most ``max_positions`` positions each (the
memory budget's share, :mod:`sess.engine.runtime.memory.training_budget`; the losses are token sums, so backward per
micro-batch gives the same gradients). Datums that share a long prefix (the G completions of one
prompt in RL) form one micro-batch whose prefix runs once: its KV cache is repeated for the members
and only their suffixes run, which is the same function with fewer FLOPs (in RL batches the prompt
is often most of each sequence). Prompts of one micro-batch that begin alike (a chat template's
system lines) run that start once as well. The rest are right-padded into ordinary batches. The
passes stop at the decoder's final hidden states; logprobs come from the output layer in chunks
(:mod:`.output_layer`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from sess.engine.protocol.types import Datum
from sess.engine.runtime.output_layer import Pairs, chunk_rows, decoder_and_head, logits_of, output_size

MIN_SHARED = 16  # a shorter common prefix is not worth a separate pass
# Running the prefixes' common start once costs a model call of its own over few rows: on smollm2,
# GRPO forward_backward with a 27-token system start gained 11 % at 8 prompts per micro-batch and
# nothing at 4.
MIN_ROOT_GROUPS = 5
PACK_TOKENS = 1024  # suffix positions per shared-prefix micro-batch (bigger ones gained nothing on CPU)


Group = tuple[list[int], int]  # datum indices sharing their first ``shared`` input tokens, shared


def plan(
    datums: list[Datum], max_positions: int, *, share_prefixes: bool, repeat_cost: float = 0.0
) -> list[tuple[list[int], list[Group]]]:
    """Micro-batches: (indices for one right-padded batch, []) or ([], groups run with shared
    prefixes), each computing at most ``max_positions`` positions, except a datum longer than that,
    which comes alone (:func:`positions` of a micro-batch says how many it computes). A group's
    members each hold a copy of its prefix's keys and values: ``repeat_cost`` is what one member's
    copy of one prefix position costs, counted in positions."""
    budget = max(1, max_positions)
    tokens = [d.model_input.to_ints() for d in datums]
    batches: list[tuple[list[int], list[Group]]] = []
    alone = list(range(len(datums)))
    if share_prefixes and len(datums) > 1:
        alone = []
        order = sorted(range(len(datums)), key=lambda i: tokens[i])
        groups, members, common = [], [order[0]], len(tokens[order[0]])
        for i in order[1:]:
            shared = min(common, _common_prefix(tokens[members[0]], tokens[i]))
            # Joining cuts the group's prefix to ``shared`` for all its members: worth it only if
            # that recomputes fewer tokens than it saves (``n * shared > (n - 1) * common``), so
            # prompts that begin with the same system message stay groups of their own.
            if shared >= MIN_SHARED and len(members) * shared > (len(members) - 1) * common:
                members.append(i)
                common = shared
            else:
                groups.append((members, common))
                members, common = [i], len(tokens[i])
        groups.append((members, common))
        packed: list[Group] = []
        rows = prefix_width = suffix_width = 0
        for members, common in groups:
            shared = min(common, min(len(tokens[m]) for m in members) - 1)  # each keeps >= 1 token of its own
            if len(members) < 2 or shared < MIN_SHARED:
                alone += members
                continue
            members.sort()
            suffix = max(len(tokens[m]) for m in members) - shared
            # a group too big for one micro-batch runs in parts, each with its own prefix pass
            per_part = int(max(0, budget - shared) // (suffix + repeat_cost * shared))
            for part in [members[i : i + max(per_part, 1)] for i in range(0, len(members), max(per_part, 1))]:
                if len(part) < 2:
                    alone += part
                    continue
                prefix = max(prefix_width, shared)
                count = (rows + len(part)) * (max(suffix_width, suffix) + repeat_cost * prefix) + (
                    len(packed) + 1
                ) * prefix
                if packed and (
                    count > budget or (rows + len(part)) * max(suffix_width, suffix) > PACK_TOKENS
                ):
                    batches.append(([], packed))
                    packed, rows, prefix_width, suffix_width = [], 0, 0, 0
                packed.append((part, shared))
                rows += len(part)
                prefix_width, suffix_width = max(prefix_width, shared), max(suffix_width, suffix)
        if packed:
            batches.append(([], packed))
        alone.sort()
    batches += [([alone[j] for j in chunk], []) for chunk in chunks([datums[i] for i in alone], budget)]
    return batches


def positions(datums: list[Datum], batch: tuple[list[int], list[Group]], repeat_cost: float = 0.0) -> int:
    """How many positions a micro-batch of :func:`plan` computes, padding included (with
    ``repeat_cost``: and what its members' copies of their prefix cost, counted in positions)."""
    padded, groups = batch
    if padded:
        return len(padded) * max(datums[i].model_input.length for i in padded)
    prefix = max(shared for _, shared in groups)
    suffix = max(datums[i].model_input.length - shared for members, shared in groups for i in members)
    members = sum(len(members) for members, _ in groups)
    return len(groups) * prefix + members * suffix + round(repeat_cost * members * prefix)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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


def token_pairs(decoder, datums: list[Datum], targets: list[torch.Tensor]) -> Pairs:
    """The decoder's final hidden states for each datum's positions, right-padded into one batch
    (the padding's rows dropped), and each position's target."""
    device = _device(decoder)
    ids, mask, tgt = _right_padded([d.model_input.to_ints() for d in datums], targets, device)
    hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    valid = mask.bool()
    return Pairs(hidden[valid], torch.arange(int(valid.sum()), device=device), tgt[valid], _spans(datums))


def shared_prefix_pairs(decoder, groups: list[tuple[list[Datum], list[torch.Tensor], int]]) -> Pairs:
    """Like :func:`token_pairs`, for groups of datums whose first ``shared`` input tokens agree.

    All groups' prefixes run as one right-padded batch, after the start they all share
    (:func:`shared_root`, e.g. a chat template's system lines), which runs once with its KV rows
    repeated for each prefix; each prefix's KV rows are repeated for its members; then all
    suffixes run as one batch attending to their own prefix. A prefix's hidden states are rows of
    their own, read by every member with its own targets (the last prefix position's target is the
    member's first own token). Datums come in group order."""
    device = _device(decoder)
    prefixes = [datums[0].model_input.to_ints()[:shared] for datums, _, shared in groups]
    root = shared_root(prefixes)
    cache = DynamicCache(config=decoder.config)
    parts = []
    if root:  # the prompts' common start runs once too, its KV repeated for each prompt
        out = decoder(
            input_ids=torch.tensor([prefixes[0][:root]], device=device), cache=cache, use_cache=True
        )
        parts.append(out.last_hidden_state[0])
        cache = out.cache
        repeat_rows(cache, torch.zeros(len(groups), dtype=torch.long, device=device))
    prefix_ids, own_mask, _ = _right_padded([p[root:] for p in prefixes], None, device)
    prefix_mask = torch.cat([own_mask.new_ones(len(groups), root), own_mask], dim=1)
    positions = root + torch.arange(prefix_ids.shape[1], device=device)
    out = decoder(
        input_ids=prefix_ids,
        attention_mask=prefix_mask,
        position_ids=positions[None, :].expand(len(groups), -1),
        cache=cache,
        use_cache=True,
    )
    parts.append(out.last_hidden_state[own_mask.bool()])
    owner = [g for g, (datums, _, _) in enumerate(groups) for _ in datums]
    cache = out.cache
    repeat_rows(cache, torch.tensor(owner, device=device))  # repeat each prefix for its members
    members = [(d, t, shared) for datums, targets, shared in groups for d, t in zip(datums, targets)]
    ids, suffix_mask, _ = _right_padded(
        [d.model_input.to_ints()[shared:] for d, _, shared in members], None, device
    )
    mask = torch.cat([prefix_mask[owner], suffix_mask], dim=1)
    starts = torch.tensor([shared for _, _, shared in members], device=device)
    positions = starts[:, None] + torch.arange(ids.shape[1], device=device)[None, :]
    out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    parts.append(out.last_hidden_state[suffix_mask.bool()])
    # row numbers: the root's, then each prefix's own rows, then each member's suffix rows
    prefix_start = [root + sum(s - root for _, _, s in groups[:g]) for g in range(len(groups))]
    suffix_start = prefix_start[-1] + groups[-1][2] - root if groups else root
    rows, targets = [], []
    for m, (datum, target, shared) in enumerate(members):
        n, g = datum.model_input.length, owner[m]
        rows += [
            torch.arange(root, device=device),
            prefix_start[g] + torch.arange(shared - root, device=device),
            suffix_start + torch.arange(n - shared, device=device),
        ]
        suffix_start += n - shared
        targets.append(target[:n].to(device=device, dtype=torch.long))
    return Pairs(torch.cat(parts), torch.cat(rows), torch.cat(targets), _spans([d for d, _, _ in members]))


def _device(decoder) -> torch.device:
    return decoder.get_input_embeddings().weight.device


def _spans(datums: list[Datum]) -> list[slice]:
    spans, start = [], 0
    for d in datums:
        spans.append(slice(start, start + d.model_input.length))
        start += d.model_input.length
    return spans


def repeat_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Make row i of every layer's keys and values the old row ``rows[i]`` (rows repeat), keeping
    the backward exact from run to run: the cache's own ``batch_select_indices`` indexes with
    ``keys[rows]``, whose backward (``index_put_`` with accumulate) adds a repeated row's gradients
    from several CPU threads in whatever order they come, so the same batch gave gradients that
    differed in the last bits between runs (and so whole RL runs diverged from their second step).
    ``index_select`` adds them up in a fixed order."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


def shared_root(prefixes: list[list[int]]) -> int:
    """How many first tokens all of a micro-batch's group prefixes have in common (a chat template's
    system lines, say), when that is MIN_SHARED or more and there are MIN_ROOT_GROUPS prefixes or
    more; else 0. Each prefix keeps one token of its own beyond it."""
    if len(prefixes) < max(2, MIN_ROOT_GROUPS):
        return 0
    root = min(len(p) for p in prefixes) - 1
    for p in prefixes[1:]:
        root = min(root, _common_prefix(prefixes[0], p))
    return root if root >= MIN_SHARED else 0


def _right_padded(rows: list[list[int]], targets: list[torch.Tensor] | None, device):
    """Token ids, attention mask and (with ``targets``) target ids of ``rows``, right-padded."""
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    tgt = None if targets is None else torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)] = torch.tensor(tokens, device=device)
        mask[row, : len(tokens)] = 1
        if tgt is not None:
            tgt[row, : len(tokens)] = targets[row].to(device=device, dtype=torch.long)
    return ids, mask, tgt


def prompt_logprobs(model, prompt: list[int], topk: int | None, budget: int):
    """Each prompt token's logprob given the ones before it (the first None), and with ``topk`` the
    top-k (token, logprob) pairs of each position, over the output layer in chunks (sized by the
    memory budget ``budget``)."""
    decoder, head, cap = decoder_and_head(model)
    with torch.no_grad():
        device = _device(decoder)
        hidden = decoder(input_ids=torch.tensor([prompt], device=device), use_cache=False).last_hidden_state[
            0
        ]
        step = chunk_rows(output_size(head), budget)
        chosen, top = [], [None] if topk else None
        following = torch.tensor(prompt[1:], device=device)
        for start in range(0, len(prompt) - 1, step):
            stop = min(start + step, len(prompt) - 1)
            logp = logits_of(head, hidden[start:stop], cap).log_softmax(-1)
            chosen += logp.gather(-1, following[start:stop, None]).squeeze(-1).tolist()
            if topk:
                values, indices = logp.topk(min(topk, logp.shape[-1]), dim=-1)
                top += [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
    return [None, *chosen], top
