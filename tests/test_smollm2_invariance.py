"""Batch invariance of sampling at SmolLM2-135M's shapes, through a trained adapter (slow: real
weights), including GRPO-sized batches of 8 prompts x 8 samples prefilled at once or arriving over
steps. The tiny-llama version in test_sampling.py runs by default."""

from __future__ import annotations

import pytest

from sess.engine import SamplingParams

from helpers import SENTENCES, train_steps


@pytest.mark.slow
@pytest.mark.parametrize("path", ["lean step"])
def test_smollm2_requests_get_identical_logprobs_whatever_shares_their_batch(runtime, svc, path):
    """The decode batch is driven step by step so each composition surely happens: the same seeded
    request alone, after a one-row request (its rows at odd offsets of a 5-row batch), prefilled
    together with a long prompt, and joined later by rows of another adapter. Tokens and logprobs
    must be identical to the bit, which is what makes whole runs reproducible. Both decoders: the
    lean llama decoder the engine uses here (merging requests) and the model's modules (other
    architectures, one request at a time)."""
    from sess.engine.sampling.decode_batch import DecodeBatch, SampleJob
    from sess.engine.sampling.llama_decoder import LlamaDecoder
    from sess.engine.sampling.module_decoder import ModuleDecoder
    from sess.engine.sampling.token_choice import StopChecker

    sessions = [svc.create_lora_training_client("smollm2-135m", rank=4, seed=s) for s in (1, 2)]
    tok = sessions[0].get_tokenizer()
    for i, tc in enumerate(sessions):
        train_steps(tc, [SENTENCES[i]], 5e-2)  # waited for: the weights stay put from here
    adapters = [runtime.sessions[tc.name].adapter for tc in sessions]
    host = runtime.host("smollm2-135m")
    assert isinstance(host.decoder, LlamaDecoder)
    decoder = host.decoder if path == "lean step" else ModuleDecoder(host.activate)
    x = tok.encode("Question: what is 3 + 4? Answer:")
    short, long = tok.encode("Hi"), tok.encode("A much longer prompt, about numbers and letters. " * 3)

    def run(plan):
        batch = DecodeBatch(decoder)
        results, step = {}, 0
        while plan or batch.active:
            for item in [p for p in plan if p[0] == step]:
                _, name, prompt, samples, adapter = item
                batch.submit(
                    SampleJob(
                        prompt=prompt,
                        num_samples=samples,
                        params=SamplingParams(max_tokens=20, temperature=1.0, seed=5),
                        adapter=adapter,
                        stopper=StopChecker(None, set(), tok.decode),
                        on_done=lambda seqs, error, name=name: results.__setitem__(name, (seqs, error)),
                    )
                )
                plan.remove(item)
            batch.step()
            step += 1
        seqs, error = results["x"]
        assert error is None
        return [(s.tokens, s.logprobs) for s in seqs]

    alone = run([(0, "x", x, 8, adapters[0])])
    compositions = {
        "after a one-row request": [(0, "o", short, 1, adapters[0]), (2, "x", x, 8, adapters[0])],
        "prefilled with a long prompt": [(0, "o", long, 3, adapters[0]), (0, "x", x, 8, adapters[0])],
        "joined by another adapter": [(0, "x", x, 8, adapters[0]), (3, "o", long, 3, adapters[1])],
        "a GRPO-sized batch": [(0, "x", x, 8, adapters[0])]
        + [
            (0, f"p{i}", tok.encode(f"Question: what is {i} + {2 * i}? Answer:"), 8, adapters[0])
            for i in range(7)
        ],
        "a GRPO-sized batch, arriving over steps": [
            (i, f"p{i}", tok.encode(f"Question: what is {i} + {2 * i}? Answer:"), 8, adapters[0])
            for i in range(4)
        ]
        + [(2, "x", x, 8, adapters[0])],
    }
    for name, plan in compositions.items():
        got = run(plan)
        assert got == alone, name
    for tc in sessions:
        tc.stop()
