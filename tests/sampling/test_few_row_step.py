"""Decode steps of one or two rows as made-ready C calls (engine/sampling/few_row_step.py): the
tokens and logprobs of the lean decoder's general step, to the bit, and made again when weights change."""

from __future__ import annotations

import pytest

from sess.engine import SamplingParams
from sess.engine.sampling import few_row_step

from helpers import SENTENCES, train_steps


def _sample(decoder, tok, requests, max_tokens: int = 12):
    """Each request ``(prompt, samples, adapter)`` decoded alone (its rows are the whole batch):
    per request its sequences' tokens and logprobs."""
    from sess.engine.sampling.decode_batch import DecodeBatch, SampleJob
    from sess.engine.sampling.token_choice import StopChecker

    out = []
    for i, (prompt, samples, adapter) in enumerate(requests):
        batch, done = DecodeBatch(decoder), {}
        batch.submit(
            SampleJob(
                prompt=prompt,
                num_samples=samples,
                params=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i),
                adapter=adapter,
                stopper=StopChecker(None, set(), tok.decode),
                on_done=lambda seqs, error, done=done: done.__setitem__("seqs", seqs),
            )
        )
        while batch.active:
            batch.step()
        out.append([(s.tokens, s.logprobs) for s in done["seqs"]])
    return out


@pytest.mark.parametrize("svc", ["inproc"], indirect=True)
def test_one_and_two_rows_get_the_general_steps_bits(runtime, svc, monkeypatch):
    """One row and two rows (a prompt's two samples, which share its entries), of an adapter and
    of the base model: the same tokens and the same logprobs to the bit as the general step, and
    the made-ready step ran every decode step of them."""
    from sess.engine.sampling import llama_decoder

    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=1)
    tok = tc.get_tokenizer()
    train_steps(tc, [SENTENCES[0]], 5e-2)
    adapter = runtime.sessions[tc.name].adapter
    host = runtime.host("tiny-llama")
    decoder = host.decoder
    assert isinstance(decoder, llama_decoder.LlamaDecoder)
    if not (decoder.uses_kernels() and decoder.attention_kernel):
        pytest.skip("the sampler's C kernels are not built here")
    requests = [
        (tok.encode("Question: what is 3 + 4? Answer:"), 1, adapter),
        (tok.encode("A longer prompt, about numbers and letters."), 2, adapter),
        (tok.encode("Hi"), 1, None),
        (tok.encode("Hello there"), 2, None),
    ]
    ran = []
    original = few_row_step.FewRowStep.__call__
    monkeypatch.setattr(
        few_row_step.FewRowStep, "__call__", lambda self, *a: ran.append(1) or original(self, *a)
    )
    ready = _sample(decoder, tok, requests)
    if not ran:
        pytest.skip("a matmul of tiny-llama has no few-row kernel on this CPU")
    assert len(ran) == 4 * 11  # every step after each prefill's first token
    monkeypatch.setattr(few_row_step, "make", lambda *args: None)
    decoder.release_memory({adapter})  # drops the made-ready steps with the base copies
    general = _sample(decoder, tok, requests)
    assert len(ran) == 4 * 11
    assert ready == general
    tc.stop()


@pytest.mark.parametrize("svc", ["inproc"], indirect=True)
def test_a_step_is_made_again_when_the_adapter_trains(runtime, svc, monkeypatch):
    """After an optimizer step the adapter's plan is made again, and the made-ready step with it:
    a step after training samples what the general step samples from the new weights."""
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=2)
    tok = tc.get_tokenizer()
    train_steps(tc, [SENTENCES[1]], 5e-2)
    adapter = runtime.sessions[tc.name].adapter
    decoder = runtime.host("tiny-llama").decoder
    if not (decoder.uses_kernels() and decoder.attention_kernel):
        pytest.skip("the sampler's C kernels are not built here")
    request = [(tok.encode("Two plus"), 1, adapter)]
    made = []
    original = few_row_step.make
    monkeypatch.setattr(few_row_step, "make", lambda *args: made.append(1) or original(*args))
    before = _sample(decoder, tok, request)
    train_steps(tc, [SENTENCES[1]], 5e-2)
    after = _sample(decoder, tok, request)
    assert len(made) == 2  # once for the first weights, once for the trained ones
    assert after != before
    monkeypatch.setattr(few_row_step, "make", lambda *args: None)
    decoder.release_memory({adapter})
    assert _sample(decoder, tok, request) == after
    tc.stop()
