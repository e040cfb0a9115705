"""The KV entries of recent prompts, kept across requests, so a prompt that begins as an earlier one
did (a group's repeated prompt, a multi-turn environment's growing history) prefills only the rest.

An entry is one prompt's rotated keys and values, per layer [tokens, kv heads, dim], under the
weights that computed them: the adapter and its plan's versions (:func:`.lora_plans.versions`, so an
optimizer step or a loaded state, which change the weights in place, never meet an entry of the
weights before), or the base model's. A lookup finds the entry sharing the longest prefix with a new
prompt; its first tokens' entries are that prefix's under any prompt (attention is causal), and
the lean decoder's prefill reads them where it would have computed them
(:meth:`.llama_decoder.LlamaDecoder.prefill`): every linear layer, norm and activation works row
by row to the bit and the prefill's attention reads a token's columns in the same order wherever
they lie (:class:`.prefill_layout.Layout`), so a prefill with the cache gives the same bits as one
without. The entries take at most ``budget()`` bytes; the least recently used go first.

``SESS_PREFIX_CACHE=0`` turns it off (it is on by default).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sess.engine.sampling.row_invariant import BLOCK


def enabled() -> bool:
    """Whether the sampler keeps prompts' entries across requests (``SESS_PREFIX_CACHE``, default on)."""
    return os.environ.get("SESS_PREFIX_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


@dataclass
class Entry:
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [tokens, kv heads, dim], rotated
    values: list[torch.Tensor]
    bytes: int


@dataclass
class Hit:
    """The first ``length`` tokens of a prompt, found: their entries per layer."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class PrefixCache:
    """Prompts' KV entries per weights, LRU, within ``budget()`` bytes."""

    def __init__(self, budget: Callable[[], int]):
        self.budget = budget
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()  # (weights, tokens) -> entry, oldest first
        self.bytes = 0

    def find(self, weights: tuple, prompt: list[int], most: int) -> Hit | None:
        """The longest prefix (at most ``most`` tokens) ``prompt`` shares with an entry of
        ``weights``; that entry becomes the most recently used. None: none shares a token."""
        best, length = None, 0
        for key, entry in self.entries.items():
            if key[0] != weights:
                continue
            shared = _common(entry.tokens, prompt, most)
            if shared > length:
                best, length = key, shared
        if best is None:
            return None
        self.entries.move_to_end(best)
        entry = self.entries[best]
        return Hit(length, [k[:length] for k in entry.keys], [v[:length] for v in entry.values])

    def put(
        self, weights: tuple, prompt: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> None:
        """Keep ``prompt``'s entries (copied) under ``weights``. An entry that holds the whole prompt
        already is only touched; entries that are a prefix of it go (it serves them all), and so do
        those of other weights under the same name (``weights[0]``: an adapter's before a step)."""
        tokens = tuple(prompt)
        for key, entry in self.entries.items():
            if key[0] == weights and entry.tokens[: len(tokens)] == tokens:
                self.entries.move_to_end(key)
                return
        size = sum(t.numel() * t.element_size() for t in keys + values)
        budget = self.budget()
        if size > budget:  # never kept: the entries it would replace stay
            return
        for key, entry in list(self.entries.items()):
            stale = key[0] != weights and key[0][0] == weights[0]
            if stale or (key[0] == weights and tokens[: len(entry.tokens)] == entry.tokens):
                self._drop(key)
        while self.entries and self.bytes + size > budget:
            self._drop(next(iter(self.entries)))
        entry = Entry(tokens, [k.clone() for k in keys], [v.clone() for v in values], size)
        self.entries[(weights, tokens)] = entry
        self.bytes += size

    def forget(self, keep: Callable[[tuple], bool] = lambda weights: False) -> None:
        """Drop every entry whose weights ``keep`` does not name."""
        for key in [key for key in self.entries if not keep(key[0])]:
            self._drop(key)

    def shrink(self) -> None:
        """Drop the least recently used entries until they fit ``budget()`` (it may have shrunk)."""
        budget = self.budget()
        while self.entries and self.bytes > budget:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple) -> None:
        self.bytes -= self.entries.pop(key).bytes


def _common(a: tuple[int, ...], b: list[int], most: int) -> int:
    """How many first tokens ``a`` and ``b`` share, at most ``most``."""
    n = min(len(a), len(b), most)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def budget_of(copies: Callable[[], int] | None) -> Callable[[], int]:
    """The entries' bytes: ``SESS_PREFIX_CACHE_MB`` where set, else a quarter of the sampler's copy
    budget (the bytes its prepacked weight copies may take; 256 MB where it has none)."""

    def budget() -> int:
        given = os.environ.get("SESS_PREFIX_CACHE_MB")
        if given:
            return int(float(given) * (1 << 20))
        return copies() // 4 if copies is not None else 256 << 20

    return budget


def lookup(cache: PrefixCache, weights: list[tuple] | None, jobs: list) -> tuple[list | None, list | None]:
    """Each job's cached prefix as :meth:`.prefill_layout.Layout.of`
    takes it, and the found entries laid end to end, ``(keys, values)`` per layer (None: none
    found). A job keeps at least its last token to compute (its logits), and one that wants its
    prompt's logprobs computes all of it."""
    if weights is None:  # no cache: nothing found
        return None, None
    found, hits, first = [], [], 0
    for job, key in zip(jobs, weights):
        job.prefix_key = key  # its completion's entries are kept under it (:func:`store_row`)
        hit = None if job.prompt_logprobs else cache.find(key, job.prompt, len(job.prompt) - 1)
        found.append((hit.length if hit else 0, first))
        if hit:
            hits.append(hit)
            first += hit.length
    if not hits:
        return found, None
    layers = range(len(hits[0].keys))
    return found, [
        (torch.cat([h.keys[i] for h in hits]), torch.cat([h.values[i] for h in hits])) for i in layers
    ]


def store(cache: PrefixCache, jobs: list, keys: list, values: list) -> None:
    """Keep each job's prompt entries from a prefill's per-layer ``keys``, ``values`` [tokens, kv
    heads, dim] of the prompts laid end to end, under the weights :func:`lookup` found for it
    (``job.prefix_key``; None: the cache was not used)."""
    start = 0
    for job in jobs:
        span = slice(start, start + len(job.prompt))
        if job.prefix_key is not None:
            cache.put(job.prefix_key, job.prompt, [k[span] for k in keys], [v[span] for v in values])
        start = span.stop


def padded(x: torch.Tensor, cached: int) -> torch.Tensor:
    """``x`` [tokens, ...] after ``cached`` rows of zeros: the prefill attention kernel takes a
    query row per key row, so the cached entries' rows get queries that attend to themselves only
    (:func:`dummy_columns`), whose results are dropped."""
    return torch.cat([x.new_zeros(cached, *x.shape[1:]), x]) if cached else x


def dummy_columns(layout) -> tuple[list[int], ...]:
    """``(positions, splits, lows, highs)`` of :func:`padded` rows then the layout's tokens."""
    c = layout.cached
    return (
        [0] * c + layout.positions,
        [0] * c + layout.splits,
        [0] * c + layout.lows,
        [*range(c), *layout.highs],
    )


def joined(cached: list | None, layer: int, keys: torch.Tensor, values: torch.Tensor):
    """``layer``'s cached entries (from :func:`lookup`) before a prefill's computed ``keys``, ``values``."""
    if cached is None:
        return keys, values
    return torch.cat([cached[layer][0], keys]), torch.cat([cached[layer][1], values])


def store_row(cache: PrefixCache, key: tuple, rows, row: int, job, tokens: list[int]) -> None:
    """Keep the entries of batch row ``row`` of the decode cache ``rows`` (a
    :class:`~.block_cache.BlockCache` read by place), which finished with ``tokens``: those of its
    prompt and of its tokens but the last (never fed back), under ``key``, its prefill's weights,
    which the caller checked it still has (a live session may have stepped while it decoded). Only
    for a request of one sample (a multi-turn environment's turn: its next prompt begins with this
    one and its completion); the decode step computes each token's entries as a prefill of them
    would, to the bit."""
    length = len(job.prompt) + len(tokens) - 1
    if job.num_samples != 1 or not rows.by_place:
        return
    sources, lengths = rows.sharing()
    place = (lambda r: int(rows.places[r])) if rows.places is not None else (lambda r: r)
    own, source, shared = place(row), place(int(sources[row])), min(int(lengths[row]), length)
    blocks = -(-length // BLOCK)

    def columns(t: torch.Tensor, at: int) -> torch.Tensor:
        """Cache row ``at``'s columns [blocks * BLOCK, kv heads, dim] of ``t`` [blocks, rows, ...]."""
        entries = t[:blocks, at].transpose(0, 1)  # [kv heads, blocks, BLOCK, dim]
        return entries.reshape(entries.shape[0], blocks * BLOCK, entries.shape[-1]).transpose(0, 1)

    def of(t: torch.Tensor) -> torch.Tensor:
        mine = columns(t, own)[:length]
        return mine if source == own else torch.cat([columns(t, source)[:shared], mine[shared:]])

    cache.put(key, list(job.prompt) + tokens[:-1], [of(t) for t in rows.keys], [of(t) for t in rows.values])
