"""``SamplingClient``: samples from a checkpoint, a live session's current weights, or a base model.

Every ``sample`` returns an :class:`~.futures.APIFuture` at once; many requests are in flight
together and the engine decodes them in one continuous batch. Each sampled token carries its
logprob, which (at temperature 1, untruncated) equals what ``forward`` computes for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from sess.engine.protocol import requests as rq
from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.types import ModelInput, SampleResponse, SamplingParams
from sess.engine.sdk.futures import APIFuture, with_async_twins

if TYPE_CHECKING:
    from sess.engine.sdk.service_client import ServiceClient


@with_async_twins("sample", "compute_logprobs")
class SamplingClient:
    """Samples from a checkpoint, a live session's weights, or the base model (adapter off)."""

    def __init__(self, service: ServiceClient, target: rq.Target, base_model: str):
        self.service = service
        self.target = target
        self.base_model = base_model
        self.model_path = target.model_path

    def get_tokenizer(self):
        """The sampled model's tokenizer (see :meth:`ServiceClient.get_tokenizer`).

        Returns:
            A ``transformers`` tokenizer."""
        return self.service.get_tokenizer(self.base_model)

    def _prompt(self, prompt) -> list[int]:
        if isinstance(prompt, ModelInput):
            return prompt.to_ints()
        if isinstance(prompt, str):
            return list(self.get_tokenizer().encode(prompt))
        if isinstance(prompt, Sequence) and all(
            isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt
        ):
            return [int(t) for t in prompt]
        raise InvalidRequest("prompt: expected a ModelInput, a list of token ids or a string")

    def sample(
        self,
        prompt,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        *,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int | None = None,
        include_trainer_logprobs: bool = False,
        topk_sample_logprobs: int | None = None,
        prompt_logprobs_last_n: int | None = None,
        target_prompt_logprobs=None,
        prompt_alt_tokens_k: int | None = None,
    ) -> APIFuture[SampleResponse]:
        """Sample ``num_samples`` completions of ``prompt``; the request joins the engine's decode batch.

        Args:
            prompt: a :class:`ModelInput` or a list of token ids.
            num_samples: completions to draw.
            sampling_params: max_tokens, temperature, top_p, top_k, seed, stop; None: defaults.
            include_prompt_logprobs: also return each prompt token's logprob.
            topk_prompt_logprobs: also return the k most likely tokens at each prompt position.
            include_trainer_logprobs: each sequence also carries ``trainer_logprobs``: the trainer's
                logprob of each sampled token (one forward pass of prompt + tokens through the
                training path, on the target's weights when the request finishes), next to the
                sampler's ``logprobs``; what the two differ by is the sampler's drift.
            topk_sample_logprobs: each sequence also carries ``topk_logprobs``: the k most likely
                (token, logprob) at each sampled position.
            prompt_logprobs_last_n: prompt logprobs (and top-k) only for the last N prompt tokens,
                earlier entries None; 1..len(prompt) - 1, with prompt logprobs asked for.
            target_prompt_logprobs: a [len(prompt) - 1, K] array of token ids (-1: none); the
                response's ``target_prompt_logprobs[i][j]`` is the logprob of id [i][j] at prompt
                position i + 1 (0.0 for -1).
            prompt_alt_tokens_k: the response's ``prompt_alt_tokens`` holds k draws (at the
                request's temperature, seeded by its seed) from the next-token distribution at each
                prompt position after the first, with their logprobs.
            Every logprob is the model's own (temperature 1), as :meth:`compute_logprobs` gives it.

        Returns:
            A future of a :class:`SampleResponse`: each sequence's tokens, logprobs and stop reason."""
        if target_prompt_logprobs is not None:
            target_prompt_logprobs = np.asarray(target_prompt_logprobs, dtype=np.int64).tolist()
        request = rq.SampleRequest(
            target=self.target,
            prompt=self._prompt(prompt),
            num_samples=num_samples,
            sampling_params=sampling_params or SamplingParams(),
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            include_trainer_logprobs=include_trainer_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
            target_prompt_logprobs=target_prompt_logprobs,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
        )
        request.check()
        return self.service.submitter.submit("sample", request.to_wire(), SampleResponse.from_wire)

    def compute_logprobs(
        self, prompt, prompt_logprobs_last_n: int | None = None
    ) -> APIFuture[list[float | None]]:
        """Each prompt token's logprob given the ones before it (the first is None).

        Args:
            prompt: a :class:`ModelInput` or a list of token ids.
            prompt_logprobs_last_n: score only the last N tokens (1..len(prompt) - 1); earlier
                entries are None.

        Returns:
            A future of one logprob per prompt token."""
        request = rq.ComputeLogprobs(
            target=self.target, prompt=self._prompt(prompt), prompt_logprobs_last_n=prompt_logprobs_last_n
        )
        request.check()
        return self.service.submitter.submit("compute_logprobs", request.to_wire(), lambda r: r["logprobs"])

    def stop(self) -> None:
        """Release this client; checkpoints it sampled from stay on the engine.

        Returns:
            None."""

    def __repr__(self) -> str:
        return f"<SamplingClient {self.target.to_wire()}>"
