"""The seed loop of API.md with real pieces (draw, build_prompt, compute_reward, ...), as a user
writes it; only the model name and sizes are scaled down. ``test_seed_loop`` runs it in-process and
``test_client_only`` runs this file with a client-only install (no torch, no peft) against an engine
process: ``python seed_loop.py`` prints a JSON summary of the session it trained."""

from __future__ import annotations

import json
import random
import re

import numpy as np

from sess.engine import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

NUM_STEPS = 3
PROMPTS_PER_STEP = 2
K = 4
BASE_MODEL = "tiny-llama"


def draw(n, _rng=random.Random(0)):
    for _ in range(n):
        a, b = _rng.randint(1, 9), _rng.randint(1, 9)
        yield f"What is {a} + {b}?", a + b


def build_prompt(question):
    return f"Q: {question}\nA:"


def compute_reward(text, truth):
    numbers = re.findall(r"-?\d+", text)
    return 1.0 if numbers and int(numbers[0]) == truth else 0.0


def compute_advantages(rewards):
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def build_training_datum(prompt, sequence, advantage):
    tokens = prompt + sequence.tokens
    n_prompt = len(prompt) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:]),
            "logprobs": np.array([0.0] * n_prompt + sequence.logprobs, dtype=np.float32),
            "advantages": np.array([0.0] * n_prompt + [advantage] * len(sequence.tokens), dtype=np.float32),
        },
    )


def run(session_name: str = "gsm8k-grpo") -> ServiceClient:
    # fmt: off
    # ---- from API.md, "The seed loop, as a user writes it" (model name, sizes and max_tokens scaled down) ----
    svc = ServiceClient()
    training_client = svc.create_lora_training_client(BASE_MODEL, training_session_name=session_name, rank=32, alpha=64)
    tokenizer = training_client.get_tokenizer()
    sampling_client = training_client.create_sampling_client()
    for step in range(NUM_STEPS):  # noqa: B007 (as written in API.md)
        datums, pending = [], []
        for question, truth in draw(PROMPTS_PER_STEP):
            prompt = tokenizer.encode(build_prompt(question), add_special_tokens=False)
            pending.append((prompt, truth, sampling_client.sample(prompt, num_samples=K,
                            sampling_params=SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9))))
        for prompt, truth, future in pending:
            result = future.result()
            rewards = [compute_reward(tokenizer.decode(s.tokens), truth) for s in result.sequences]
            advantages = compute_advantages(rewards)
            datums += [build_training_datum(prompt, s, a) for s, a in zip(result.sequences, advantages)]
        fwd_bwd = training_client.forward_backward(datums, loss_fn="ppo")
        optim = training_client.optim_step(AdamParams(learning_rate=1e-5))
        fwd_bwd.result(), optim.result()
        sampling_client = training_client.save_weights_and_get_sampling_client()
    training_client.save_weights_for_sampler(merge_weights=True).result()
    training_client.save_state().result()
    training_client.stop()
    # ---- end of the seed loop ----
    # fmt: on
    return svc


def summary(svc: ServiceClient, session_name: str) -> dict:
    [found] = svc.list_sessions(name_contains=session_name)
    return {
        "status": found.status.value,
        "step": found.step,
        "kinds": sorted({c["kind"] for c in svc.list_checkpoints(session_name)}),
        "sampled_tokens": found.usage.sampled_tokens,
        "training_tokens": found.usage.training_tokens,
    }


if __name__ == "__main__":
    import importlib.util
    import sys

    name = sys.argv[1]
    service = run(name)
    print(json.dumps({**summary(service, name), "torch": importlib.util.find_spec("torch") is not None}))
