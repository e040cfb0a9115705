"""Which tokens a prefill computes for its prompts: a prefix that prompts of one adapter share, once.

Chat prompts begin alike (a template's system prompt, a task's instructions): 8 prompts of a batch
that share most of their tokens would otherwise send each of those tokens through every matmul 8
times. :class:`Layout` lists the tokens to compute (each shared prefix once, then each prompt's own
tokens) and, for each, where its prompt's columns are among them, for the prefill's attention
(:func:`.fused_ops.prefill_attend`) and for laying each prompt's keys and values end to end after.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class Layout:
    """The tokens a prefill computes for its prompts, and where each prompt's columns are among
    them. Where several prompts of one adapter begin with the same tokens, that prefix is computed
    once (its tokens first, where the first of those prompts comes), and each prompt then computes
    only the rest of it, at least its last token. Each token's result is its own prompt's either
    way: every linear layer, norm and activation works row by row to the bit
    (:mod:`.row_invariant`), and attention reads only the token's prompt's columns up to it
    (:func:`.fused_ops.prefill_attend`), which on the prefix are the same bits."""

    tokens: list[int] = field(default_factory=list)  # the tokens computed
    positions: list[int] = field(default_factory=list)  # each one's position in its prompt
    owners: list = field(default_factory=list)  # each one's adapter
    # each token's columns: column c is token lows + c below splits, highs + c from there on
    splits: list[int] = field(default_factory=list)
    lows: list[int] = field(default_factory=list)
    highs: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)  # each prompt's last token
    order: list[int] = field(default_factory=list)  # the prompts' tokens end to end
    shared: bool = False  # whether any prefix is computed once or comes from the prefix cache
    cached: int = 0  # entries that come first, before the computed tokens' (prefixes found cached)

    @classmethod
    def of(cls, jobs: list, share: bool, found: list[tuple[int, int]] | None = None) -> Layout:
        """The layout of ``jobs``' prompts (in job order); ``share``: compute shared prefixes once.
        ``found``: per job, ``(length, first)``: its first ``length`` tokens' entries are cached,
        at ``first`` of the cached entries laid before the computed tokens' (length 0: none); its
        columns there and its own after index those entries and the computed ones together. A job
        with a cached prefix computes the rest of its prompt on its own. Sets each job's
        ``cached_tokens``: its prompt's first tokens it does not compute (found cached, or computed
        for an earlier prompt of the prefill)."""
        found = found or [(0, 0)] * len(jobs)
        cached = sum(length for length, _ in found)
        prefixes = {}  # adapter -> the length its prompts share (each keeps at least its last token)
        if share:
            by_adapter: dict = {}
            for job, (length, _) in zip(jobs, found):
                if not length:
                    by_adapter.setdefault(job.adapter, []).append(job.prompt)
            for adapter, prompts in by_adapter.items():
                if len(prompts) > 1:
                    common = len(os.path.commonprefix(prompts))
                    prefixes[adapter] = min(common, min(map(len, prompts)) - 1)
        layout, placed = cls(cached=cached, shared=cached > 0), {}  # adapter -> where its prefix's tokens are
        for job, (length, first) in zip(jobs, found):
            shared = length or prefixes.get(job.adapter, 0)
            job.cached_tokens = shared if length or job.adapter in placed else 0
            if shared and not length and job.adapter not in placed:
                placed[job.adapter] = here = cached + len(layout.tokens)
                layout._add(job.prompt[:shared], job.adapter, range(shared), 0, 0, here)
                layout.shared = True
            low = first if length else placed.get(job.adapter, 0)
            own = cached + len(layout.tokens)
            layout._add(job.prompt[shared:], job.adapter, range(shared, len(job.prompt)), shared, low, own - shared)
            layout.order += [*range(low, low + shared), *range(own, cached + len(layout.tokens))]
            layout.last.append(len(layout.tokens) - 1)
        return layout

    def _add(self, tokens: list[int], owner, positions: range, split: int, low: int, high: int) -> None:
        self.tokens += tokens
        self.positions += positions
        self.owners += [owner] * len(tokens)
        self.splits += [split] * len(tokens)
        self.lows += [low] * len(tokens)
        self.highs += [high] * len(tokens)
