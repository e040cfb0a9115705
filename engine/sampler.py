"""Token selection for batched sampling: per-row temperature / top-k / top-p and counter-based RNG.

Each row draws one uniform number per step from a hash of (its request's seed, its sample index,
the step), so a seeded request samples the same tokens whichever other requests share its batch,
with no per-row generator objects or Python work per row. A token is drawn by inverse CDF from the
tempered, truncated distribution; the logprob reported is the model's own (temperature 1,
untruncated), so it equals what ``forward`` computes for the same token.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import torch

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


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` (rows, vocab). temperature 0 = greedy; top_k <= 0 = off."""
    greedy = logits.argmax(dim=-1)
    sampled_rows = temperature > 0
    if not bool(sampled_rows.any()):
        return greedy
    scaled = logits / torch.where(sampled_rows, temperature, torch.ones_like(temperature))[:, None]
    truncate = bool(((top_k > 0) | (top_p < 1.0)).any())
    if truncate:
        # Work in sorted order: top-k keeps the first k, top-p the shortest prefix reaching p.
        scaled, order = torch.sort(scaled, dim=-1, descending=True)
        probs = scaled.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        position = torch.arange(probs.shape[-1], device=probs.device)
        drop = (before >= top_p[:, None]) | ((top_k[:, None] > 0) & (position[None, :] >= top_k[:, None]))
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
    else:
        probs = scaled.softmax(dim=-1)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    pick = pick.clamp_(max=probs.shape[-1] - 1)
    token = order.gather(-1, pick[:, None]).squeeze(-1) if truncate else pick
    return torch.where(sampled_rows, token, greedy)


class StopChecker:
    """Decides when a row is done: an EOS / stop token id, or a stop string in the decoded tail."""

    def __init__(self, stop: str | Sequence[str] | Sequence[int] | None, eos_ids: set[int], decode: Callable):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop_ids = sorted(set(eos_ids) | {s for s in stops if isinstance(s, int)})
        self.stop_strings = [s for s in stops if isinstance(s, str) and s]
        self.window = 2 * max((len(s) for s in self.stop_strings), default=0) + 4
        self.decode = decode

    def hit_string(self, tokens: list[int]) -> bool:
        tail = self.decode(tokens[-self.window :])
        return any(s in tail for s in self.stop_strings)
