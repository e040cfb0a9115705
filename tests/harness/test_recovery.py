"""A run that outlives its engine: the local engine killed (SIGKILL) twice mid-run, and the run
starts it again, resumes from its last saved state and finishes with the metrics of a run never
interrupted, to the bit; usage counts every op once, the uninterrupted run's plus exactly the steps
computed again, which the record lists. With recovery off, the error names the command that
continues the run."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from sess.engine.sdk.local_engine import engine_info, start_engine, stop_engine
from sess.harness import recovery, runner
from sess.harness.records import read_jsonl

from run_helpers import TINY, comparable

STEPS = 6
OVERRIDES = [
    *TINY,
    "engine=local",
    "loop=grpo",
    f"loop.steps={STEPS}",
    "loop.group_size=4",
    "seed=3",
    "eval_every=0",
]
COUNTS = ("prefill_tokens", "sampled_tokens", "training_tokens")


@pytest.fixture()
def own_home(tmp_path, monkeypatch):
    """A home of this test's own: it kills the engine, which no other test may be using."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("SESS_HOME", str(home))
    yield home
    stop_engine(home)


def _kill_engine_after(*steps: int):
    killed: list[int] = []

    def on_step(done: int) -> None:
        if done in steps and done not in killed:  # a recomputed step is not killed again
            killed.append(done)
            os.kill(engine_info()["pid"], signal.SIGKILL)

    return on_step, killed


def _rows(run_dir) -> list[dict]:
    return comparable(read_jsonl(run_dir / "metrics.jsonl"))


def test_a_run_outlives_two_kills_of_its_local_engine(own_home, tmp_path, capfd):
    # the uninterrupted run saves after every step: its records give each step's usage on its own
    whole = runner.start([*OVERRIDES, "save_every=1", f"runs_dir={tmp_path / 'whole'}"], show_progress=False)
    on_step, killed = _kill_engine_after(3, 5)
    run_dir = runner.start(
        [*OVERRIDES, "save_every=2", f"runs_dir={tmp_path / 'killed'}"], on_step=on_step, show_progress=False
    )
    assert killed == [3, 5]
    assert _rows(run_dir) == _rows(whole)  # every step's loss, grad norm, reward and tokens, to the bit
    said = capfd.readouterr().err
    assert (
        said.count("the local engine is not running (at step 3): started it again and resuming from step 2")
        == 1
    )
    assert said.count("(at step 5): started it again and resuming from step 4 (recovery 2 of 3)") == 1
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "completed" and "error" not in meta
    assert [(r["step"], r["recomputed"]) for r in meta["resumes"]] == [(2, [3]), (4, [5])]
    assert len(meta["sessions"]) == 3
    # usage: the uninterrupted run's, plus steps 3 and 5 once more, each op counted once
    per_step = {0: {k: 0 for k in COUNTS}}
    for row in read_jsonl(whole / "checkpoints.jsonl"):
        if row["kind"] == "state":
            per_step[row["step"]] = row["usage"]
    extra = {k: sum(per_step[s][k] - per_step[s - 1][k] for s in (3, 5)) for k in COUNTS}
    assert all(extra[k] > 0 for k in ("prefill_tokens", "sampled_tokens", "training_tokens")), extra
    usage = {
        name: json.loads((d / "usage.json").read_text())
        for name, d in (("whole", whole), ("killed", run_dir))
    }
    for key in COUNTS:
        assert usage["killed"][key] == usage["whole"][key] + extra[key], key


def test_with_recovery_off_the_error_names_the_command_that_continues(own_home, tmp_path):
    on_step, _ = _kill_engine_after(2)
    with pytest.raises(recovery.EngineLost) as lost:
        runner.start(
            [*OVERRIDES, "save_every=1", "engine.restarts=0", f"runs_dir={tmp_path / 'runs'}"],
            on_step=on_step,
            show_progress=False,
        )
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "the local engine is not running (engine.restarts=0)" in str(lost.value)
    assert f"continue it with: sess run --resume {run_dir}" in str(lost.value)
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "failed"


@pytest.mark.slow  # minutes: the client's retries span the engine's restart
def test_a_run_waits_for_its_remote_engine_and_resumes_when_it_is_back(own_home, tmp_path, capfd):
    """A remote engine SIGKILLed after step 2 and started again on its address two seconds later
    (as a supervisor would): the run finds its session Interrupted there and resumes from step 2."""
    engine = start_engine(own_home)
    port, restarted = engine["port"], []

    def kill_and_restart(done: int) -> None:
        if done == 2 and not restarted:
            os.kill(engine_info()["pid"], signal.SIGKILL)
            later = threading.Timer(2.0, lambda: restarted.append(start_engine(own_home, port=port)))
            later.start()

    overrides = [o for o in OVERRIDES if o != "engine=local"]
    run_dir = runner.start(
        [
            *overrides,
            "engine=remote",
            f"engine.url={engine['url']}",
            "save_every=1",
            "loop.steps=3",
            f"runs_dir={tmp_path / 'runs'}",
        ],
        on_step=kill_and_restart,
        show_progress=False,
    )
    assert restarted and restarted[0]["pid"] != engine["pid"]
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "completed" and [r["step"] for r in meta["resumes"]] == [2]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3]
    assert "resuming from step 2 (recovery 1 of 3)" in capfd.readouterr().err
