"""`sess run` end to end on tiny models: every loop records a complete run; dry runs; replay; resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from sess.cli.main import app
from sess.loops import runner
from sess.loops.records import RECORD_FILES, read_jsonl

cli = CliRunner()

TINY = ["model=tiny-llama", "data.eval_size=4", "loop.max_tokens=8", "loop.batch_size=2"]
GROUPS = {
    "grpo": ["loop.group_size=4"],
    "ppo": ["loop.group_size=2"],
    "importance_sampling": ["loop.group_size=4"],
}


def _run(tmp_path, *overrides: str) -> Path:
    engine = [] if any(o.startswith("engine=") for o in overrides) else ["engine=inprocess"]
    result = cli.invoke(app, ["run", *TINY, *engine, f"runs_dir={tmp_path}", *overrides])
    assert result.exit_code == 0, result.output + repr(result.exception)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and (p / "meta.json").exists()]
    return run_dir


def _train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _assert_same(rows_a: list[dict], rows_b: list[dict]) -> None:
    """Every recorded value but wall time is identical: samples, rewards, token counts, and loss and
    grad norm to the last bit (sampling is batch-invariant, so thread timing cannot leak in)."""
    assert len(rows_a) == len(rows_b)
    assert _comparable(rows_a) == _comparable(rows_b)


def _comparable(rows: list[dict]) -> list[dict]:
    drop = {"time", "seconds", "eval/seconds"}
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


@pytest.mark.parametrize("loop", ["sft", "grpo", "ppo", "importance_sampling", "kto"])
def test_each_loop_writes_a_complete_run(sess_home, tmp_path, loop):
    run_dir = _run(tmp_path, f"loop={loop}", "loop.steps=2", *GROUPS.get(loop, []))
    assert sorted(p.name for p in run_dir.iterdir() if p.is_file()) == sorted(RECORD_FILES)
    assert run_dir.name.endswith(f"-{loop}-tiny-llama")
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["loop"] == loop and meta["seed"] == 0 and meta["session"]
    assert meta["versions"]["torch"] and meta["command"]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["loop"]["name"] == loop and config["loop"]["steps"] == 2
    assert "loop.steps=2" in yaml.safe_load((run_dir / "overrides.yaml").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]
    assert all("loss" in r for r in rows if r["kind"] == "train")
    checkpoints = read_jsonl(run_dir / "checkpoints.jsonl")
    assert [(c["kind"], c["step"]) for c in checkpoints] == [("state", 2), ("sampler", 2)]
    assert all(c["path"].startswith("sess://") for c in checkpoints)
    usage = json.loads((run_dir / "usage.json").read_text())
    assert usage["training_tokens"] > 0
    listing = cli.invoke(app, ["runs", "--dir", str(tmp_path)])
    assert listing.exit_code == 0 and loop in listing.output


def test_dry_run_of_gpt_oss_prints_the_plan_without_weights(sess_home):
    result = cli.invoke(app, ["run", "model=gpt-oss-20b", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "openai/gpt-oss-20b" in result.output and "mlp.experts.gate_up_proj" in result.output
    assert "engine: local" in result.output
    assert not (sess_home / "models" / "gpt-oss-20b").exists()


def test_starting_gpt_oss_without_weights_fails_with_one_line(sess_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = cli.invoke(app, ["run", "model=gpt-oss-20b", "engine=inprocess", f"runs_dir={tmp_path}"])
    assert result.exit_code == 1
    progress = "grpo gpt-oss-20b: "  # the run's progress lines (stderr is no terminal here)
    lines = [line for line in result.output.splitlines() if line.strip() and not line.startswith(progress)]
    assert len(lines) == 1 and lines[0].startswith("error:") and "gpt-oss-20b" in lines[0], result.output


def test_print_config_is_the_resolved_yaml(sess_home):
    result = cli.invoke(app, ["run", "loop=kto", "model=tiny-qwen3", "--print-config"])
    assert result.exit_code == 0
    cfg = yaml.safe_load(result.output)
    assert cfg["loop"]["name"] == "kto" and cfg["model"]["base_model"] == "tiny-qwen3"


def test_same_config_and_seed_reproduce_the_metrics(sess_home, tmp_path):
    overrides = ["loop=grpo", "loop.steps=2", "loop.group_size=4", "seed=7", "data.eval_size=2"]
    first = _run(tmp_path / "a", *overrides)
    replay = yaml.safe_load((first / "overrides.yaml").read_text())
    second = _run(tmp_path / "b", *[o for o in replay if not o.startswith("runs_dir=")])
    rows_a, rows_b = _train_rows(first), _train_rows(second)
    assert len(rows_a) == 2 and any(r["datums"] > 0 for r in rows_a), rows_a  # some groups had signal
    _assert_same(rows_a, rows_b)
    assert (first / "config.yaml").read_text().replace(str(tmp_path / "a"), "") == (
        second / "config.yaml"
    ).read_text().replace(str(tmp_path / "b"), "")


def test_resume_after_a_kill_matches_the_uninterrupted_run(sess_home, tmp_path):
    overrides = [
        *TINY,
        "engine=inprocess",
        "loop=grpo",
        "loop.steps=4",
        "loop.save_every=2",
        "loop.group_size=4",
        "seed=3",
    ]
    whole = runner.start([*overrides, f"runs_dir={tmp_path / 'whole'}"], show_progress=False)

    def kill_after_second_save(done: int) -> None:
        if done == 2:
            raise runner.RunInterrupted()

    with pytest.raises(runner.RunInterrupted):
        runner.start([*overrides, f"runs_dir={tmp_path / 'killed'}"], on_step=kill_after_second_save)
    (killed,) = (tmp_path / "killed").iterdir()
    assert [r["step"] for r in _train_rows(killed)] == [1, 2]
    result = cli.invoke(app, ["run", "--resume", str(killed)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    _assert_same(_train_rows(killed), _train_rows(whole))
    evals = [
        _comparable([r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "eval"])
        for d in (killed, whole)
    ]
    assert evals[0] == evals[1]
    meta = json.loads((killed / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["resumes"][0]["step"] == 2


def test_resume_without_a_saved_state_is_one_clear_line(tmp_path):
    result = cli.invoke(app, ["run", "--resume", str(tmp_path)])
    assert result.exit_code == 1 and "not a run directory" in result.output


def test_gsm8k_and_jsonl_files_plug_in(sess_home, tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    lines = [
        {
            "question": f"Ann has {i} pens and buys 2. How many?",
            "answer": f"{i}+2=<<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}",
        }
        for i in range(6)
    ]
    gsm.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_dir = _run(
        tmp_path / "g", "loop=sft", "data=gsm8k", f"data.path={gsm}", "data.eval_size=2", "loop.steps=1"
    )
    assert [r["kind"] for r in read_jsonl(run_dir / "metrics.jsonl")] == ["eval", "train", "eval"]
    chats = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    chats.write_text(json.dumps(chat) + "\n" * 1 + json.dumps(chat) + "\n" + json.dumps(chat) + "\n")
    run_dir = _run(
        tmp_path / "c",
        "loop=sft",
        "data=chat_jsonl",
        f"data.path={chats}",
        "data.eval_size=1",
        "loop.steps=1",
    )
    assert "eval/loss" in read_jsonl(run_dir / "metrics.jsonl")[-1]
    result = cli.invoke(
        app,
        [
            "run",
            *TINY,
            "engine=inprocess",
            "loop=grpo",
            "data=chat_jsonl",
            f"data.path={chats}",
            "data.eval_size=1",
            f"runs_dir={tmp_path / 'refused'}",
        ],
    )
    assert result.exit_code == 1 and "needs problem data" in result.output
    assert not (tmp_path / "refused").exists()  # refused before a run directory was made


@pytest.mark.parametrize("loop", ["grpo", "sft"])
def test_loops_run_against_an_engine_process(sess_home, tmp_path, http_engine, loop):
    run_dir = _run(
        tmp_path,
        f"loop={loop}",
        "loop.steps=2",
        "engine=remote",
        f"engine.url={http_engine['url']}",
        *GROUPS.get(loop, []),
    )
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["engine"]["url"] == http_engine["url"]
    assert [r["step"] for r in _train_rows(run_dir)] == [1, 2]
