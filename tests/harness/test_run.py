"""`sess run` end to end on tiny models: every loop records a complete run; dry runs; replay; resume;
Ctrl-C; failures recorded; damaged records; one-line errors for bad options and overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sess.cli.main import app
from sess.harness import runner
from sess.harness.records import RECORD_FILES, read_jsonl

from run_helpers import GROUPS, TINY, cli, comparable, run


def _train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _assert_same(rows_a: list[dict], rows_b: list[dict]) -> None:
    """Every recorded value but wall time is identical: samples, rewards, token counts, and loss and
    grad norm to the last bit (sampling is batch-invariant, so thread timing cannot leak in)."""
    assert len(rows_a) == len(rows_b)
    assert comparable(rows_a) == comparable(rows_b)


@pytest.mark.parametrize("loop", ["sft", "grpo", "ppo", "importance_sampling", "kto"])
def test_each_loop_writes_a_complete_run(sess_home, tmp_path, loop):
    run_dir = run(tmp_path, f"loop={loop}", "loop.steps=2", *GROUPS.get(loop, []))
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
    first = run(tmp_path / "a", *overrides)
    replay = yaml.safe_load((first / "overrides.yaml").read_text())
    second = run(tmp_path / "b", *[o for o in replay if not o.startswith("runs_dir=")])
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
        "save_every=2",
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
        comparable([r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "eval"])
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
    run_dir = run(
        tmp_path / "g", "loop=sft", "data=gsm8k", f"data.path={gsm}", "data.eval_size=2", "loop.steps=1"
    )
    assert [r["kind"] for r in read_jsonl(run_dir / "metrics.jsonl")] == ["eval", "train", "eval"]
    chats = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    chats.write_text(json.dumps(chat) + "\n" * 1 + json.dumps(chat) + "\n" + json.dumps(chat) + "\n")
    run_dir = run(
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
    run_dir = run(
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


def test_sft_that_runs_out_of_epochs_evaluates_and_saves_the_step_it_reached(sess_home, tmp_path):
    """``epochs=1`` over 6 training chats in batches of 2 ends SFT after 3 of its 10 steps: the runner
    evaluates, saves and exports at step 3, the step the loop reports, never at an unreached step 10."""
    chats = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    chats.write_text((json.dumps(chat) + "\n") * 8)
    run_dir = run(
        tmp_path / "runs",
        "loop=sft",
        "data=chat_jsonl",
        f"data.path={chats}",
        "data.eval_size=2",
        "loop.epochs=1",
        "loop.steps=10",
        "eval_every=0",
        "save_every=0",
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("eval", 0),
        ("train", 1),
        ("train", 2),
        ("train", 3),
        ("eval", 3),
    ]
    saved = [(r["kind"], r["step"]) for r in read_jsonl(run_dir / "checkpoints.jsonl")]
    assert saved == [("state", 3), ("sampler", 3)]
    assert json.loads((run_dir / "meta.json").read_text())["status"] == "completed"


def test_resuming_a_completed_run_changes_nothing(sess_home, tmp_path):
    run_dir = run(tmp_path, "loop=sft", "loop.steps=1")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    result = cli.invoke(app, ["run", "--resume", str(run_dir)])
    assert result.exit_code == 0, result.output  # a retried resume of a finished run is no failure
    assert result.output.strip() == f"run {run_dir} already completed (1/1 steps); nothing to resume"
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def _recorded_run(runs_dir: Path, name: str, steps: int = 2) -> Path:
    """A run directory as a finished run leaves it, without running anything."""
    from sess.harness.records import RunRecord

    path = runs_dir / name
    path.mkdir(parents=True)
    record = RunRecord.create(path, "loop:\n  name: sft\n  steps: 2\n", [], {"loop": "sft", "steps": steps})
    for step in range(1, steps + 1):
        record.append("metrics.jsonl", {"kind": "train", "step": step, "loss": 1.0 / step})
    record.update_meta(status="completed")
    return path


def test_one_damaged_run_hides_no_other(tmp_path):
    for name in ("a-good", "b-meta", "c-killed", "d-config", "e-metrics"):
        _recorded_run(tmp_path, name)
    (tmp_path / "b-meta" / "meta.json").write_text("")
    with (tmp_path / "c-killed" / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 3, "lo')  # what a run killed mid-write leaves
    (tmp_path / "d-config" / "config.yaml").write_text("loop: [unclosed\n")
    (tmp_path / "e-metrics" / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\nnot json\n{}\n')

    listing = cli.invoke(app, ["runs", "--dir", str(tmp_path)])
    assert listing.exit_code == 0, listing.output
    rows = {line.split("\t")[0]: line.split("\t") for line in listing.stdout.splitlines()[1:]}
    assert rows["a-good"][3:5] == ["completed", "2/2"] and rows["c-killed"][3:5] == ["completed", "2/2"]
    assert rows["b-meta"][3] == "damaged" and rows["e-metrics"][3] == "damaged"
    problems = listing.stderr.splitlines()
    assert len(problems) == 2
    assert "b-meta/meta.json: not valid JSON" in problems[0]
    assert "e-metrics/metrics.jsonl: line 2 is not valid JSON" in problems[1]

    shown = cli.invoke(app, ["runs", "show", "c-killed", "--dir", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    steps = [line.split("\t") for line in shown.stdout.splitlines() if "\t" in line]  # no terminal: TSV
    assert steps[0][0] == "step" and [row[0] for row in steps[1:]] == ["1", "2"]
    for name, file in (("b-meta", "meta.json"), ("d-config", "config.yaml"), ("e-metrics", "metrics.jsonl")):
        broken = cli.invoke(app, ["runs", "show", name, "--dir", str(tmp_path)])
        assert broken.exit_code == 1 and len(broken.output.splitlines()) == 1, broken.output
        assert broken.output.startswith("error:") and f"{name}/{file}" in broken.output


def test_a_failed_run_records_why(sess_home, tmp_path):
    result = cli.invoke(
        app, ["run", *TINY, "engine=inprocess", f"runs_dir={tmp_path}", "model.base_model=no-such"]
    )
    assert result.exit_code == 1
    (run_dir,) = tmp_path.iterdir()
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "failed" and "no-such" in meta["error"] and "\n" not in meta["error"]
    shown = cli.invoke(app, ["runs", "show", str(run_dir)], env={"COLUMNS": "300"})
    assert f"failed: {meta['error']}" in shown.stdout
    listing = cli.invoke(app, ["runs", "--dir", str(tmp_path)])
    assert listing.stderr == f"{run_dir.name}: failed: {meta['error']}\n"


def test_a_session_a_run_cannot_use_is_refused(sess_home, tmp_path):
    from sess.engine import ServiceClient

    refused = cli.invoke(
        app, ["run", *TINY, "engine=inprocess", f"runs_dir={tmp_path}", "--session", "bad/name"]
    )
    assert refused.exit_code == 1 and "session: 'bad/name' is not a valid name" in refused.output
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # refused before a run directory
    svc = ServiceClient("inproc")
    svc.create_lora_training_client("tiny-llama", rank=4, training_session_name="stopped-one").stop()
    result = cli.invoke(
        app, ["run", *TINY, "engine=inprocess", f"runs_dir={tmp_path}", "--session", "stopped-one"]
    )
    assert result.exit_code == 1 and "session 'stopped-one' is Stopped" in result.output
    (run_dir,) = tmp_path.iterdir()
    assert "is Stopped" in json.loads((run_dir / "meta.json").read_text())["error"]


def test_a_bad_engine_url_is_named_and_no_engine_is_claimed(sess_home, tmp_path, monkeypatch):
    junk = cli.invoke(app, ["run", "engine=remote", "engine.url=junk", f"runs_dir={tmp_path}", "--dry-run"])
    assert junk.exit_code == 1 and junk.output.startswith("error: engine.url:") and "'junk'" in junk.output
    monkeypatch.setattr("sess.engine.sdk.http_transport.RETRY_DEADLINE_S", 0.2)
    closed = cli.invoke(
        app, ["run", *TINY, "engine=remote", "engine.url=http://127.0.0.1:1", f"runs_dir={tmp_path}"]
    )
    assert closed.exit_code == 1 and "cannot reach the engine at http://127.0.0.1:1" in closed.output
    assert "keeps running" not in closed.output


@pytest.mark.parametrize(
    "override,message",
    [
        ("loop.steps=abc", "override loop.steps=abc: expected an integer"),
        ("loop.learning_rate=fast", "override loop.learning_rate=fast: expected a number"),
        ("notanoverride", "notanoverride: expected KEY=VALUE or group=option (see sess run --help)"),
        ("~loop", "~loop: keys and groups cannot be removed"),
    ],
)
def test_malformed_overrides_are_one_line_naming_them(override, message):
    result = cli.invoke(app, ["run", override, "--dry-run"])
    assert result.exit_code == 1 and result.output.startswith(f"error: {message}"), result.output
    assert len(result.output.splitlines()) == 1


def test_print_config_and_dry_run_together_are_refused():
    result = cli.invoke(app, ["run", "--print-config", "--dry-run"])
    assert result.exit_code == 2 and "--print-config and --dry-run" in result.output


def test_ctrl_c_saves_stops_the_session_and_says_how_to_resume(sess_home, tmp_path, http_engine):
    import signal
    import subprocess
    import sys

    from sess.engine import ServiceClient

    overrides = [
        *TINY,
        "loop=grpo",
        "loop.group_size=2",
        "loop.steps=8",
        "save_every=0",
        "engine=remote",
    ]
    command = [sys.executable, "-c", "from sess.cli.main import main; main()", "run", *overrides]
    run = subprocess.Popen(
        [*command, f"engine.url={http_engine['url']}", f"runs_dir={tmp_path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # even under a shell that ignores it
    )
    for line in run.stderr:  # progress lines (stderr is no terminal)
        if " step 2/8" in line:
            run.send_signal(signal.SIGINT)
            break
    _, rest = run.communicate(timeout=120)
    (run_dir,) = tmp_path.iterdir()
    meta = json.loads((run_dir / "meta.json").read_text())
    state = read_jsonl(run_dir / "checkpoints.jsonl")[-1]  # saved by the Ctrl-C: save_every is off
    assert run.returncode == 130 and meta["status"] == "interrupted" and 2 <= state["step"] < 8
    hint = f"interrupted at step {state['step']}; resume with: sess run --resume {run_dir}"
    assert rest.splitlines()[-1] == hint, rest
    (session,) = ServiceClient(http_engine["url"]).list_sessions(name_contains=meta["session"])
    assert session.status.value != "Running"
    resumed = cli.invoke(app, ["run", "--resume", str(run_dir)])
    assert resumed.exit_code == 0, resumed.output
    assert [r["step"] for r in _train_rows(run_dir)] == list(range(1, 9))
    assert json.loads((run_dir / "meta.json").read_text())["resumes"][0]["step"] == state["step"]
