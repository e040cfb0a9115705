"""`sess resume NAME` continues NAME itself (the registry keeps the resume as history); `attach` then
works; the SDK's from-state paths agree; an unknown name gets the nearest names and changes nothing."""

from __future__ import annotations

import sqlite3

import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import ServiceClient
from sess.engine.protocol.errors import SessError
from sess.engine.sdk.local_engine import start_engine, stop_engine

from helpers import SENTENCES, ce_datum

runner = CliRunner()


@pytest.fixture(scope="module")
def env(http_engine, sess_home):
    return {"SESS_HOME": str(sess_home), "SESS_ENGINE_URL": http_engine["url"], "COLUMNS": "60"}


@pytest.fixture(scope="module")
def svc(env):
    client = ServiceClient(env["SESS_ENGINE_URL"], home=env["SESS_HOME"])
    yield client
    client.close()


def invoke(env, *args):
    return runner.invoke(app, list(args), env=env)


def _trained(svc, name: str, steps: int = 1) -> str:
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name=name)
    for _ in range(steps):
        tc.forward_backward([ce_datum(tc.get_tokenizer().encode(SENTENCES[0]))]).result()
        tc.optim_step().result()
    return tc.save_state(name="s1").result().path


def test_resume_continues_the_session_under_its_own_name(env, svc, sess_home):
    state = _trained(svc, "keep-me", steps=2)
    svc.stop_session("keep-me")
    used = svc.get_usage("keep-me").training_tokens
    stopped = invoke(env, "attach", "keep-me", "-c", "print(1)")
    assert stopped.exit_code == 1 and "is Stopped at step 2" in stopped.output
    assert "sess resume keep-me" in stopped.output and "same name" in stopped.output
    before = {s.name for s in svc.list_sessions()}

    resumed = invoke(env, "resume", "keep-me")
    assert resumed.exit_code == 0, resumed.output
    assert f"session keep-me resumed from {state} at step 2 (it was Stopped at step 2)" in resumed.output
    assert {s.name for s in svc.list_sessions()} == before  # no copy under another name
    [row] = [s for s in svc.list_sessions() if s.name == "keep-me"]
    assert row.status.value == "Running" and row.step == 2

    code = (
        "print('LOSS', tc.forward_backward([tok.encode('one two three')]).result().metrics['loss:sum'] > 0)"
    )
    attached = invoke(env, "attach", "keep-me", "-c", code)
    assert attached.exit_code == 0 and "LOSS True" in attached.output, attached.output
    assert svc.get_usage("keep-me").training_tokens > used  # its usage carries on
    again = invoke(env, "resume", "keep-me")
    assert again.exit_code == 1 and "is running: nothing to resume" in again.output
    assert "sess attach keep-me" in again.output

    with sqlite3.connect(sess_home / "registry.db") as db:  # the stopped record, kept as history
        history = db.execute(
            "SELECT path, status_before, step_before, step FROM resumes WHERE session='keep-me'"
        ).fetchall()
    assert history == [(state, "Stopped", 2, 2)]
    svc.stop_session("keep-me")


def test_the_sdk_paths_that_resume_agree(svc):
    state = _trained(svc, "sdk-own")
    with pytest.raises(SessError, match="'sdk-own' is running already"):
        svc.create_training_client_from_state_with_optimizer(state, training_session_name="sdk-own")
    copy = svc.create_training_client_from_state_with_optimizer(state)  # no name: a new session
    assert copy.name != "sdk-own"
    copy.stop()
    svc.stop_session("sdk-own")
    with pytest.raises(SessError, match="continues only from its own checkpoints"):
        svc.create_training_client_from_state(state, training_session_name=copy.name)
    with pytest.raises(SessError, match="resume it to continue .*sess resume sdk-own"):
        svc.get_training_client("sdk-own")
    tc = svc.create_training_client_from_state(state, training_session_name="sdk-own")  # weights only
    assert tc.name == "sdk-own" and tc.current_sequence_number == 0
    tc.forward_backward([ce_datum(tc.get_tokenizer().encode(SENTENCES[1]))]).result()  # seq 1 again
    assert [s.step for s in svc.list_sessions() if s.name == "sdk-own"] == [1]
    tc.stop()


@pytest.mark.parametrize(
    "args",
    [["resume"], ["attach"], ["delete", "--yes"], ["checkpoints"], ["stop"]],
    ids=lambda a: a[0],
)
def test_an_unknown_name_gets_the_nearest_names_and_changes_nothing(env, svc, args):
    if not [s for s in svc.list_sessions() if s.name == "near-miss-one"]:
        svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="near-miss-one")
    before = [(s.name, s.status, s.step) for s in svc.list_sessions()]
    result = invoke(env, args[0], "near-miss-oen", *args[1:])
    assert result.exit_code == 1, result.output
    assert "no session 'near-miss-oen'; did you mean near-miss-one?" in result.output
    assert [(s.name, s.status, s.step) for s in svc.list_sessions()] == before


def test_after_a_restart_an_interrupted_session_continues_and_overwrites_nothing(tmp_path):
    """An engine restart makes the session Interrupted; `sess resume` continues it from an earlier
    state, and its next unnamed saves get names its first life did not use."""
    home = tmp_path / "home"
    env = {"SESS_HOME": str(home), "SESS_ENGINE_URL": ""}

    def train(tc, steps: int) -> None:
        for _ in range(steps):
            tc.forward_backward([ce_datum(tc.get_tokenizer().encode(SENTENCES[2]))]).result()
            tc.optim_step().result()

    info = start_engine(home)
    try:
        svc = ServiceClient(info["url"], home=home)
        tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="life")
        first = tc.save_state().result().path  # step 0, the first save
        train(tc, 2)
        second = tc.save_state().result().path  # step 2, the second
        svc.close()
    finally:
        stop_engine(home)
    info = start_engine(home)
    try:
        resumed = invoke(env, "resume", "life", "--checkpoint", first)
        assert resumed.exit_code == 0, resumed.output
        assert "at step 0 (it was Interrupted at step 2)" in resumed.output
        svc = ServiceClient(info["url"], home=home)
        tc = svc.get_training_client("life")
        again = tc.save_state().result().path
        train(tc, 2)
        later = tc.save_state().result().path
        assert len({first, second, again, later}) == 4, (first, second, again, later)
        assert len([c for c in svc.list_checkpoints("life") if c["kind"] == "state"]) == 4
        svc.close()
    finally:
        stop_engine(home)
