"""Output that can be copied and numbers that agree: whole names and numbers without a terminal,
folded (never cut) names in one, one-line messages, no question without a terminal, one wording for
"no engine", memory figures that say what they measure, and a time-left estimate near the truth."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import ServiceClient
from sess.harness import progress as progress_mod

runner = CliRunner()
SESS = [sys.executable, "-c", "from sess.cli.main import main; main()"]
LONG_RUN = "20261201-224554-grpo-smollm2-135m-with-a-name-longer-than-the-screen"
LOSS = -0.000912345


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SESS_ENGINE_URL", "TTY_COMPATIBLE")}
    return {**env, "HF_HUB_OFFLINE": "1", "COLUMNS": "40", **extra}


@pytest.fixture
def runs(tmp_path):
    run = tmp_path / "runs" / LONG_RUN
    run.mkdir(parents=True)
    (run / "meta.json").write_text(
        json.dumps({"loop": "grpo", "model": "smollm2-135m", "status": "completed", "steps": 2})
    )
    (run / "config.yaml").write_text("loop:\n  name: grpo\n  steps: 2\nmodel:\n  name: smollm2-135m\n")
    rows = [{"kind": "train", "step": s, "loss": LOSS * s, "seconds": 1.5} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "runs"


def test_without_a_terminal_tables_print_whole_names_and_numbers(runs):
    listed = subprocess.run([*SESS, "runs", "--dir", str(runs)], capture_output=True, text=True, env=_env())
    assert listed.returncode == 0, listed.stderr
    assert "…" not in listed.stdout
    assert listed.stdout.splitlines()[1].split("\t")[:2] == [LONG_RUN, "grpo"]
    shown = subprocess.run(
        [*SESS, "runs", "show", LONG_RUN, "--dir", str(runs)], capture_output=True, text=True, env=_env()
    )
    assert shown.returncode == 0, shown.stderr
    assert "…" not in shown.stdout and f"2\t{LOSS * 2:.4g}\t1.5" in shown.stdout


def test_in_a_terminal_names_fold_and_are_never_cut(runs):
    listed = subprocess.run(
        [*SESS, "runs", "--dir", str(runs)], capture_output=True, text=True, env=_env(TTY_COMPATIBLE="1")
    )
    assert listed.returncode == 0, listed.stderr
    assert "…" not in listed.stdout and "\t" not in listed.stdout  # rich's table, not the plain one
    first_cells = [line.split("│")[1].strip() for line in listed.stdout.splitlines() if line.count("│") > 2]
    assert "".join(first_cells).startswith(LONG_RUN)  # the name, folded onto lines of the column


def test_session_lists_are_whole_and_messages_one_line(http_engine, sess_home):
    name = "a-session-name-much-longer-than-forty-columns-0123456789"
    svc = ServiceClient(http_engine["url"], home=sess_home)
    svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name=name).stop()
    env = {"SESS_HOME": str(sess_home), "SESS_ENGINE_URL": http_engine["url"], "COLUMNS": "40"}
    listed = runner.invoke(app, ["list"], env=env)
    assert listed.exit_code == 0 and f"{name}\ttiny-llama\tStopped\t0\t" in listed.output, listed.output
    svc.close()
    status = subprocess.run(
        [*SESS, "engine", "status", "--home", str(sess_home)], capture_output=True, text=True, env=_env()
    )
    # one line per message: where the engine runs, whether its sampling is batch-invariant, how
    # its one- and two-row matmuls run and whether its attention, norms and token draws run in C
    lines = status.stdout.strip().splitlines()
    assert status.returncode == 0 and len(lines) == 4, status.stdout
    assert lines[0].startswith("engine running at ") and lines[0].endswith("saved and stopped)"), lines
    assert lines[1].startswith("sampling: "), lines
    assert lines[2].startswith("one- and two-row matmuls: "), lines
    assert lines[3].startswith("attention, norms and token draws: "), lines


def test_memory_figures_say_what_they_measure(http_engine, sess_home):
    """Resident now and peak; read after the engine's idle trim, the figure says it is after it."""
    time.sleep(6)  # the engine hands free memory back after 5 s without work
    status = runner.invoke(app, ["engine", "status", "--home", str(sess_home)])
    assert status.exit_code == 0, status.output
    assert re.search(
        r"\d+\.\d GB resident now \(idle: free memory handed back\), peak \d+\.\d GB", status.output
    )
    info = json.loads(runner.invoke(app, ["engine", "status", "--home", str(sess_home), "--json"]).output)
    assert info["trimmed"] is True and info["peak_rss_bytes"] >= info["rss_bytes"] > 0


def test_no_engine_is_one_wording_and_down_with_none_exits_0(tmp_path):
    home = str(tmp_path / "home")
    down = runner.invoke(app, ["engine", "down", "--home", home])
    assert down.exit_code == 0 and f"no engine is running for {home}; nothing to stop" in down.output
    status = runner.invoke(app, ["engine", "status", "--home", home])
    assert status.exit_code == 1 and f"no engine is running for {home}" in status.output
    listed = runner.invoke(app, ["list"], env={"SESS_HOME": home, "SESS_ENGINE_URL": ""})
    assert listed.exit_code == 1 and f"no engine is running for {home}" in listed.output


def test_delete_without_a_terminal_refuses_at_once_naming_yes(tmp_path):
    result = subprocess.run(
        [*SESS, "delete", "some-session"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=_env(SESS_HOME=str(tmp_path / "home")),
        timeout=60,
    )
    assert result.returncode == 1 and "--yes" in result.stderr and "[y/N]" not in result.stdout
    assert not (tmp_path / "home" / "engine.json").exists()  # refused before starting an engine


def test_time_left_is_near_the_truth_from_the_first_step(monkeypatch, capsys):
    """A one-minute session start and 20 s evaluations are not steps, and the first step's warm-up
    is not every step's: each estimate is within 50 % of the time the run then takes."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(progress_mod, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    cfg = OmegaConf.create({"loop": {"name": "grpo", "steps": 10, "eval_every": 5}, "model": {"name": "m"}})
    shown: list[float] = []
    ends: list[float] = []

    def evaluate(done: int) -> None:
        with bar.status(f"evaluating at step {done}"):
            clock.now += 20
        bar.note_eval(done, {"eval/accuracy": 0.5, "eval/seconds": 20.0})

    with progress_mod.Progress(cfg, cfg.loop.steps, 0, console=progress_mod.Console(stderr=True)) as bar:
        with bar.status("starting a session"):
            clock.now += 60
        evaluate(0)
        for done in range(1, 11):
            clock.now += 8 if done == 1 else 4
            bar.update(done, {"loss": 1.0})
            shown.append(float(re.findall(r"\((\d+) s left\)", capsys.readouterr().err)[-1]))
            ends.append(clock.now)
            if done == 5:
                evaluate(done)
        evaluate(10)
    for done, (estimate, at) in enumerate(zip(shown, ends), start=1):
        truth = clock.now - at
        assert abs(estimate - truth) <= 0.5 * truth, (done, estimate, truth)


def _commands(command, path=("sess",)):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_help_texts_are_paragraphs_that_the_terminal_wraps():
    """A docstring's hard line breaks would show mid-sentence; every command's help reaches Typer
    as paragraphs, which it wraps to the terminal's width (80 and 120 columns here)."""
    import typer.main

    broken = {
        " ".join(path): paragraph
        for path, command in _commands(typer.main.get_command(app))
        for paragraph in (command.help or "").split("\n\n")
        if re.search(r"\n(?![-*] |\s)", paragraph)
    }
    assert broken == {}
    for columns in (80, 120):
        for command in (["run"], ["engine", "up"], ["runs", "show"], ["checkpoints"]):
            shown = runner.invoke(app, [*command, "--help"], env={"COLUMNS": str(columns)}).output
            description = shown.partition("╭")[0]  # above the argument and option panels
            for paragraph in re.split(r"\n\s*\n", description):
                lines = [line.strip() for line in paragraph.splitlines() if line.strip()]
                # wrapped lines run to the right margin (less a long word); a hard break stops short
                assert all(len(line) > columns - 30 for line in lines[:-1]), (command, columns, lines)
    run_help = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "120"}).output
    assert "usage); `sess runs` lists them and" in run_help  # one sentence, not broken after "runs`"
