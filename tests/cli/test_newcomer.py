"""What a newcomer meets: reads that start no engine, a run's end that says what the engine does,
progress in a log, `sess run --help`, `sess runs show|compare`, and `sess attach` (IPython, the plain
REPL, -c)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine.sdk.local_engine import engine_info, stop_engine

from run_helpers import TINY

cli = CliRunner()
SESS = [sys.executable, "-c", "from sess.cli.main import main; main()"]


def _env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SESS_ENGINE_URL"}
    return {**env, "SESS_HOME": str(home), "HF_HUB_OFFLINE": "1", "COLUMNS": "200", **extra}


@pytest.mark.parametrize(
    "args",
    [
        ["list"],
        ["usage"],
        ["checkpoints", "x"],
        ["checkpoints", "publish", "sess://x/state/y"],
        ["trace", "x", "-o", "trace.json"],
        ["engine", "audit"],
        ["stop", "x"],
        ["attach", "x"],
    ],
    ids=lambda a: "-".join(a[:2]),
)
def test_commands_that_only_read_never_start_an_engine(tmp_path, args):
    home = tmp_path / "home"
    result = subprocess.run([*SESS, *args], capture_output=True, text=True, env=_env(home), timeout=120)
    assert result.returncode == 1
    assert "no engine is running" in result.stderr and "sess engine up" in result.stderr
    assert engine_info(home) is None and not (home / "engine.json").exists()


def test_a_run_says_what_the_engine_does_and_shows_progress_in_a_log(tmp_path):
    """With a fresh home the run starts the local engine; by default it keeps running and the run
    says so with its memory and how to stop it; with engine.keep=false the run stops it. With
    stderr not a terminal, progress is a plain line per step, phase and evaluation."""
    home = tmp_path / "home"
    run = [*SESS, "run", *TINY, "loop.steps=2", "loop.group_size=2", f"runs_dir={tmp_path / 'runs'}"]
    try:
        kept = subprocess.run(run, capture_output=True, text=True, env=_env(home), timeout=600)
        assert kept.returncode == 0, kept.stderr[-2000:]
        info = engine_info(home)
        assert info is not None
        assert f"pid {info['pid']}" in kept.stdout and "still running" in kept.stdout
        assert (
            "GB" in kept.stdout and "sess engine down" in kept.stdout and "engine.keep=false" in kept.stdout
        )
        lines = kept.stderr.splitlines()
        assert any("starting a session on tiny-llama" in line for line in lines)
        assert any("step 1/2" in line for line in lines) and any("step 2/2" in line for line in lines)
        assert sum("eval at step" in line for line in lines) == 2
    finally:
        stop_engine(home)
    stopped = subprocess.run(
        [*run, "engine.keep=false"], capture_output=True, text=True, env=_env(home), timeout=600
    )
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert "stopped the local engine this run started" in stopped.stdout
    assert engine_info(home) is None


def test_run_help_lists_the_config_groups_and_their_options():
    result = subprocess.run(
        [*SESS, "run", "--help"], capture_output=True, text=True, env=_env(Path("/nonexistent"))
    )
    assert result.returncode == 0
    listing = result.stdout.split("Config groups")[1]
    groups = {
        line.split()[0]: line for line in listing.splitlines() if line.startswith("  ") and line.strip()
    }
    for group, options in {
        "loop": ("grpo", "sft", "ppo", "kto", "importance_sampling"),
        "model": ("smollm2-135m", "tiny-llama", "gpt-oss-20b"),
        "data": ("arithmetic", "gsm8k", "chat_jsonl"),
        "engine": ("local", "inprocess", "remote"),
        "logger": ("local", "wandb"),
    }.items():
        assert all(option in groups[group] for option in options), (group, groups.get(group))


def test_runs_show_and_compare(sess_home, tmp_path):
    runs = tmp_path / "runs"
    base = ["run", *TINY, "engine=inprocess", f"runs_dir={runs}", "loop.steps=2", "eval_every=1"]
    for extra in (["loop.learning_rate=1e-3"], ["loop.learning_rate=1e-2"]):
        assert cli.invoke(app, [*base, *extra]).exit_code == 0
    first, second = sorted(p.name for p in runs.iterdir())
    shown = cli.invoke(app, ["runs", "show", first, "--dir", str(runs)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "loop grpo (2 steps" in shown.output and "model tiny-llama" in shown.output
    assert "eval accuracy" in shown.output and "reward" in shown.output
    chart = shown.output.split("\n")
    assert any("* train reward" in line and "o held-out accuracy" in line for line in chart)
    compared = cli.invoke(app, ["runs", "compare", first, second, "--dir", str(runs)], env={"COLUMNS": "200"})
    assert compared.exit_code == 0, compared.output
    assert (
        "loop.learning_rate" in compared.output and "0.001" in compared.output and "0.01" in compared.output
    )
    assert "model.name" not in compared.output  # only what differs
    missing = cli.invoke(app, ["runs", "show", "no-such-run", "--dir", str(runs)])
    assert missing.exit_code == 1 and "sess runs" in missing.output


@pytest.fixture(scope="module")
def attach_env(http_engine, sess_home):
    from sess.engine import ServiceClient

    svc = ServiceClient(http_engine["url"], home=sess_home)
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="attach-repl")
    yield _env(sess_home, SESS_ENGINE_URL=http_engine["url"])
    tc.stop()
    svc.close()


CODE = "print('STEP', tc.forward_backward([tok.encode('one two three')]).result().metrics['loss:sum'] > 0)"


def test_attach_runs_a_snippet_with_dash_c(attach_env):
    result = subprocess.run(
        [*SESS, "attach", "attach-repl", "-c", CODE],
        capture_output=True,
        text=True,
        env=attach_env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "STEP True"


@pytest.mark.parametrize("shell", ["plain", "ipython"])
def test_attach_opens_a_repl_with_the_session_bound(attach_env, shell):
    if shell == "ipython":
        pytest.importorskip("IPython")
    args = ["attach", "attach-repl", *(["--plain"] if shell == "plain" else [])]
    result = subprocess.run(
        [*SESS, *args], input=CODE + "\n", capture_output=True, text=True, env=attach_env, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sess attach: session attach-repl on tiny-llama" in result.stdout + result.stderr
    assert "STEP True" in result.stdout
    if shell == "plain":  # the plain REPL keeps a history file in the engine home
        assert (Path(attach_env["SESS_HOME"]) / "attach_history").exists()
