"""Long prompts in the sampler: a 4K-token prompt's samples carry ``forward``'s logprobs (the
trainer's), and the same bits whatever shares their prefill and decode batch, through the wide
matmul calls and tiled attention a long prefill takes."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import SENTENCES, decode_plan, forward_logprobs, train_steps


@pytest.mark.slow  # ~10 s of compute, minutes on a shared machine
def test_a_4k_prompt_samples_forward_s_logprobs_with_the_same_bits_in_any_batch(runtime, svc):
    """tiny-llama's window is 4,096 tokens: a 4,000-token prompt alone, prefilled together with a
    3,000-token one, on a prefix it shares with another prompt (computed once), and joined in its
    decode batch by a long prompt's rows; the logprobs equal ``forward``'s to 1e-4."""
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=1)
    train_steps(tc, [SENTENCES[0]], 5e-2)  # waited for: the weights stay put from here
    adapter = runtime.sessions[tc.name].adapter
    tok = tc.get_tokenizer()
    vocab = runtime.host("tiny-llama").vocab_size
    rng = np.random.default_rng(0)
    x, other = (rng.integers(3, vocab - 1, n).tolist() for n in (4000, 3000))
    decoder = runtime.host("tiny-llama").decoder
    alone = decode_plan(decoder, tok, [(0, "x", x, 2, adapter)])
    compositions = {
        "prefilled with a long prompt": [(0, "o", other, 2, adapter), (0, "x", x, 2, adapter)],
        "on a prefix shared with another": [
            (0, "o", x[:3500] + other[:200], 1, adapter),
            (0, "x", x, 2, adapter),
        ],
        "joined by a long prompt's rows": [(0, "x", x, 2, adapter), (2, "o", other, 3, None)],
    }
    exact = runtime.batch_invariance()["exact"]  # else the engine names the kernels that are not
    for name, plan in compositions.items():
        got = decode_plan(decoder, tok, plan)
        if exact:
            assert got == alone, name
        else:
            for (_, a), (_, b) in zip(got, alone):
                assert max(abs(p - q) for p, q in zip(a, b)) < 1e-5, name
    for tokens, logprobs in alone:
        expected = forward_logprobs(tc, x, tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-4
    tc.stop()
