"""The prompt tokens the sampler found in its prefix cache, on every protocol's sample response:
the sess SDK's ``prompt_cache_hit_tokens``, Tinker's ``SampleResponse.prompt_cache_hit_tokens`` and
OpenAI's ``usage.prompt_tokens_details.cached_tokens``; the usage counts them as a part of prefill."""

from __future__ import annotations

import openai
import pytest

from sess.engine import ServiceClient
from sess.engine.protocol.types import SamplingParams
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import schema

from tinker_helpers import TinkerHttp


@pytest.fixture(scope="module")
def svc(http_engine, sess_home):
    client = ServiceClient(http_engine["url"], home=sess_home)
    yield client
    client.close()


def test_the_sdk_reports_a_repeated_prompts_hits_and_usage_counts_them_apart(svc):
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=11)
    tok = tc.get_tokenizer()
    sampler = tc.create_sampling_client()
    prompt = tok.encode("A prompt the prefix cache sees twice: the sess SDK's. Answer:")
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    first = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    before = svc.get_usage(tc.name)
    again = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    after = svc.get_usage(tc.name)
    assert first.prompt_cache_hit_tokens < again.prompt_cache_hit_tokens == len(prompt) - 1
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    assert [s.logprobs for s in again.sequences] == [s.logprobs for s in first.sequences]
    assert after.cached_prefill_tokens - before.cached_prefill_tokens == len(prompt) - 1
    assert after.prefill_tokens - before.prefill_tokens == len(prompt)  # the cached ones a part of them
    tc.stop()


def test_tinker_and_openai_report_the_hits(http_engine, sess_home, svc):
    key = KeyStore(sess_home).add("prefix-cache")["key"]
    tok = svc.get_tokenizer("tiny-llama")
    tinker = TinkerHttp(http_engine["url"], key)
    try:
        sampler = tinker.ok(
            "/create_sampling_session",
            {"session_id": tinker.session(), "sampling_session_seq_id": 0, "base_model": "tiny-llama"},
        )["sampling_session_id"]
        prompt = tok.encode("A prompt the prefix cache sees twice over the Tinker routes. Answer:")
        hits = []
        for seq in range(2):
            body = {
                "sampling_session_id": sampler,
                "seq_id": seq,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "sampling_params": {"max_tokens": 2, "seed": 1},
            }
            out = schema.SampleResponse()
            out.ParseFromString(tinker.result(tinker.ok("/asample", body)["request_id"]))
            hits.append(out.prompt_cache_hit_tokens)
        assert hits[0] < hits[1] == len(prompt) - 1
    finally:
        tinker.close()

    client = openai.OpenAI(base_url=f"{http_engine['url']}/v1", api_key=key, max_retries=0)
    asked = dict(
        model="tiny-llama", prompt="Twice over the OpenAI routes, the same prompt:", max_tokens=2, seed=1
    )
    first, again = (client.completions.create(**asked) for _ in range(2))
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, again)]
    assert cached[0] < cached[1] == again.usage.prompt_tokens - 1
