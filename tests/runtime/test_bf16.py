"""bf16 base models: fp32 LoRA and AdamW state, sampler/trainer agreement to a measured bound, batch
invariance, and the precisions an engine refuses.

The device-parametrised tests run on CUDA where a device is present (``benchmarks/gpu_check.sh``)
and skip it elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from sess.engine import SamplingParams, ServiceClient
from sess.engine.runtime.inprocess import shared_engine
from sess.engine.runtime.models.catalog import Dtypes, dtype_name
from sess.engine.server.options import EngineOptions

from helpers import SENTENCES, ce_datum, decode_plan, forward_logprobs, train_steps

# Sampled vs forward logprobs of the same tokens at bf16: the lean decoder and the model's modules
# round differently (fused vs separate ops, cache layout). Measured on tiny-llama and tiny-qwen3:
# at most 0.0081 nats (bf16 keeps 8 bits of mantissa: 0.4 % of a logprob near -5). fp32: < 1e-4.
BF16_SAMPLED_VS_FORWARD = 0.02

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


@pytest.fixture(scope="module", params=DEVICES)
def bf16(request, sess_home, tmp_path_factory):
    """An in-process engine of its own whose base models load in bf16 (the models directory is the
    test home's: tiny models materialise once)."""
    home = tmp_path_factory.mktemp(f"bf16-{request.param}")
    (sess_home / "models").mkdir(exist_ok=True)
    (home / "models").symlink_to(sess_home / "models")
    engine = shared_engine(home, device=request.param)
    engine.runtime.dtypes = Dtypes("bfloat16")
    svc = ServiceClient("inproc", home=home)
    yield svc, engine.runtime
    svc.close()


def test_a_bf16_base_trains_fp32_lora_with_fp32_adam_state(bf16):
    svc, runtime = bf16
    tc = svc.create_lora_training_client("tiny-llama", rank=8, alpha=16, seed=3)
    host, session = runtime.hosts["tiny-llama"], runtime.sessions[tc.name]
    assert {p.dtype for p in host.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in session.params.values()} == {torch.float32}
    data = [ce_datum(tc.get_tokenizer().encode(t)) for t in SENTENCES]
    first = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    train_steps(tc, SENTENCES, 2e-2, steps=4)
    # measured: 457.0 -> 407.8 (fp32 LoRA updates reach the bf16 forward)
    assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] < 0.95 * first
    assert {p.dtype for p in session.params.values()} == {torch.float32}
    state = [
        v for s in session.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    ]
    assert state and {v.dtype for v in state} == {torch.float32}
    tc.stop()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_sampled_logprobs_agree_with_forward_at_bf16_to_the_measured_bound(bf16, model):
    svc, runtime = bf16
    tc = svc.create_lora_training_client(model, rank=8, alpha=16, seed=3)
    train_steps(tc, SENTENCES, 2e-2, steps=2)
    prompt = tc.get_tokenizer().encode("Question: what is 3 + 4? Answer:")
    sc = tc.save_weights_and_get_sampling_client()
    result = sc.sample(
        prompt, num_samples=4, sampling_params=SamplingParams(max_tokens=24, temperature=1.0, seed=11)
    ).result()
    worst = 0.0
    for seq in result.sequences:
        expected = forward_logprobs(tc, prompt, seq.tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(seq.logprobs, expected)))
        # compute_logprobs runs the trainer's own forward: the same numbers
        computed = sc.compute_logprobs(prompt + seq.tokens).result()[len(prompt) :]
        assert max(abs(a - b) for a, b in zip(computed, expected)) < 1e-6
    assert worst < BF16_SAMPLED_VS_FORWARD, worst
    tc.stop()


def test_a_bf16_request_gets_identical_logprobs_whatever_shares_its_batch(bf16):
    """Batch invariance holds at bf16 too (measured on CPU: identical to the bit)."""
    svc, runtime = bf16
    sessions = [svc.create_lora_training_client("tiny-llama", rank=4, seed=s) for s in (1, 2)]
    for i, tc in enumerate(sessions):
        train_steps(tc, [SENTENCES[i]], 5e-2)
    tok = sessions[0].get_tokenizer()
    adapters = [runtime.sessions[tc.name].adapter for tc in sessions]
    decoder = runtime.host("tiny-llama").decoder
    x, short = tok.encode("Question: what is 3 + 4? Answer:"), tok.encode("Hi")
    long = tok.encode("A much longer prompt, about numbers and letters. " * 3)

    def run(plan):
        return decode_plan(decoder, tok, plan)

    alone = run([(0, "x", x, 4, adapters[0])])
    assert run([(0, "o", short, 1, adapters[0]), (2, "x", x, 4, adapters[0])]) == alone
    assert run([(0, "o", long, 3, adapters[0]), (0, "x", x, 4, adapters[0])]) == alone
    assert run([(0, "x", x, 4, adapters[0]), (3, "o", long, 3, adapters[1])]) == alone
    for tc in sessions:
        tc.stop()


def test_dtypes_parse_per_model_and_refuse_what_they_cannot_run():
    dtypes = Dtypes.parse("fp32, tiny-qwen3=bf16")
    assert dtypes.name_for("tiny-qwen3", "cpu") == "bfloat16"
    assert dtypes.name_for("tiny-llama", "cpu") == "float32"
    assert Dtypes.parse(None).name_for("tiny-llama", "cpu") == "float32"  # fp32 stays CPU's default
    with pytest.raises(ValueError, match="float16 is not supported.*use bfloat16"):
        dtype_name("fp16")
    with pytest.raises(ValueError, match="'int8': expected one of float32, bfloat16"):
        dtype_name("int8")
    assert "--dtype: dtype 'float64'" in EngineOptions(device="cpu", dtype="float64").check()
    assert "--dtype" in EngineOptions(device="cpu", dtype="bf16,tiny-llama=float8").check()
    assert "--memory-budget: expected a size" in EngineOptions(device="cpu", memory_budget="lots").check()
    assert (
        EngineOptions(device="cpu", dtype="bfloat16,tiny-llama=float32", memory_budget="800M").check() is None
    )


def test_bf16_on_a_cuda_device_without_it_is_refused_naming_the_device(monkeypatch):
    """A pre-Ampere GPU (compute capability < 8.0) has no bf16: refused with its name and limit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    problem = EngineOptions(device="cuda", dtype="bfloat16").check()
    assert "Tesla T4 (compute capability 7.5) has no bf16 support (it needs 8.0 or later)" in problem
    assert EngineOptions(device="cuda", dtype="float32").check() is None
    assert "this machine has 1 CUDA device" in EngineOptions(device="cuda:3").check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_cuda_engine_on_a_machine_without_cuda_is_refused_before_it_starts(tmp_path):
    from typer.testing import CliRunner

    from sess.cli.main import app

    result = CliRunner().invoke(app, ["engine", "up", "--device", "cuda", "--home", str(tmp_path)])
    assert result.exit_code != 0
    assert "--device cuda: this machine has no CUDA device" in result.output
    result = CliRunner().invoke(app, ["engine", "up", "--dtype", "float16", "--home", str(tmp_path)])
    assert result.exit_code != 0 and "float16 is not supported" in result.output
    assert not (tmp_path / "engine.json").exists()
