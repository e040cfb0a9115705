"""The lean llama decoder (engine/sampling/llama_decoder.py) against the model's own modules."""

from __future__ import annotations

import pytest
import torch

from sess.engine import SamplingParams

from helpers import SENTENCES, forward_logprobs, train_steps


@pytest.mark.parametrize(
    "model,packed",
    [("tiny-llama", True), ("tiny-qwen3", True), ("tiny-llama", False)],
    ids=["llama", "qwen3", "llama-unpacked-lora"],
)
def test_lean_step_samples_what_the_modules_sample(runtime, svc, model, packed, monkeypatch):
    """The same requests (rows of two adapters and of the base model, prompts of different lengths)
    decoded by the lean step and by the modules: same tokens, logprobs equal to rounding. With
    ``packed`` (the default), the LoRA matrices go through oneDNN prepacked where it is row-invariant
    at their shapes; without, through the BLAS (as on a CPU where oneDNN's packed kernel is not)."""
    from sess.engine.sampling import llama_decoder
    from sess.engine.sampling.decode_batch import DecodeBatch, SampleJob
    from sess.engine.sampling.module_decoder import ModuleDecoder
    from sess.engine.sampling.row_invariant import row_counts
    from sess.engine.sampling.token_choice import StopChecker

    if not packed:
        monkeypatch.setattr(llama_decoder.PackedMatmul, "of", classmethod(lambda cls, weight: None))

    sessions = [svc.create_lora_training_client(model, rank=4, seed=s) for s in (1, 2)]
    tok = sessions[0].get_tokenizer()
    for i, tc in enumerate(sessions):
        train_steps(tc, [SENTENCES[i]], 5e-2)
    adapters = [runtime.sessions[tc.name].adapter for tc in sessions]
    host = runtime.host(model)
    assert isinstance(host.decoder, llama_decoder.LlamaDecoder)
    requests = [
        (tok.encode("Question: what is 3 + 4? Answer:"), 3, adapters[0]),
        (tok.encode("A longer prompt, about numbers and letters, " * 2), 2, adapters[1]),
        (tok.encode("Hi"), 2, None),
    ]

    def run(decoder):
        batch = DecodeBatch(decoder)
        results = {}
        for i, (prompt, samples, adapter) in enumerate(requests):
            batch.submit(
                SampleJob(
                    prompt=prompt,
                    num_samples=samples,
                    params=SamplingParams(max_tokens=16, temperature=1.0, seed=i),
                    adapter=adapter,
                    stopper=StopChecker(None, set(), tok.decode),
                    on_done=lambda seqs, error, i=i: results.__setitem__(i, seqs),
                )
            )
        while batch.active:
            batch.step()
        return [results[i] for i in range(len(requests))]

    calls = []

    class Counted:
        merges = True

        def prefill(self, jobs):
            return host.decoder.prefill(jobs)

        def step(self, *args):
            calls.append(1)
            return host.decoder.step(*args)

    fast, modules = run(Counted()), run(ModuleDecoder(host.activate))
    plan = host.decoder._plan(host.model, adapters[0])
    matrices = [m for layer in plan[:-1] for t in layer if t for m in (t.a, *(p[1] for p in t.parts))]
    for m in matrices:  # prepacked, except where oneDNN's packed kernel is not row-invariant
        if not packed:
            assert isinstance(m, torch.Tensor)
        elif not isinstance(m, llama_decoder.PackedMatmul):
            assert not row_counts("onednn packed", m.shape[1], m.shape[0], m, False).exact
    assert len(calls) == 15  # every decode step after the prefill went the lean way
    for got, expected in zip(fast, modules):
        for a, b in zip(got, expected):
            assert a.tokens == b.tokens
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    for tc in sessions:
        tc.stop()


def test_other_architectures_keep_the_module_path(runtime):
    from sess.engine.sampling.module_decoder import ModuleDecoder

    host = runtime.host("tiny-gpt-oss")
    assert isinstance(host.decoder, ModuleDecoder) and "gpt_oss" in host.lean_unsupported


def test_a_live_sampler_follows_its_session_through_training(svc):
    """The lean step keeps each adapter's LoRA terms prepared between steps; after optim_step
    changes a live session's weights, its sampler must use the new ones."""
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=7)
    tok = tc.get_tokenizer()
    train_steps(tc, [SENTENCES[0]], 5e-2)
    sc, prompt = tc.create_sampling_client(), tok.encode("Numbers:")
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    before = sc.sample(prompt, sampling_params=params).result().sequences[0]
    train_steps(tc, [SENTENCES[1]], 5e-2, steps=2)
    after = sc.sample(prompt, sampling_params=params).result().sequences[0]
    expected = forward_logprobs(tc, prompt, after.tokens)
    assert max(abs(a - b) for a, b in zip(after.logprobs, expected)) < 1e-4
    assert after.logprobs != before.logprobs
    tc.stop()
