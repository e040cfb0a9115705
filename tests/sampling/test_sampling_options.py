"""The sample request's extra options through the sess SDK: ``stop=[]`` turns EOS off, and
``topk_sample_logprobs``, ``prompt_logprobs_last_n``, ``target_prompt_logprobs`` and
``prompt_alt_tokens_k`` answer with values equal to ``compute_logprobs`` (a forward pass)."""

from __future__ import annotations

import numpy as np
import pytest

from sess.engine import AdamParams, Datum, ModelInput, SamplingParams
from sess.engine.protocol.errors import InvalidRequest

from helpers import SENTENCES, train_steps

TOL = 1e-5


@pytest.fixture(scope="module")
def trained(svc):
    tc = svc.create_lora_training_client("tiny-llama", rank=8, alpha=16, seed=5)
    train_steps(tc, SENTENCES[:3], 2e-2, steps=2)
    prompt = tc.get_tokenizer().encode("Question: what is 3 + 4? Answer:")
    yield tc, tc.save_weights_and_get_sampling_client(), prompt
    tc.stop()


def _logprob_of(sc, context: list[int], token: int) -> float:
    return sc.compute_logprobs(context + [token]).result()[-1]


def test_empty_stop_list_turns_eos_off(svc):
    """A session taught to answer EOS at once: stop=None stops there, stop=[] runs to max_tokens."""
    tc = svc.create_lora_training_client("tiny-llama", rank=8, alpha=16, seed=1)
    try:
        eos = tc.get_tokenizer().eos_token_id
        prompt = tc.get_tokenizer().encode("Stop here")
        datum = Datum(
            ModelInput.from_ints(prompt),
            {"target_tokens": prompt[1:] + [eos], "weights": [0.0] * (len(prompt) - 1) + [1.0]},
        )
        for _ in range(15):
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(AdamParams(learning_rate=5e-2))
        sc = tc.save_weights_and_get_sampling_client()
        kept = sc.sample(prompt, sampling_params=SamplingParams(max_tokens=6, temperature=0)).result()
        assert kept.sequences[0].tokens == [eos] and kept.sequences[0].stop_reason == "stop"
        off = sc.sample(prompt, sampling_params=SamplingParams(max_tokens=6, temperature=0, stop=[])).result()
        assert len(off.sequences[0].tokens) == 6 and off.sequences[0].stop_reason == "length"
        assert off.sequences[0].tokens[0] == eos
    finally:
        tc.stop()


def test_topk_sample_logprobs_equal_compute_logprobs(trained):
    tc, sc, prompt = trained
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=7)
    out = sc.sample(prompt, sampling_params=params, topk_sample_logprobs=4).result().sequences[0]
    assert len(out.topk_logprobs) == len(out.tokens)
    for i, row in enumerate(out.topk_logprobs):
        assert len(row) == 4 and [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)
        for token, lp in row[:2]:
            assert abs(lp - _logprob_of(sc, prompt + out.tokens[:i], token)) < TOL
        # the sampled token's logprob (the sampler's) is no more than the most likely one's
        assert out.logprobs[i] <= row[0][1] + 1e-4


def test_prompt_logprobs_last_n(trained):
    tc, sc, prompt = trained
    full = sc.compute_logprobs(prompt).result()
    last = sc.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
    assert last[:-3] == [None] * (len(prompt) - 3)
    np.testing.assert_allclose(last[-3:], full[-3:], atol=TOL)
    sampled = sc.sample(
        prompt,
        sampling_params=SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
        prompt_logprobs_last_n=3,
    ).result()
    assert sampled.prompt_logprobs[:-3] == [None] * (len(prompt) - 3)
    np.testing.assert_allclose(sampled.prompt_logprobs[-3:], full[-3:], atol=TOL)
    assert sampled.topk_prompt_logprobs[:-3] == [None] * (len(prompt) - 3)
    assert all(len(row) == 2 for row in sampled.topk_prompt_logprobs[-3:])


def test_target_prompt_logprobs_and_alt_tokens_equal_a_forward_pass(trained):
    tc, sc, prompt = trained
    rng = np.random.default_rng(0)
    ids = np.stack([prompt[1:], rng.integers(0, 200, len(prompt) - 1)], axis=1)
    ids[2, 1] = -1
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=3)
    out = sc.sample(
        prompt, sampling_params=params, target_prompt_logprobs=ids, prompt_alt_tokens_k=3
    ).result()
    full = sc.compute_logprobs(prompt).result()
    got = np.asarray(out.target_prompt_logprobs)
    assert got.shape == ids.shape
    np.testing.assert_allclose(got[:, 0], full[1:], atol=TOL)
    assert got[2, 1] == 0.0
    for i in (0, 5):
        assert abs(got[i, 1] - _logprob_of(sc, prompt[: i + 1], int(ids[i, 1]))) < TOL
    tokens, logprobs = (np.asarray(out.prompt_alt_tokens[k]) for k in ("tokens", "logprobs"))
    assert tokens.shape == logprobs.shape == (len(prompt) - 1, 3)
    for i in (0, len(prompt) - 2):
        for j in range(3):
            assert abs(logprobs[i, j] - _logprob_of(sc, prompt[: i + 1], int(tokens[i, j]))) < TOL
    again = sc.sample(prompt, sampling_params=params, prompt_alt_tokens_k=3).result()
    assert again.prompt_alt_tokens["tokens"] == out.prompt_alt_tokens["tokens"]  # seeded
    greedy = sc.sample(
        prompt,
        sampling_params=SamplingParams(max_tokens=1, temperature=0),
        prompt_alt_tokens_k=2,
        topk_prompt_logprobs=1,
    ).result()
    top = [row[0][0] for row in greedy.topk_prompt_logprobs[1:]]
    assert [row[0] for row in greedy.prompt_alt_tokens["tokens"]] == top


@pytest.mark.parametrize(
    "options, field",
    [
        ({"prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs_last_n": 99, "include_prompt_logprobs": True}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),
        ({"target_prompt_logprobs": [[1, 2]]}, "target_prompt_logprobs"),
        ({"target_prompt_logprobs": [[]] * 4}, "target_prompt_logprobs"),
        ({"target_prompt_logprobs": [[10**6]] * 4}, "target_prompt_logprobs"),
        ({"prompt_alt_tokens_k": 0}, "prompt_alt_tokens_k"),
    ],
)
def test_bad_options_are_refused_naming_the_field(trained, options, field):
    tc, sc, _ = trained
    with pytest.raises(InvalidRequest, match=field):
        sc.sample([1, 2, 3, 4, 5], sampling_params=SamplingParams(max_tokens=1), **options).result()
    assert len(sc.sample([1, 2, 3], sampling_params=SamplingParams(max_tokens=2)).result().sequences) == 1
