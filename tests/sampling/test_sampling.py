"""Sampling: logprob parity with forward, seeds, stop conditions, truncation and concurrency."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sess.engine import SamplingParams
from sess.engine.protocol.errors import InvalidRequest

from helpers import (
    SENTENCES,
    assert_same_samples,
    budget,
    ce_datum,
    decode_plan,
    forward_logprobs,
    train_steps,
)


@pytest.fixture(scope="module")
def trained(svc):
    """A session whose adapter has moved off its zero init, and a prompt."""
    tc = svc.create_lora_training_client("tiny-llama", rank=8, alpha=16, seed=3)
    tok = tc.get_tokenizer()
    train_steps(tc, SENTENCES, 2e-2, steps=3)
    prompt = tok.encode("Question: what is 3 + 4? Answer:")
    yield tc, prompt
    tc.stop()


@pytest.mark.parametrize("source", ["checkpoint", "live"])
def test_sample_logprobs_equal_forward(trained, source):
    tc, prompt = trained
    sc = tc.save_weights_and_get_sampling_client() if source == "checkpoint" else tc.create_sampling_client()
    result = sc.sample(
        prompt, num_samples=4, sampling_params=SamplingParams(max_tokens=24, temperature=1.0, seed=11)
    ).result()
    assert len(result.sequences) == 4
    worst = 0.0
    for seq in result.sequences:
        assert len(seq.tokens) == len(seq.logprobs) > 0
        expected = forward_logprobs(tc, prompt, seq.tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(seq.logprobs, expected)))
        computed = sc.compute_logprobs(prompt + seq.tokens).result()
        assert computed[0] is None
        worst = max(worst, max(abs(a - b) for a, b in zip(computed[len(prompt) :], expected)))
    assert worst < 1e-4


def test_samples_that_go_on_after_their_prompts_first_sample_stops_still_equal_forward(trained):
    """The first sample of a prompt holds the prompt's entries the others read: when it stops
    first (here at a stop token it draws third) the next one takes them over, and every sample's
    logprobs still equal ``forward``'s."""
    tc, prompt = trained
    sc = tc.save_weights_and_get_sampling_client()
    params = {"max_tokens": 24, "temperature": 1.0, "seed": 11}
    first = sc.sample(prompt, num_samples=4, sampling_params=SamplingParams(**params)).result().sequences[0]
    stop = first.tokens[2]
    result = sc.sample(prompt, num_samples=4, sampling_params=SamplingParams(**params, stop=[stop])).result()
    lengths = [len(seq.tokens) for seq in result.sequences]
    assert lengths[0] == 3 and max(lengths[1:]) > 3, lengths  # the others go on after it
    for seq in result.sequences:
        expected = forward_logprobs(tc, prompt, seq.tokens)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 1e-4


def _wire_sample(svc, target: dict, prompt: list[int], **extra) -> dict:
    """A sample request as a transport sends it, and its result as it comes back (the wire dict)."""
    args = {"target": target, "prompt": prompt, "num_samples": 2, **extra}
    args["sampling_params"] = SamplingParams(max_tokens=10, temperature=1.0, seed=7).to_wire()
    op = svc.transport.submit("sample", args)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, result = svc.transport.wait(op, 10)
        if done:
            return result
    raise AssertionError("the sample request did not finish")


@pytest.mark.parametrize("source", ["checkpoint", "live"])
def test_trainer_logprobs_only_when_asked_and_equal_compute_logprobs(svc, trained, source):
    """``include_trainer_logprobs``: absent from the answer unless asked; asked, one trainer logprob
    per sampled token, equal to ``compute_logprobs`` of prompt + completion, the same tokens."""
    tc, prompt = trained
    sc = tc.save_weights_and_get_sampling_client() if source == "checkpoint" else tc.create_sampling_client()
    target = {"model_path": sc.model_path} if source == "checkpoint" else {"session": tc.name}
    plain = _wire_sample(svc, target, prompt)
    assert all("trainer_logprobs" not in s for s in plain["sequences"])
    asked = _wire_sample(svc, target, prompt, include_trainer_logprobs=True)
    assert [s["tokens"] for s in asked["sequences"]] == [s["tokens"] for s in plain["sequences"]]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7)
    through_sdk = sc.sample(prompt, 2, params, include_trainer_logprobs=True).result().sequences
    assert [s.trainer_logprobs for s in through_sdk] == [s["trainer_logprobs"] for s in asked["sequences"]]
    assert sc.sample(prompt, 1, params).result().sequences[0].trainer_logprobs is None
    for sequence in asked["sequences"]:
        tokens, trainer = sequence["tokens"], sequence["trainer_logprobs"]
        assert len(trainer) == len(tokens) == len(sequence["logprobs"]) > 0
        computed = sc.compute_logprobs(prompt + tokens).result()[len(prompt) :]
        assert max(abs(a - b) for a, b in zip(trainer, computed)) < 1e-5
        # the built-in sampler's own logprobs: the drift is float32 noise
        assert max(abs(a - b) for a, b in zip(trainer, sequence["logprobs"])) < 1e-4
    with pytest.raises(InvalidRequest, match="include_trainer_logprobs"):
        _wire_sample(svc, target, prompt, include_trainer_logprobs="yes")


def test_prompt_logprobs_and_topk(trained):
    tc, prompt = trained
    sc = tc.create_sampling_client()
    result = sc.sample(
        prompt,
        sampling_params=SamplingParams(max_tokens=2, seed=0),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    expected = sc.compute_logprobs(prompt).result()
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    assert max(abs(a - b) for a, b in zip(result.prompt_logprobs[1:], expected[1:])) < 1e-5
    top = result.topk_prompt_logprobs
    assert top[0] is None and all(len(row) == 3 for row in top[1:])
    assert all(row[0][1] >= row[1][1] >= row[2][1] for row in top[1:])
    assert all(row[0][1] >= lp - 1e-6 for row, lp in zip(top[1:], result.prompt_logprobs[1:]))


def test_seed_reproducibility(trained):
    tc, prompt = trained
    sc = tc.save_weights_and_get_sampling_client()
    params = dict(max_tokens=16, temperature=1.0)
    a = sc.sample(prompt, num_samples=3, sampling_params=SamplingParams(seed=5, **params)).result()
    b = sc.sample(prompt, num_samples=3, sampling_params=SamplingParams(seed=5, **params)).result()
    c = sc.sample(prompt, num_samples=3, sampling_params=SamplingParams(seed=6, **params)).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert [s.tokens for s in a.sequences] != [s.tokens for s in c.sequences]
    # the rows of one request are different draws, not copies
    assert len({tuple(s.tokens) for s in a.sequences}) > 1


def test_same_session_seed_same_adapter_init(svc, tmp_path):
    from safetensors.torch import load_file

    def init_weights(seed, tag):
        with svc.create_lora_training_client("tiny-llama", rank=4, seed=seed) as tc:
            path = tc.save_weights_for_sampler().result().path
            return load_file(str(svc.download_checkpoint(path, tmp_path / tag) / "adapter_model.safetensors"))

    a, b, c = init_weights(1, "a"), init_weights(1, "b"), init_weights(2, "c")
    assert all((a[k] == b[k]).all() for k in a)
    assert any(not (a[k] == c[k]).all() for k in a if "lora_A" in k)


def test_greedy_top_k_top_p_and_stops(trained):
    tc, prompt = trained
    sc = tc.create_sampling_client()
    greedy = sc.sample(
        prompt, num_samples=2, sampling_params=SamplingParams(max_tokens=12, temperature=0)
    ).result()
    tokens = greedy.sequences[0].tokens
    assert (
        greedy.sequences[1].tokens == tokens
        and greedy.sequences[0].stop_reason == "length"
        and len(tokens) == 12
    )
    top1 = sc.sample(
        prompt, sampling_params=SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=1)
    ).result()
    assert top1.sequences[0].tokens == tokens
    nucleus = sc.sample(
        prompt, sampling_params=SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=2)
    ).result()
    assert nucleus.sequences[0].tokens == tokens

    stop_id = tokens[4]
    by_id = (
        sc.sample(prompt, sampling_params=SamplingParams(max_tokens=12, temperature=0, stop=[stop_id]))
        .result()
        .sequences[0]
    )
    assert by_id.stop_reason == "stop" and by_id.tokens == tokens[: tokens.index(stop_id) + 1]

    tok = tc.get_tokenizer()
    text = tok.decode(tokens[:6])
    stop_text = text[-3:] if text[-3:].strip() else text[-4:]
    by_text = (
        sc.sample(prompt, sampling_params=SamplingParams(max_tokens=12, temperature=0, stop=stop_text))
        .result()
        .sequences[0]
    )
    assert by_text.stop_reason == "stop" and stop_text in tok.decode(by_text.tokens)
    assert len(by_text.tokens) <= 6

    eos = tok.eos_token_id
    assert eos is not None
    base = tc.service.create_sampling_client(base_model="tiny-llama")
    out = base.sample(prompt, sampling_params=SamplingParams(max_tokens=5, temperature=0)).result()
    assert len(out.sequences[0].tokens) <= 5


def test_string_prompt_and_base_model_sampler(svc, trained):
    tc, _ = trained
    base = svc.create_sampling_client(base_model="tiny-llama")
    out = base.sample("Hello", sampling_params=SamplingParams(max_tokens=4, seed=0)).result()
    assert len(out.sequences[0].tokens) == 4
    # the base sampler ignores every adapter: its logprobs differ from the trained session's
    prompt = tc.get_tokenizer().encode("Seven times six is 42.")
    assert (
        base.compute_logprobs(prompt).result()
        != tc.create_sampling_client().compute_logprobs(prompt).result()
    )


def test_sixteen_concurrent_samples(svc, trained):
    tc, prompt = trained
    sc = tc.save_weights_and_get_sampling_client()
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in range(16)]
    futures = [sc.sample(prompt, num_samples=2, sampling_params=p) for p in params]
    concurrent = [f.result(timeout=120) for f in futures]
    for p, got in zip(params, concurrent):
        alone = sc.sample(prompt, num_samples=2, sampling_params=p).result()
        assert_same_samples(svc, got.sequences, alone.sequences)


def test_rows_of_different_adapters_in_one_batch_match_their_own_forward(svc):
    """Concurrent requests from four sessions decode together; each row keeps its own adapter."""
    sessions = [svc.create_lora_training_client("tiny-llama", rank=4, alpha=8, seed=s) for s in range(4)]
    tok = sessions[0].get_tokenizer()
    for i, tc in enumerate(sessions):  # move each adapter off zero differently
        train_steps(tc, [SENTENCES[i]], 5e-2)
    samplers = [tc.save_weights_and_get_sampling_client() for tc in sessions]
    # prompts of different lengths: they are prefilled together, left-padded, then decode together
    prompts = [tok.encode("Numbers:"), tok.encode("A much longer prompt, about numbers and letters:")]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=4)
    futures = [
        sc.sample(prompts[j], num_samples=3, sampling_params=params) for sc in samplers for j in range(2)
    ]
    results = [f.result() for f in futures]
    for i, result in enumerate(results):
        tc, prompt = sessions[i // 2], prompts[i % 2]
        for seq in result.sequences:
            expected = forward_logprobs(tc, prompt, seq.tokens)
            assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 1e-4
    # the same seed and prompt on different adapters draws from different distributions
    assert results[0].sequences[0].logprobs != results[2].sequences[0].logprobs
    for tc in sessions:
        tc.stop()


@pytest.mark.parametrize(
    "model, path",
    [
        ("tiny-llama", "lean step"),
        ("tiny-llama", "modules"),
        ("tiny-llama", "lean step, no packed copies"),  # a memory budget too small for them
        ("tiny-llama", "lean step, torch ops"),  # where the C kernels are not built
        pytest.param("smollm2-135m", "lean step", marks=pytest.mark.slow),  # real weights and shapes
    ],
)
def test_a_request_gets_identical_logprobs_whatever_shares_its_batch(runtime, svc, model, path):
    """The decode batch is driven step by step so each composition surely happens: the same seeded
    request alone, after a one-row request (its rows at odd offsets of a 5-row batch), prefilled
    together with a long prompt or on a prefix it shares with other prompts (computed once), and
    joined later by rows of another adapter. Tokens and logprobs
    must be identical to the bit, which is what makes whole runs reproducible. Both decoders: the
    lean llama decoder the engine uses here (merging requests) and the model's modules (other
    architectures, one request at a time). GRPO-sized batches (8 prompts x 8 samples) too, prefilled at
    once or arriving over steps."""
    from sess.engine.native import kernels as native
    from sess.engine.sampling.llama_decoder import LlamaDecoder
    from sess.engine.sampling.module_decoder import ModuleDecoder

    sessions = [svc.create_lora_training_client(model, rank=4, seed=s) for s in (1, 2)]
    tok = sessions[0].get_tokenizer()
    for i, tc in enumerate(sessions):
        train_steps(tc, [SENTENCES[i]], 5e-2)  # waited for: the weights stay put from here
    adapters = [runtime.sessions[tc.name].adapter for tc in sessions]
    host = runtime.host(model)
    assert isinstance(host.decoder, LlamaDecoder)
    decoder = ModuleDecoder(host.activate) if path == "modules" else host.decoder
    budget = runtime.memory_budget if runtime.budget_given else None  # None: the default again
    if path == "lean step, no packed copies":
        runtime.memory_budget = 1024  # bytes: the copies do not fit, the weights go to oneDNN as they are
    kernels = host.decoder.kernels
    if path == "lean step, torch ops":
        host.decoder.kernels = False
    x = tok.encode("Question: what is 3 + 4? Answer:")
    short, long = tok.encode("Hi"), tok.encode("A much longer prompt, about numbers and letters. " * 3)

    def question(i: int) -> list[int]:
        return tok.encode(f"Question: what is {i} + {2 * i}? Answer:")

    def run(plan):
        return decode_plan(decoder, tok, plan)

    alone = run([(0, "x", x, 8, adapters[0])])
    compositions = {
        "after a one-row request": [(0, "o", short, 1, adapters[0]), (2, "x", x, 8, adapters[0])],
        "prefilled with a long prompt": [(0, "o", long, 3, adapters[0]), (0, "x", x, 8, adapters[0])],
        "prefilled on a prefix shared with others": [
            (0, "o", x[:-2] + short, 2, adapters[0]),
            (0, "x", x, 8, adapters[0]),
            (0, "p", x + short, 3, adapters[0]),
            (0, "q", x[:-1] + short, 2, adapters[1]),
        ],
        "joined by another adapter": [(0, "x", x, 8, adapters[0]), (3, "o", long, 3, adapters[1])],
        "base-model rows and an adapter": [(0, "o", short, 2, None), (1, "x", x, 8, adapters[0])],
        "a GRPO-sized batch": [(0, "x", x, 8, adapters[0])]
        + [(0, f"p{i}", question(i), 8, adapters[0]) for i in range(7)],
        "a GRPO-sized batch, arriving over steps": [
            (i, f"p{i}", question(i), 8, adapters[0]) for i in range(4)
        ]
        + [(2, "x", x, 8, adapters[0])],
    }
    exact = runtime.batch_invariance()["exact"]  # else the engine names the kernels that are not
    for name, plan in compositions.items():
        got = run(plan)
        if exact:
            assert got == alone, name
        else:
            assert runtime.batch_invariance()["inexact"]
            for (_, a), (_, b) in zip(got, alone):
                assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, name
    if path == "lean step, no packed copies":
        assert not host.decoder.linear.packed_bytes()
    if path == "lean step":  # the C kernels wherever they are built
        assert host.decoder.kernels == (native.library()[0] is not None)
    host.decoder.kernels = kernels
    runtime.memory_budget = budget
    for tc in sessions:
        tc.stop()


def test_a_prefix_that_prompts_share_is_prefilled_once_and_their_samples_are_as_alone(runtime, svc, monkeypatch):
    """Prompts of one adapter that begin alike (a system prompt, a task's instructions) are
    prefilled together with that prefix computed once: the prefill's attention runs on the prefix
    and each prompt's own tokens, not on every prompt whole, and each request samples what it
    samples alone (the prefix's rows are the same bits, :class:`Layout`)."""
    from sess.engine.native import kernels as native
    from sess.engine.sampling import fused_ops

    if native.library()[0] is None:
        pytest.skip("the C kernels are not built here: the prefill computes every prompt whole")
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=1)
    tok = tc.get_tokenizer()
    decoder = runtime.host("tiny-llama").decoder
    system = tok.encode("You are a careful assistant who answers questions about numbers. ")
    prompts = [system + tok.encode(f"Question: what is {i} + {2 * i}? Answer:") for i in range(4)]
    shared = len(os.path.commonprefix(prompts))
    assert shared >= len(system) - 1
    computed, attend = [], fused_ops.prefill_attend
    monkeypatch.setattr(
        fused_ops, "prefill_attend", lambda k, *args: computed.append(k.shape[0]) or attend(k, *args)
    )
    adapter = runtime.sessions[tc.name].adapter
    plan = [(0, "x" if i == 0 else f"p{i}", p, 2, adapter) for i, p in enumerate(prompts)]
    together = decode_plan(decoder, tok, plan)
    layers = len(runtime.host("tiny-llama").model.model.layers)
    assert computed == [shared + sum(len(p) - shared for p in prompts)] * layers
    computed.clear()
    assert decode_plan(decoder, tok, plan[:1]) == together
    assert computed == [len(prompts[0])] * layers
    tc.stop()


def test_the_packed_weight_copies_are_kept_only_within_the_memory_budget_and_change_no_bit(
    runtime, svc, monkeypatch
):
    """The lean decoder's prepacked copies of the base weights are as large as the weights; a budget
    that cannot hold them all leaves none, and the same seeded request samples the same tokens and
    logprobs to the bit either way. (An adapter's rows go through the base weights when its plan is
    LoRA terms, as here; a merged plan has copies of its own, see the next test.)"""
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=2)
    tok = tc.get_tokenizer()
    train_steps(tc, [SENTENCES[0]], 5e-2)
    host = runtime.host("tiny-llama")
    monkeypatch.setattr(host.decoder, "merge_lora", False)
    linear = host.decoder.linear
    sampler = tc.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=9)

    def sample() -> list[tuple[list[int], list[float]]]:
        out = sampler.sample(tok.encode("Question: what is 3 + 4? Answer:"), 4, params).result(timeout=60)
        return [(s.tokens, s.logprobs) for s in out.sequences]

    host.release_sampling_memory()
    packed = sample()
    copies = host.decoder.copy_bytes()
    held = linear.packed_bytes()
    assert 0 < copies <= runtime.memory_budget and held == copies  # every projection and the lm_head
    with budget(runtime, copies - 1):
        assert sample() == packed
        assert not linear.packed_bytes()  # the copies made before went at the first step over budget
    with budget(runtime, copies):
        assert sample() == packed
        assert linear.packed_bytes()
    tc.stop()


def test_without_a_budget_the_copies_get_a_share_of_the_free_memory(tmp_path):
    """No ``--memory-budget``: the sampler's prepacked copies may take a quarter of the memory the
    machine has available when first asked (so a machine with room samples at their speed), sized
    once; a budget given bounds them instead, as it bounds training."""
    from sess.engine.runtime.memory.training_budget import COPY_SHARE, CPU_BUDGET
    from sess.engine.runtime.runtime import Runtime

    def available() -> int:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024

    runtime = Runtime(tmp_path / "home")
    before = available()
    sized = runtime.copy_budget()
    after = available()
    low, high = sorted((before, after))
    assert max(CPU_BUDGET, int(low * COPY_SHARE * 0.9)) <= sized <= max(CPU_BUDGET, int(high * COPY_SHARE * 1.1))
    assert runtime.memory_budget == CPU_BUDGET  # training keeps its own default
    big = bytearray(64 << 20)  # the free memory moves; the size, once taken, does not
    assert runtime.copy_budget() == sized
    del big
    runtime.memory_budget = 1 << 20
    assert runtime.copy_budget() == 1 << 20
    runtime.memory_budget = None
    assert runtime.copy_budget() == sized
    assert Runtime(tmp_path / "other", memory_budget=3 << 20).copy_budget() == 3 << 20


def test_inverse_cdf_picks_what_a_full_scan_picks():
    import torch

    from sess.engine.sampling.token_choice import SPAN, inverse_cdf

    gen = torch.Generator().manual_seed(0)
    vocab = 5 * SPAN + 17  # not a whole number of tiles
    probs = (torch.randn(32, vocab, generator=gen) * 4).softmax(-1)
    probs[:, ::3] = 0.0  # zero entries (as top-k / top-p leave them) are never picked
    u = torch.rand(32, generator=gen, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2.0**-53  # the ends of [0, 1)
    cdf = probs.to(torch.float64).cumsum(-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    picks = inverse_cdf(probs, u)
    assert torch.equal(picks, expected.clamp(max=vocab - 1))
    assert bool((probs.gather(1, picks[:, None]) > 0).all())
    for row in (0, 1, 7):  # a row alone picks what it picks in the batch
        assert inverse_cdf(probs[row : row + 1], u[row : row + 1]).item() == picks[row].item()


def test_each_row_chooses_its_token_as_it_would_alone(monkeypatch):
    """Token choice is a function of the row: greedy, plain, top-k and top-p rows mixed in one batch
    (and taken a few rows at a time, as the decode batch takes a large vocabulary) each get the
    token and logprob they get alone. A plain row draws in vocabulary order even beside rows that
    truncate (which draw in sorted order)."""
    import torch

    from sess.engine.sampling import token_choice

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 12, 3000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3] * 3)
    top_k = torch.tensor([0, 0, 0, 0, 50, 0] * 2)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 1.0] * 2)
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    monkeypatch.setattr(token_choice, "HEAP_BYTES", 5 * vocab * 4)  # 5 rows at a time
    tokens, logprobs = token_choice.choose(logits, temperature, top_k, top_p, u)
    for row in range(rows):
        one = slice(row, row + 1)
        token, logprob = token_choice.choose(logits[one], temperature[one], top_k[one], top_p[one], u[one])
        assert (token.item(), logprob.item()) == (tokens[row].item(), logprobs[row].item()), row
    assert torch.equal(tokens[2::4], logits[2::4].argmax(-1))  # temperature 0: greedy
    exact = logits.double().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.double(), exact, rtol=0, atol=1e-5)  # the model's own, temperature 1


def test_the_cache_keeps_the_rows_asked_for_in_place_or_in_a_smaller_copy():
    """Rows leave the decode batch's KV cache as they finish: while at least half of it stays, the
    kept rows are compacted in the cache's own memory, else copied out; either way each layer holds
    exactly the kept rows' entries, blocks trimmed to the width, and decoding goes on from there."""
    import torch

    from sess.engine.sampling.block_cache import BLOCK, BlockCache

    gen = torch.Generator().manual_seed(0)
    shape = (3, 10, 2, BLOCK, 4)  # blocks, rows, kv heads, columns, dim
    keys = [torch.randn(shape, generator=gen) for _ in range(2)]
    values = [torch.randn(shape, generator=gen) for _ in range(2)]
    cache = BlockCache([k.clone() for k in keys], [v.clone() for v in values])
    kept = torch.tensor([0, 2, 3, 4, 5, 6, 8, 9])  # 8 of 10 rows, 2 of 3 blocks: in place
    storage = cache.keys[0].untyped_storage().data_ptr()
    cache.keep(kept, width=BLOCK - 1)
    assert cache.keys[0].untyped_storage().data_ptr() == storage
    for mine, original in zip(cache.keys + cache.values, keys + values):
        assert mine.is_contiguous() and torch.equal(mine, original[:2, kept])
    fewer = torch.tensor([1, 6])  # 2 of 8 rows: a copy of its own
    cache.keep(fewer, width=10)
    assert cache.keys[0].untyped_storage().data_ptr() != storage
    for mine, original in zip(cache.keys + cache.values, keys + values):
        assert torch.equal(mine, original[:2, kept][:, fewer])
    step = cache.set_positions(torch.tensor([10, 140]))  # grows to 3 blocks and writes
    new = torch.randn(2, 2, 4, generator=gen)
    k, _ = cache.update(0, new, new)
    assert k.shape == (3, 2, 2, BLOCK, 4) and torch.equal(k[step.block, step.rows, :, step.column], new)


def test_rows_leave_a_cache_read_by_place_without_moving_until_half_have_left():
    """Where the decoder reads the cache by place, rows leave by their places alone while more
    than half the cache's rows are still in the batch (nothing is copied but a prompt's entries,
    to its first row that stays where its first row left); then the cache is compacted to them,
    and a join compacts first. Prompts' shared prefixes follow the rows. The torch ops' write
    (:meth:`BlockCache.update`) refuses such a cache."""
    import torch

    from sess.engine.sampling.block_cache import BLOCK, BlockCache

    def bits(t: torch.Tensor) -> torch.Tensor:  # what a by-place prefill leaves unwritten may be NaN
        return t.view(torch.int32)

    gen = torch.Generator().manual_seed(1)
    entries = [torch.randn(10, 2, 4, generator=gen) for _ in range(2)]  # tokens, kv heads, dim
    cache = BlockCache.from_prompts(list(entries), [e.clone() for e in entries], [(0, 6, 3), (6, 4, 3)], 16, True)
    for layer, prompt_entries in enumerate(entries):  # each prompt's first row holds its entries
        assert torch.equal(cache.keys[layer][0, 0, :, :6], prompt_entries[:6].transpose(0, 1))
        assert torch.equal(cache.keys[layer][0, 3, :, :4], prompt_entries[6:].transpose(0, 1))
    with pytest.raises(RuntimeError, match="attention kernel"):  # the other rows' prompt columns: unwritten
        cache.update(0, torch.zeros(6, 2, 4), torch.zeros(6, 2, 4))
    held = [t.clone() for t in cache.keys]
    storage = cache.keys[0].untyped_storage().data_ptr()
    cache.keep(torch.tensor([1, 2, 3, 5]), width=20)  # 4 of 6 rows: in place
    assert cache.places.tolist() == [1, 2, 3, 5] and cache.held == 6
    assert cache.keys[0].untyped_storage().data_ptr() == storage
    for layer, prompt_entries in enumerate(entries):  # row 0 left: row 1 holds prompt 0's entries now
        assert torch.equal(cache.keys[layer][0, 1, :, :6], prompt_entries[:6].transpose(0, 1))
        held[layer][0, 1, :, :6] = cache.keys[layer][0, 1, :, :6]
        assert torch.equal(bits(cache.keys[layer]), bits(held[layer]))  # and nothing else moved
    assert [t.tolist() for t in cache.sharing()] == [[0, 0, 2, 2], [6, 6, 4, 4]]  # by batch row
    with pytest.raises(RuntimeError, match="attention kernel"):
        cache.update(0, torch.zeros(4, 2, 4), torch.zeros(4, 2, 4))
    cache.keep(torch.tensor([0, 3]), width=20)  # 2 of 6 held rows stay: compacted to them
    assert cache.places is None and cache.held == 2
    for layer, prompt_entries in enumerate(entries):  # row 3 left: row 5 got prompt 1's entries first
        held[layer][0, 5, :, :4] = prompt_entries[6:].transpose(0, 1)
        assert torch.equal(bits(cache.keys[layer]), bits(held[layer][:, [1, 5]]))
    assert [t.tolist() for t in cache.sharing()] == [[0, 1], [6, 4]]
    cache.keep(torch.tensor([1]), width=20)  # 1 of 2: not more than half, compacted
    assert cache.places is None and torch.equal(bits(cache.keys[0]), bits(held[0][:, [5]]))
    cache = BlockCache.from_prompts(list(entries), [e.clone() for e in entries], [(0, 6, 3), (6, 4, 3)], 16, True)
    cache.keep(torch.tensor([0, 2, 4, 5]), width=20)  # prompt 1's first row (3) leaves: row 4 holds it
    held = [t.clone() for t in cache.keys]
    other = [torch.randn(3, 2, 4, generator=gen) for _ in range(2)]
    cache.append(BlockCache.from_prompts(list(other), [e.clone() for e in other], [(0, 3, 2)], BLOCK + 1))
    assert cache.places is None and cache.held == 6 and cache.blocks == 2
    assert torch.equal(bits(cache.keys[0][:1, :4]), bits(held[0][:, [0, 2, 4, 5]]))
    assert torch.equal(cache.keys[0][0, 2, :, :4], entries[0][6:].transpose(0, 1))
    assert [t.tolist() for t in cache.sharing()] == [[0, 0, 2, 2, 4, 4], [6, 6, 4, 4, 3, 3]]


EXIT_SCRIPT = """
import atexit, sys, threading
def report():  # registered first, so it runs after sess's own exit handler
    alive = [t.name for t in threading.enumerate() if t.name == "sess-executor"]
    print("executor alive" if alive else "executor stopped", flush=True)
atexit.register(report)
from sess.engine import SamplingParams, ServiceClient
svc = ServiceClient("inproc", home=sys.argv[1])
tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0)
sc = tc.save_weights_and_get_sampling_client()
sc.sample([1, 2, 3], num_samples=4, sampling_params=SamplingParams(max_tokens=8)).result()
"""


def test_a_script_using_the_in_process_engine_exits_cleanly(sess_home, tmp_path):
    """The in-process engine's executor is stopped before the interpreter finalizes: left running,
    it could be freeing a finished request's tensors then and abort the process (status 134)."""
    script = tmp_path / "script.py"
    script.write_text(EXIT_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(sess_home)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "executor stopped"


def test_a_training_op_drops_the_lora_plans_no_request_samples_from(runtime, svc):
    """The lean decoder's per-adapter plans (stacked A, prepacked B: copies of the adapter's weights)
    go when a backward pass starts unless a running request samples through them, and when the
    adapter goes; the next sample makes them again and gets the same bits."""
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=2)
    tok = tc.get_tokenizer()
    train_steps(tc, [SENTENCES[1]], 5e-2)
    sampler = tc.save_weights_and_get_sampling_client()
    decoder = runtime.host("tiny-llama").decoder

    def sample() -> list[tuple[list[int], list[float]]]:
        out = sampler.sample(tok.encode("Hi there"), 2, SamplingParams(max_tokens=6, seed=4)).result(
            timeout=60
        )
        return [(s.tokens, s.logprobs) for s in out.sequences]

    before = sample()
    adapter = runtime.host("tiny-llama").checkpoint_adapters[sampler.model_path]
    assert decoder.planned(adapter)
    tc.forward_backward([ce_datum(tok.encode(SENTENCES[0]))], "cross_entropy").result()
    assert not decoder.planned(adapter)
    assert sample() == before
    assert decoder.planned(adapter)
    runtime.host("tiny-llama").forget_checkpoint(sampler.model_path)  # the adapter goes, its plan too
    assert not decoder.planned(adapter)
    tc.stop()
