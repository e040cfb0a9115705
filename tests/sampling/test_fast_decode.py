"""The lean llama decoder (engine/sampling/llama_decoder.py) against the model's own modules."""

from __future__ import annotations

import pytest
import torch

from sess.engine import SamplingParams

from helpers import SENTENCES, budget, forward_logprobs, train_steps


@pytest.mark.parametrize(
    "model,form,packed",
    [
        ("tiny-llama", "merged", True),
        ("tiny-qwen3", "merged", True),
        ("tiny-llama", "merged", False),
        ("tiny-llama", "terms", True),
        ("tiny-llama", "terms", False),
    ],
    ids=["llama", "qwen3", "llama-unpacked", "llama-terms", "llama-terms-unpacked"],
)
def test_lean_step_samples_what_the_modules_sample(runtime, svc, model, form, packed, monkeypatch):
    """The same requests (rows of two adapters and of the base model, prompts of different lengths)
    decoded by the lean step and by the modules: same tokens, logprobs equal to rounding. Each
    adapter's plan ``form`` (engine/sampling/lora_plans.py): ``merged`` (the default for an fp32 base
    on CPU) or ``terms``. With ``packed`` (the default), the plan's matrices go through oneDNN
    prepacked where it is row-invariant at their shapes; without, through the BLAS or unpacked
    oneDNN (as on a CPU where oneDNN's packed kernel is not)."""
    from sess.engine.sampling import llama_decoder
    from sess.engine.sampling.decode_batch import DecodeBatch, SampleJob
    from sess.engine.sampling.lora_plans import Fused, Terms
    from sess.engine.sampling.module_decoder import ModuleDecoder
    from sess.engine.sampling.row_invariant import PackedMatmul, row_counts
    from sess.engine.sampling.token_choice import StopChecker

    if not packed:
        monkeypatch.setattr(PackedMatmul, "of", classmethod(lambda cls, weight: None))

    sessions = [svc.create_lora_training_client(model, rank=4, seed=s) for s in (1, 2)]
    tok = sessions[0].get_tokenizer()
    for i, tc in enumerate(sessions):
        train_steps(tc, [SENTENCES[i]], 5e-2)
    adapters = [runtime.sessions[tc.name].adapter for tc in sessions]
    host = runtime.host(model)
    assert isinstance(host.decoder, llama_decoder.LlamaDecoder)
    assert host.decoder.merges_lora()  # the default here: fp32 on CPU, copies within the budget
    monkeypatch.setattr(host.decoder, "merge_lora", form == "merged")
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

        def adapter_slots(self):
            return host.decoder.adapter_slots()

    fast, modules = run(Counted()), run(ModuleDecoder(host.activate))
    plan = host.decoder.plan(adapters[0])
    bundles = [b for layer in plan[:-1] for b in layer if b is not None]
    assert all(isinstance(b, Terms) == (form == "terms") for b in bundles)
    if form == "terms":
        matrices = [m for t in bundles for m in (t.a, *(p[1] for p in t.parts))]
        for m in matrices:  # prepacked, except where oneDNN's packed kernel is not row-invariant
            if not packed:
                assert isinstance(m, torch.Tensor)
            elif not isinstance(m, PackedMatmul):
                assert not row_counts("onednn packed", m.shape[1], m.shape[0], m, False).exact
    else:  # q/k/v and gate/up stacked into one prepacked matmul each, where it is row-invariant
        config = host.model.config
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shapes = ((config.num_attention_heads + 2 * config.num_key_value_heads) * dim, 2 * config.intermediate_size)
        for layer in plan[:-1]:
            for b, out in zip((layer[0], layer[2]), shapes):
                exact = row_counts("onednn packed", config.hidden_size, out, torch.zeros(1), False).exact
                assert isinstance(b, Fused) == (packed and exact)
                if isinstance(b, Fused):
                    assert b.matmul.out_features == sum(b.sizes) == out
        for m in (m for b in bundles if not isinstance(b, Fused) for m in b if m is not None):
            if not packed:
                assert not isinstance(m, PackedMatmul)
            elif not isinstance(m, PackedMatmul):
                w = m.keywords["weight"]
                assert not row_counts("onednn packed", w.shape[1], w.shape[0], w, False).exact
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


def test_merged_plans_take_adapter_slots_and_the_other_requests_wait(runtime, svc):
    """A merged plan holds a copy of the weights its adapter changes, so the copy budget gives a
    number of adapter slots: the decode batch runs the rows of at most that many adapters at once,
    the others wait for rows to finish, and every request gets the tokens and logprobs it gets alone."""
    from sess.engine.sampling.decode_batch import DecodeBatch, SampleJob
    from sess.engine.sampling.token_choice import StopChecker

    sessions = [svc.create_lora_training_client("tiny-llama", rank=4, seed=s) for s in (3, 4, 5)]
    tok = sessions[0].get_tokenizer()
    for i, tc in enumerate(sessions):
        train_steps(tc, [SENTENCES[i]], 5e-2)
    adapters = [runtime.sessions[tc.name].adapter for tc in sessions]
    decoder = runtime.host("tiny-llama").decoder
    assert decoder.merges_lora()
    prompt = tok.encode("Question: what is 3 + 4? Answer:")

    class Watched:  # the decoder, recording which adapters each step runs
        merges = True

        def __init__(self):
            self.seen: list[set] = []

        def prefill(self, jobs):
            return decoder.prefill(jobs)

        def step(self, cache, rows, *args):
            self.seen.append({a for a in rows if a is not None})
            return decoder.step(cache, rows, *args)

        def adapter_slots(self):
            return decoder.adapter_slots()

    def run(jobs: list[tuple[str | None, int, int]]) -> tuple[list, list[set]]:
        watched, results = Watched(), {}
        batch = DecodeBatch(watched)
        for i, (adapter, tokens, seed) in enumerate(jobs):
            batch.submit(
                SampleJob(
                    prompt=prompt,
                    num_samples=2,
                    params=SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed),
                    adapter=adapter,
                    stopper=StopChecker(None, set(), tok.decode),
                    on_done=lambda seqs, error, i=i: results.__setitem__(i, [(s.tokens, s.logprobs) for s in seqs]),
                )
            )
        while batch.active:
            batch.step()
        return [results[i] for i in range(len(jobs))], watched.seen

    jobs = [(adapters[0], 6, 0), (None, 9, 1), (adapters[1], 9, 2), (adapters[2], 4, 3)]
    with budget(runtime, 2 * decoder.copy_bytes()):
        assert decoder.adapter_slots() == 1
        together, seen = run(jobs)
        alone = [run([job])[0][0] for job in jobs]
    assert max(len(adapters_of_step) for adapters_of_step in seen) == 1
    assert {a for s in seen for a in s} == set(adapters)  # each adapter had its turn
    assert together == alone  # tokens and logprobs of every sample, to the bit
    for tc in sessions:
        tc.stop()
