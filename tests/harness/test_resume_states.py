"""A resumed run continues from the state the engine saved of its session on the way down (on its
own SIGTERM or SIGINT, or a stop), when that state is whole and falls on a step the run recorded:
no recorded step is computed again, and the metrics equal an uninterrupted run's to the bit. A
state that does not load is skipped with a line naming it, for the run's own last state. SIGTERM
to the run process finishes and saves the step, as Ctrl-C does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sess.engine import ServiceClient
from sess.engine.sdk.local_engine import engine_info, start_engine, stop_engine
from sess.harness import runner
from sess.harness.records import read_jsonl

from run_helpers import TINY, comparable

STEPS = 4
OVERRIDES = [
    *TINY,
    "engine=local",
    "loop=grpo",
    f"loop.steps={STEPS}",
    "loop.group_size=4",
    "seed=3",
    "eval_every=0",
]  # seed 3: step 2 trains nothing, so the session's step count trails the run's


def _rows(run_dir: Path) -> list[dict]:
    return comparable(read_jsonl(run_dir / "metrics.jsonl"))


def _meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "meta.json").read_text())


def _stop_at(step: int):
    def on_step(done: int) -> None:
        if done == step:
            raise runner.RunInterrupted

    return on_step


def _interrupted_run(tmp_path: Path, name: str, at: int, *extra: str) -> Path:
    with pytest.raises(runner.RunInterrupted):
        runner.start(
            [*OVERRIDES, *extra, f"runs_dir={tmp_path / name}"], on_step=_stop_at(at), show_progress=False
        )
    (run_dir,) = (tmp_path / name).iterdir()
    return run_dir


def _state_dir(home: Path, path: str) -> Path:
    session, kind, name = path.removeprefix("sess://").split("/")
    return home / "checkpoints" / session / kind / name


@pytest.fixture(scope="module")
def whole(http_engine, tmp_path_factory) -> Path:
    """The run never interrupted."""
    runs = tmp_path_factory.mktemp("whole")
    return runner.start([*OVERRIDES, f"runs_dir={runs}"], show_progress=False)


def test_a_resume_continues_from_the_state_the_engine_saved_at_the_stop(whole, sess_home, tmp_path, capfd):
    run_dir = _interrupted_run(tmp_path, "stopped", 2)  # killed after step 2, nothing saved yet
    session = _meta(run_dir)["session"]
    with ServiceClient() as svc:
        svc.stop_session(session)  # the engine saves the session's state, as at its own shutdown
        [saved] = [c["path"] for c in svc.list_checkpoints(session) if c["kind"] == "state"]
    assert "/state/stop-step000001-" in saved  # one update in two steps

    runner.resume(run_dir, show_progress=False)
    [resumed] = _meta(run_dir)["resumes"]
    assert resumed["step"] == 2 and resumed["path"] == saved and resumed["saved_by"] == "engine"
    assert resumed["recomputed"] == [] and "skipped" not in resumed
    assert _rows(run_dir) == _rows(whole)  # every step's loss, grad norm, reward and tokens, to the bit
    assert _meta(run_dir)["status"] == "completed"


def test_a_state_that_is_not_whole_is_skipped_for_the_last_good_one(whole, sess_home, tmp_path, capfd):
    run_dir = _interrupted_run(tmp_path, "broken", 3, "save_every=2")  # its own state at step 2
    session = _meta(run_dir)["session"]
    with ServiceClient() as svc:
        svc.stop_session(session)
        [stopped] = [c["path"] for c in svc.list_checkpoints(session) if "/state/stop-" in c["path"]]
    (_state_dir(sess_home, stopped) / "optimizer.safetensors").unlink()  # written in part

    runner.resume(run_dir, show_progress=False)
    said = capfd.readouterr().err
    assert f"state {stopped} of step 3 is not whole (" in said
    assert "optimizer.safetensors missing): skipped" in said
    [resumed] = _meta(run_dir)["resumes"]
    assert resumed["step"] == 2 and resumed["saved_by"] == "run" and resumed["recomputed"] == [3]
    assert resumed["skipped"] and stopped in resumed["skipped"][0]
    assert _rows(run_dir) == _rows(whole)


@pytest.fixture()
def own_home(tmp_path, monkeypatch):
    """A home of this test's own: it signals the engine, which no other test may be using."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("SESS_HOME", str(home))
    yield home
    stop_engine(home)


def _wait_gone(pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine pid {pid} still running {timeout:.0f} s after the signal")


@pytest.mark.slow  # two engine starts and a graceful shutdown: about a minute each
@pytest.mark.parametrize(
    "signum, broken",
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)],
    ids=["TERM", "INT", "TERM-broken"],
)
def test_the_run_resumes_from_the_engines_shutdown_state(own_home, tmp_path, capfd, signum, broken):
    """The local engine signalled after step 3 saves the session's state on its way down; the run
    starts it again and continues from that state: nothing computed twice. The same state with its
    optimizer file gone is skipped, with a line, for the run's own save at step 2."""
    whole = runner.start([*OVERRIDES, f"runs_dir={tmp_path / 'whole'}"], show_progress=False)
    signalled = []

    def on_step(done: int) -> None:
        if done == 3 and not signalled:
            pid = engine_info()["pid"]
            signalled.append(pid)
            os.kill(pid, signum)
            _wait_gone(pid)  # its shutdown save is done before the run sends its next op
            if broken:
                [saved] = own_home.glob("checkpoints/*/state/shutdown-*")
                (saved / "optimizer.safetensors").unlink()

    run_dir = runner.start(
        [*OVERRIDES, "save_every=2", f"runs_dir={tmp_path / 'signalled'}"],
        on_step=on_step,
        show_progress=False,
    )
    assert signalled
    said = capfd.readouterr().err
    [resumed] = _meta(run_dir)["resumes"]
    if broken:
        assert "/state/shutdown-step000002-" in said and "optimizer.safetensors missing): skipped" in said
        assert "started it again and resuming from step 2" in said
        assert resumed["step"] == 2 and resumed["saved_by"] == "run" and resumed["recomputed"] == [3]
    else:
        assert (
            "the local engine is not running (at step 3): started it again and resuming from step 3" in said
        )
        assert "/state/shutdown-step000002-" in resumed["path"] and resumed["saved_by"] == "engine"
        assert resumed["step"] == 3 and resumed["recomputed"] == []
    assert _rows(run_dir) == _rows(whole)


@pytest.mark.slow  # a run in its own process, and an engine of its own
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signalled_run_process_saves_its_step_and_resumes_from_it(own_home, tmp_path, signum):
    start_engine(own_home)
    overrides = [*OVERRIDES, "loop.steps=8"]  # time for the signal to land mid-run
    whole = runner.start([*overrides, f"runs_dir={tmp_path / 'whole'}"], show_progress=False)
    runs = tmp_path / "signalled"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sess.harness", *overrides, f"runs_dir={runs}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        rows = [r for d in runs.glob("*") for r in read_jsonl(d / "metrics.jsonl")]
        if any(r["kind"] == "train" and r["step"] == 1 for r in rows):
            break
        time.sleep(0.05)
    proc.send_signal(signum)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output  # stopped after saving, not killed
    (run_dir,) = runs.iterdir()
    assert "resume with: sess run --resume" in output

    runner.resume(run_dir, show_progress=False)
    [resumed] = _meta(run_dir)["resumes"]
    assert 1 <= resumed["step"] < 8 and resumed["saved_by"] == "run" and resumed["recomputed"] == []
    assert _rows(run_dir) == _rows(whole)
