"""The prefix cache across requests (engine/sampling/prefix_cache.py): the same bits as no cache."""

from __future__ import annotations

import pytest
import torch

from sess.engine import SamplingParams

from helpers import SENTENCES, train_steps


def run_jobs(decoder, tok, jobs: list[tuple[list[int], int, str | None, int]]) -> list:
    """Prefill and decode ``jobs`` (prompt, num_samples, adapter, seed) together; per job its
    ``(tokens, logprobs)`` per sample and the prompt tokens found cached."""
    from sess.engine.sampling.decode_batch import DecodeBatch, SampleJob
    from sess.engine.sampling.token_choice import StopChecker

    batch, results, submitted = DecodeBatch(decoder), {}, []
    for i, (prompt, samples, adapter, seed) in enumerate(jobs):
        job = SampleJob(
            prompt=prompt,
            num_samples=samples,
            params=SamplingParams(max_tokens=12, temperature=1.0, seed=seed),
            adapter=adapter,
            stopper=StopChecker(None, set(), tok.decode),
            on_done=lambda seqs, error, i=i: results.__setitem__(i, (seqs, error)),
        )
        submitted.append(job)
        batch.submit(job)
    while batch.active:
        batch.step()
    out = []
    for i, job in enumerate(submitted):
        seqs, error = results[i]
        assert error is None
        out.append(([(s.tokens, s.logprobs) for s in seqs], job.cached_tokens))
    return out


def without_cache(monkeypatch, decoder, tok, jobs):
    monkeypatch.setenv("SESS_PREFIX_CACHE", "0")
    try:
        return run_jobs(decoder, tok, jobs)
    finally:
        monkeypatch.delenv("SESS_PREFIX_CACHE")


@pytest.mark.parametrize("svc", ["inproc"], indirect=True)
def test_cached_prefixes_give_the_bits_of_a_full_prefill(runtime, svc, monkeypatch):
    """A repeated prompt, a multi-turn history (prompt + completion + more) and a batch where one
    prompt hits the cache beside others sharing a prefix among themselves: the same tokens and
    logprobs, to the bit, as the same requests with the cache off; after an optimizer step the
    adapter's old entries are not used."""
    from sess.engine.sampling.llama_decoder import LlamaDecoder

    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=1)
    tok = tc.get_tokenizer()
    train_steps(tc, [SENTENCES[0]], 5e-2)
    adapter = runtime.sessions[tc.name].adapter
    decoder = runtime.host("tiny-llama").decoder
    assert isinstance(decoder, LlamaDecoder)
    if not (decoder.uses_kernels() and decoder.attention_kernel):
        pytest.skip("the prefix cache is used where the prefill's attention is the C kernel")
    decoder.prefix.forget()
    prompt = tok.encode("Question: what is 3 + 4? Think it through, then answer. Answer:")

    def both(jobs):
        cold = without_cache(monkeypatch, decoder, tok, jobs)
        warm = run_jobs(decoder, tok, jobs)
        assert [r for r, _ in warm] == [r for r, _ in cold]  # tokens and float logprobs, exactly
        hits.append([hit for _, hit in cold])  # with the cache off: only what a prefill shares
        return [hit for _, hit in warm]

    hits = []
    assert both([(prompt, 3, adapter, 0)]) == [0]
    # the same prompt again (a group's next request): all but its last token found
    assert both([(prompt, 3, adapter, 1)]) == [len(prompt) - 1]
    # the next turn: the earlier prompt and a completion, then more; a request of one sample keeps
    # its prompt's and its tokens' entries (but the last token's, never fed back)
    completion = run_jobs(decoder, tok, [(prompt, 1, adapter, 2)])[0][0][0][0]
    turn = prompt + completion + tok.encode(" Right. And 5 + 6?")
    assert both([(turn, 2, adapter, 3)]) == [len(prompt) + len(completion) - 1]
    # the base model's entries are its own: the same tokens under no adapter find nothing
    other = tok.encode("Question: what is 9 + 1? Answer:")
    # (the last prompt's prefix computed once for it and the one before: not computed for it)
    mixed = [(turn + tok.encode(" 11."), 2, adapter, 4), (other, 2, None, 5), (other + [5], 1, None, 6)]
    assert both(mixed) == [len(turn), 0, len(other) - 1]
    assert hits == [[0]] * 3 + [[0, 0, len(other) - 1]]
    # weights changed in place (as an optimizer step or a loaded state does), no memory released
    # between: the entries of the weights before are not used
    assert both([(prompt, 1, adapter, 8)]) == [len(prompt) - 1]
    module = next(
        m for m in runtime.host("tiny-llama").model.modules() if adapter in getattr(m, "lora_B", {})
    )
    with torch.no_grad():
        module.lora_B[adapter].weight.add_(1e-3)
    assert both([(prompt, 1, adapter, 8)]) == [0]
    # an optimizer step changes the adapter's weights in place: its old entries are not used
    train_steps(tc, [SENTENCES[1]], 5e-2)
    assert both([(prompt, 2, adapter, 7)]) == [0]
    assert all(key[0][0] != adapter or key[1] == tuple(prompt) for key in decoder.prefix.entries)
    tc.stop()


def test_entries_stay_within_the_budget_least_recently_used_first():
    from sess.engine.sampling.prefix_cache import PrefixCache

    def entries(n):  # 2 layers of keys and values, [n, 1 head, 4 dims] fp32: 64 bytes a token
        return [torch.ones(n, 1, 4)] * 2, [torch.ones(n, 1, 4)] * 2

    limit = [64 * 10]
    cache = PrefixCache(lambda: limit[0])
    cache.put(("w",), [1, 2, 3], *entries(3))
    cache.put(("w",), [4, 5, 6], *entries(3))
    cache.put(("v",), [1, 2, 3], *entries(3))
    assert cache.bytes == 64 * 9
    assert cache.find(("w",), [1, 2, 3, 9], 3).length == 3  # [1, 2, 3] of "w" is now the newest
    cache.put(("w",), [7, 8], *entries(2))  # over the budget: the least recently used ([4, 5, 6]) goes
    assert cache.bytes <= limit[0]
    assert [tokens for (_, tokens) in cache.entries] == [(1, 2, 3), (1, 2, 3), (7, 8)]
    assert cache.find(("w",), [4, 5, 6], 3) is None and cache.find(("x",), [1, 2, 3], 3) is None
    # a longer prompt replaces the entry that is its prefix; one it covers only touches it
    cache.put(("w",), [1, 2, 3, 4], *entries(4))
    assert (("w",), (1, 2, 3)) not in cache.entries and cache.find(("w",), [1, 2, 3, 4, 5], 9).length == 4
    before = cache.bytes
    cache.put(("w",), [1, 2], *entries(2))
    assert cache.bytes == before
    cache.put(("w",), list(range(100, 120)), *entries(20))  # larger than the whole budget: not kept
    cache.put(("w",), [1, 2, 3, 4] + list(range(20)), *entries(24))  # nor what it would replace lost
    assert cache.bytes == before and cache.find(("w",), [1, 2, 3, 4, 5], 9).length == 4
    # the same name's other weights (an adapter before an optimizer step) go when new ones come
    cache.put(("w", "after a step"), [9], *entries(1))
    assert [weights for (weights, _) in cache.entries] == [("v",), ("w", "after a step")]
    before = cache.bytes
    limit[0] = 64 * 4
    cache.shrink()
    assert cache.bytes <= limit[0]
    # at most ``most`` tokens are found (a prompt keeps its last token to compute)
    assert cache.find(("v",), [1, 2, 3, 4], 2).length == 2
