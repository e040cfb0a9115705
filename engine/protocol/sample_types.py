"""What a sample request answers: its sequences (tokens, logprobs, stop reason and the per-token
extras asked for) and the prompt's scores (logprobs, top-k, chosen ids' logprobs, alternative draws).
JSON-able dataclasses, re-exported by :mod:`sess.engine.protocol.types`."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]  # the sampler's logprob of each token
    stop_reason: str  # "stop" | "length"
    # asked for (``include_trainer_logprobs``): the trainer's logprob of each token, from one forward
    # pass of prompt + tokens through the training path; absent from the wire otherwise
    trainer_logprobs: list[float] | None = None
    # asked for (``topk_sample_logprobs``): the k most likely (token, logprob) at each sampled position
    topk_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    # asked for (``target_prompt_logprobs``): the logprob of each id asked, 0.0 where it was -1
    target_prompt_logprobs: list[list[float]] | None = None
    # asked for (``prompt_alt_tokens_k``): {"tokens": [[id] * k], "logprobs": [[lp] * k]}, one row per
    # prompt position after the first
    prompt_alt_tokens: dict | None = None
    # the prompt's first tokens whose KV entries the sampler found cached from earlier requests of
    # the same weights, and did not compute again (0: none, or the cache is off)
    prompt_cache_hit_tokens: int = 0

    def to_wire(self) -> dict:
        wire = asdict(self)
        for sequence in wire["sequences"]:
            for key in ("trainer_logprobs", "topk_logprobs"):
                if sequence[key] is None:
                    del sequence[key]
        for key in ("target_prompt_logprobs", "prompt_alt_tokens"):
            if wire[key] is None:
                del wire[key]
        return wire

    @classmethod
    def from_wire(cls, wire: dict) -> SampleResponse:
        topk = _pairs(wire.get("topk_prompt_logprobs"))
        sequences = [
            SampledSequence(**{**s, "topk_logprobs": _pairs(s.get("topk_logprobs"))})
            for s in wire["sequences"]
        ]
        return cls(
            sequences=sequences,
            prompt_logprobs=wire.get("prompt_logprobs"),
            topk_prompt_logprobs=topk,
            target_prompt_logprobs=wire.get("target_prompt_logprobs"),
            prompt_alt_tokens=wire.get("prompt_alt_tokens"),
            prompt_cache_hit_tokens=int(wire.get("prompt_cache_hit_tokens", 0)),
        )


def _pairs(rows: list | None) -> list | None:
    """Top-k rows read back from JSON: each (token, logprob) pair a tuple again."""
    if rows is None:
        return None
    return [None if row is None else [tuple(pair) for pair in row] for row in rows]
