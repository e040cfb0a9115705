"""The lean llama decoder is taken only for configs it computes exactly; others decode through the
model's own modules and still sample the logprobs ``forward`` computes."""

from __future__ import annotations

import shutil

import pytest
import torch

from sess.engine import SamplingParams
from sess.engine.runtime.models.catalog import prepare
from sess.engine.sampling.llama_decoder import LlamaDecoder
from sess.engine.sampling.module_decoder import ModuleDecoder

from helpers import SENTENCES, forward_logprobs, train_steps


def _variant(tmp_path_factory, sess_home, name: str, **changes):
    """tiny-llama's config with ``changes``, random weights, the same tokenizer: a local model dir."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = prepare("tiny-llama", sess_home)
    config = AutoConfig.from_pretrained(base)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    out = tmp_path_factory.mktemp(name)
    model.save_pretrained(out)
    for file in base.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(file, out / file.name)
    return str(out)


VARIANTS = {
    "attention bias": ({"attention_bias": True}, "biases"),
    "rope scaling": (
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        "rope",
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_configs_the_lean_decoder_does_not_compute_fall_back_to_the_modules(
    runtime, svc, tmp_path_factory, sess_home, variant
):
    changes, reason = VARIANTS[variant]
    model = _variant(tmp_path_factory, sess_home, variant.replace(" ", "-"), **changes)
    tc = svc.create_lora_training_client(model, rank=4, seed=1)
    host = runtime.host(model)
    assert isinstance(host.decoder, ModuleDecoder) and reason in host.lean_unsupported
    train_steps(tc, [SENTENCES[0]], 5e-2)
    tok = tc.get_tokenizer()
    prompt = tok.encode("Question: what is 3 + 4? Answer:")
    sc = tc.save_weights_and_get_sampling_client()
    result = sc.sample(prompt, 3, SamplingParams(max_tokens=12, temperature=1.0, seed=4)).result()
    for seq in result.sequences:
        expected = forward_logprobs(tc, prompt, seq.tokens)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 1e-4
    tc.stop()


def test_plain_tiny_llama_and_qwen3_take_the_lean_decoder(runtime):
    for name in ("tiny-llama", "tiny-qwen3"):
        host = runtime.host(name)
        assert host.lean_unsupported is None and isinstance(host.decoder, LlamaDecoder)
