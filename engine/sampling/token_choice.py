"""Token selection for batched sampling: per-row temperature / top-k / top-p and counter-based RNG.

Each row draws one uniform number per step from a hash of (its request's seed, its sample index,
the step), so a seeded request samples the same tokens whichever other requests share its batch,
with no per-row generator objects or Python work per row. A token is drawn by inverse CDF from the
tempered, truncated distribution (:func:`inverse_cdf`); the logprob reported is the model's own (temperature 1,
untruncated), what ``forward``'s log-softmax computes for the same token from the same logits (to
~1e-7: the C kernel sums in its own order).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import torch

from sess.engine.sampling import fused_ops

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (wrapping arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def row_keys(seed: int | None, num_samples: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One RNG key per sample of a request; ``seed=None`` draws a fresh seed."""
    seed = secrets.randbits(62) if seed is None else int(seed)
    base = splitmix64(torch.tensor([_signed(seed)], dtype=torch.int64, device=device))
    return splitmix64(base + torch.arange(num_samples, dtype=torch.int64, device=device))


def uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A uniform in [0, 1) for each (key, step) pair, in float64."""
    bits = _shift_right(splitmix64(keys ^ splitmix64(steps)), 11)  # 53 random bits
    return bits.to(torch.float64) * (1.0 / (1 << 53))


# the most rows token choice takes at once: its [rows, vocab] temporaries then stay under 32 MiB,
# which the heap serves again step after step while a decode step runs (the engine's malloc maps
# blocks from 4 MiB on their own elsewhere: runtime/memory/malloc_tuning.sampling_heap); 64 rows of
# a 49,152-token vocabulary in one go
HEAP_BYTES = 32 << 20


def choose(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` (rows, vocab) and its logprob (:func:`chosen_logprobs`),
    taken a few rows at a time (:data:`HEAP_BYTES`), in fp32 whatever the logits' dtype; every step
    works within a row, so a row's token and logprob are the same however the rows are split."""
    step = max(1, HEAP_BYTES // max(1, logits.shape[-1] * 4))
    tokens, logprobs = [], []
    for start in range(0, logits.shape[0], step):
        part = slice(start, start + step)
        rows = logits[part].float()
        if _all_drawn(temperature[part], top_k[part], top_p[part]) and fused_ops.usable(rows.dtype, rows.device):
            token, logprob = fused_ops.draw(rows, temperature[part], u[part])  # both in one pass
        else:
            token = choose_tokens(rows, temperature[part], top_k[part], top_p[part], u[part])
            logprob = chosen_logprobs(rows, token)
        tokens.append(token)
        logprobs.append(logprob)
    if len(tokens) == 1:
        return tokens[0], logprobs[0]
    return torch.cat(tokens), torch.cat(logprobs)


def _all_drawn(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> bool:
    """Whether every row samples from its whole tempered distribution (the usual case)."""
    return bool(((temperature > 0) & (top_k <= 0) & (top_p >= 1.0)).all())


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` (rows, vocab). temperature 0 = greedy; top_k <= 0 = off.
    A row that truncates (top-k or top-p) draws in sorted order, one that does not in vocabulary
    order, whatever the other rows do."""
    sampled = temperature > 0
    if not bool(sampled.any()):
        return logits.argmax(dim=-1)
    truncating = sampled & ((top_k > 0) | (top_p < 1.0))
    token = logits.argmax(dim=-1) if not bool(sampled.all()) else None
    for chosen, truncate in ((sampled & ~truncating, False), (truncating, True)):
        if not bool(chosen.any()):
            continue
        if token is None and bool(chosen.all()):  # every row (the usual case): no gathering
            return _draw(logits, temperature, top_k, top_p, u, truncate)
        if token is None:
            token = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        rows = chosen.nonzero().squeeze(-1)
        token[rows] = _draw(logits[rows], temperature[rows], top_k[rows], top_p[rows], u[rows], truncate)
    return token


def _draw(logits, temperature, top_k, top_p, u, truncate: bool) -> torch.Tensor:
    """One token per row from its tempered distribution (every row sampled), truncated (in sorted
    order) or not (in vocabulary order)."""
    if not truncate and fused_ops.usable(logits.dtype, logits.device):  # the same draw in C, where the kernels are built
        return fused_ops.draw(logits, temperature, u)[0]
    scaled = logits / temperature[:, None]
    if not truncate:
        return inverse_cdf(scaled.softmax(dim=-1), u)
    # Work in sorted order: top-k keeps the first k, top-p the shortest prefix reaching p.
    scaled, order = torch.sort(scaled, dim=-1, descending=True)
    probs = scaled.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    position = torch.arange(probs.shape[-1], device=probs.device)
    drop = (before >= top_p[:, None]) | ((top_k[:, None] > 0) & (position[None, :] >= top_k[:, None]))
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    return order.gather(-1, inverse_cdf(probs, u)[:, None]).squeeze(-1)


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log-softmax of ``logits`` at the ids ``tokens`` (one per row of the last dimension): by the C
    kernel where it is built (:func:`.fused_ops.logprobs`, the logprob :func:`.fused_ops.draw`
    gives with its token), else torch's fused log_softmax, which beats ``gather - logsumexp``
    although it writes the whole [rows, vocab] result."""
    if logits.dim() == 2 and fused_ops.usable(logits.dtype, logits.device):
        return fused_ops.logprobs(logits, tokens)
    return logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)


def prompt_logprobs_from(logits: torch.Tensor, prompt: list[int], topk: int):
    """Prompt logprobs (first None) and optional top-k pairs from a prefill's logits (prompt_len, vocab)."""
    logp = logits.log_softmax(-1)
    chosen = logp[:-1].gather(-1, torch.tensor(prompt[1:], device=logits.device)[:, None]).squeeze(-1)
    top = None
    if topk:
        values, indices = logp[:-1].topk(min(topk, logp.shape[-1]), dim=-1)
        top = [None, *[list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]]
    return [None, *chosen.tolist()], top


SPAN = 256  # inverse_cdf's tile width


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` (rows, n; unnormalised, >= 0), the index where the running sum first
    exceeds ``u`` (float64 in [0, 1)) times the row's total.

    In two levels, so no scan runs over the whole row: the sums of tiles of :data:`SPAN` entries
    locate the tile (their running sum in float64), and a float64 scan of that one tile the entry. Every reduction has a fixed
    size and runs within one row, so a row's pick does not depend on the other rows."""
    rows, n = probs.shape
    tiles = -(-n // SPAN)
    if tiles * SPAN != n:
        probs = torch.nn.functional.pad(probs, (0, tiles * SPAN - n))
    grid = probs.reshape(rows, tiles, SPAN)
    sums = grid.sum(dim=-1).to(torch.float64)  # (rows, tiles)
    cdf = sums.cumsum(dim=-1)
    target = (u.to(torch.float64) * cdf[:, -1])[:, None]
    tile = torch.searchsorted(cdf, target, right=True).clamp_(max=tiles - 1)  # (rows, 1)
    before = torch.nn.functional.pad(cdf[:, :-1], (1, 0))  # what the tiles before each hold
    start = before.gather(1, tile)
    entries = grid.gather(1, tile[:, :, None].expand(-1, -1, SPAN)).squeeze(1)  # (rows, SPAN)
    inner = entries.to(torch.float64).cumsum(dim=-1) + start
    pick = torch.searchsorted(inner, target, right=True).squeeze(-1)
    # rounding can leave the target past the tile's own scan: take its last non-zero entry then
    last = SPAN - 1 - (entries > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    pick = torch.minimum(pick, last)
    return (tile.squeeze(-1) * SPAN + pick).clamp_(max=n - 1)


class StopChecker:
    """Decides when a row is done: an EOS / stop token id, or a stop string in the decoded tail.
    ``stop=None`` stops at EOS; an empty list turns every stop off, EOS included (the row runs to
    ``max_tokens``), as the Tinker SDK's ``SamplingParams.stop`` defines."""

    def __init__(self, stop: str | Sequence[str] | Sequence[int] | None, eos_ids: set[int], decode: Callable):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        eos = set() if stop is not None and not isinstance(stop, str) and len(stop) == 0 else set(eos_ids)
        self.stop_ids = sorted(eos | {s for s in stops if isinstance(s, int)})
        self.stop_strings = [s for s in stops if isinstance(s, str) and s]
        self.window = 2 * max((len(s) for s in self.stop_strings), default=0) + 4
        self.decode = decode

    def hit_string(self, tokens: list[int]) -> bool:
        tail = self.decode(tokens[-self.window :])
        return any(s in tail for s in self.stop_strings)
