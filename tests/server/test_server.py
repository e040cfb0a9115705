"""The engine server: op dedupe, keys, bad HTTP input, restart + resume, idle timeout, session limit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from sess.engine import AdamParams, InvalidRequest, NotFound, ServiceClient, SessError
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore

from helpers import SENTENCES, ce_datum


@pytest.fixture(scope="module")
def http(http_engine, sess_home):
    client = ServiceClient(http_engine["url"], home=sess_home)
    yield client
    client.close()


def _ops(tc):
    seq = tc.reserve_sequence_number()
    return seq


def test_resubmitted_token_returns_first_result_and_steps_once(svc):
    with svc.create_lora_training_client("tiny-llama", rank=4, seed=0) as tc:
        data = [ce_datum(tc.get_tokenizer().encode(s)) for s in SENTENCES[:2]]
        tc.forward_backward(data).result()
        transport, seq = svc.transport, _ops(tc)
        args = {"adam_params": AdamParams(learning_rate=1e-2).to_wire()}
        first = transport.submit("optim_step", args, session=tc.name, seq=seq, client_token="tok-1")
        done, result = transport.wait(first, 30)
        again = transport.submit("optim_step", args, session=tc.name, seq=seq, client_token="tok-1")
        assert again == first and transport.wait(again, 30) == (done, result)
        assert result["metrics"]["step"] == 1
        assert svc.list_sessions(name_contains=tc.name)[0].step == 1
        # the same sequence number under a new token is refused, not run
        with pytest.raises(InvalidRequest, match="already used"):
            transport.submit("optim_step", args, session=tc.name, seq=seq, client_token="tok-2")
        assert tc.optim_step().result().metrics["step"] == 2


def test_keys_scope_sessions_and_checkpoints(http, http_engine, sess_home, tmp_path):
    url = http_engine["url"]
    assert httpx.post(f"{url}/api/call", json={"name": "list_sessions"}).status_code == 401
    bad = httpx.post(
        f"{url}/api/call", json={"name": "list_sessions"}, headers={"authorization": "Bearer nope"}
    )
    assert bad.status_code == 401 and "api key" in bad.json()["error"]["message"]

    key_b = KeyStore(sess_home).add("owner-b")["key"]
    b = ServiceClient(url, api_key=key_b)
    with http.create_lora_training_client("tiny-llama", rank=4, seed=0) as tc:
        state = tc.save_state(name="a-state").result().path
        weights = tc.save_weights_for_sampler(name="a-weights").result().path
        assert tc.name not in [s.name for s in b.list_sessions()]
        with pytest.raises(NotFound):
            b.get_training_client(tc.name)
        with pytest.raises(NotFound):
            b.create_sampling_client(model_path=weights)
        with pytest.raises(NotFound):
            b.stop_session(tc.name)
        with pytest.raises(NotFound):
            b.create_training_client_from_state(state)
        with pytest.raises(NotFound):
            b.download_checkpoint(state, tmp_path / "stolen")
        with pytest.raises(NotFound):
            b.list_checkpoints(tc.name)
        op = b.transport.submit("sample", {"target": {"session": tc.name}, "prompt": [1, 2, 3]})
        with pytest.raises(NotFound):
            b.transport.wait(op, 10)
        with pytest.raises(NotFound):
            b.transport.submit(
                "forward_backward", {"data": [ce_datum([1, 2, 3]).to_wire()]}, session=tc.name, seq=9
            )
        # A's session is untouched and still trains
        assert tc.forward_backward([ce_datum([1, 2, 3, 4])]).result().metrics["loss:sum"] > 0
    b.close()


def test_bad_http_input_gets_4xx_and_engine_keeps_serving(http, http_engine, sess_home):
    url, key = http_engine["url"], http.transport.api_key
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    with http.create_lora_training_client("tiny-llama", rank=4, seed=0) as tc:
        good = tc.get_tokenizer().encode("one two three")
        cases = [
            (b"{not json", 400, "malformed JSON"),
            (b"[1, 2]", 400, "JSON object"),
            (json.dumps({"name": 5, "args": {}}).encode(), 400, "name"),
            (json.dumps({"name": "forward", "args": [], "session": tc.name, "seq": 1}).encode(), 400, "args"),
            (
                json.dumps({"name": "forward", "args": {}, "session": tc.name, "seq": "x"}).encode(),
                400,
                "seq",
            ),
            (json.dumps({"name": "forward", "args": {}, "session": 3, "seq": 1}).encode(), 400, "session"),
        ]
        for body, status, words in cases:
            response = httpx.post(f"{url}/api/submit", content=body, headers=auth)
            assert response.status_code == status, (body, response.text)
            assert words in response.json()["error"]["message"]
        call = httpx.post(
            f"{url}/api/call", json={"name": "session_info", "args": {"name": "nobody"}}, headers=auth
        )
        assert call.status_code == 404 and "nobody" in call.json()["error"]["message"]
        wait = httpx.post(f"{url}/api/wait", json={"op_id": "nope"}, headers=auth)
        assert wait.status_code == 404
        assert httpx.get(f"{url}/api/nothing-here", headers=auth).status_code == 404
        too_long = {"target": {"session": tc.name}, "prompt": good, "sampling_params": {"max_tokens": 10**6}}
        op = httpx.post(f"{url}/api/submit", json={"name": "sample", "args": too_long}, headers=auth).json()
        answer = httpx.post(f"{url}/api/wait", json={"op_id": op["op_id"]}, headers=auth)
        assert answer.status_code == 400 and "context" in answer.json()["error"]["message"]
        # the session keeps serving
        assert tc.forward_backward([ce_datum(good)]).result().metrics["loss:sum"] > 0
        assert len(tc.create_sampling_client().sample(good).result().sequences) == 1


@pytest.fixture()
def engine_home(tmp_path):
    home = tmp_path / "home"
    yield home
    stop_engine(home)


def _engine(home, *extra):
    return start_engine(home, extra_args=[str(e) for e in extra])


def test_oversized_body_is_413(engine_home):
    info = _engine(engine_home, "--max-body-bytes", 100_000)
    with ServiceClient(info["url"], home=engine_home) as svc:
        body = {"name": "list_sessions", "args": {"name_contains": "x" * 200_000}}
        response = httpx.post(
            f"{info['url']}/api/call", json=body, headers={"authorization": f"Bearer {svc.transport.api_key}"}
        )
        assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
        assert svc.list_sessions() == []


def test_kill9_restart_lists_interrupted_and_resume_continues_exactly(engine_home):
    from typer.testing import CliRunner

    from sess.cli.main import app

    info = _engine(engine_home)
    svc = ServiceClient(info["url"], home=engine_home)
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=5, training_session_name="before-crash")
    data = [ce_datum(tc.get_tokenizer().encode(s)) for s in SENTENCES]
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.1)
    for _ in range(2):
        tc.forward_backward(data)
        tc.optim_step(adam)
    state = tc.save_state(name="two-steps").result().path
    tc.forward_backward(data)
    tc.optim_step(adam)
    uninterrupted = tc.forward(data).result().metrics["loss:sum"]
    svc.close()

    os.kill(info["pid"], signal.SIGKILL)
    time.sleep(0.5)
    info = _engine(engine_home)
    svc = ServiceClient(info["url"], home=engine_home)
    [summary] = svc.list_sessions(name_contains="before-crash")
    assert summary.status.value == "Interrupted" and summary.step == 3
    assert state in [c["path"] for c in svc.list_checkpoints("before-crash")]

    env = {"SESS_HOME": str(engine_home), "SESS_ENGINE_URL": info["url"]}
    result = CliRunner().invoke(app, ["resume", "before-crash", "--name", "after-crash"], env=env)
    assert result.exit_code == 0, result.output
    assert "after-crash" in result.output and "step 2" in result.output
    resumed = svc.get_training_client("after-crash")
    resumed.forward_backward(data)
    assert resumed.optim_step(adam).result().metrics["step"] == 3
    assert abs(resumed.forward(data).result().metrics["loss:sum"] - uninterrupted) < 1e-6
    resumed.stop()
    svc.close()


def test_stop_and_engine_down_save_unsaved_training_and_resume_continues_exactly(engine_home):
    """A stop, and a one-rank engine's shutdown (sess engine down), first save the state of a
    session that trained since its last save_state, so sess resume continues it exactly; a session
    that saved its state at its current step is not saved again."""
    from typer.testing import CliRunner

    from sess.cli.main import app

    info = _engine(engine_home)
    svc = ServiceClient(info["url"], home=engine_home)
    make = svc.create_lora_training_client
    twin, stopped = (make("tiny-llama", rank=4, seed=5, training_session_name=n) for n in ("twin", "stopped"))
    down, saved = make("tiny-llama", rank=4, seed=6, training_session_name="down"), make("tiny-llama", rank=4)
    data = [ce_datum(twin.get_tokenizer().encode(s)) for s in SENTENCES]
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.1)
    for tc, steps in ((twin, 3), (stopped, 2), (down, 1), (saved, 1)):
        for _ in range(steps):
            tc.forward_backward(data)
            tc.optim_step(adam)
    expected = twin.forward(data).result().metrics["loss:sum"]  # the step the stopped one did not take
    kept = saved.save_state(name="kept").result().path

    assert svc.stop_session("stopped").status.value == "Stopped"
    assert [c["path"] for c in svc.list_checkpoints("stopped")] == [
        "sess://stopped/state/stop-step000002-001"
    ]
    saved.stop()
    assert [c["path"] for c in svc.list_checkpoints(saved.name)] == [kept]
    env = {"SESS_HOME": str(engine_home), "SESS_ENGINE_URL": info["url"]}
    result = CliRunner().invoke(app, ["resume", "stopped", "--name", "resumed"], env=env)
    assert result.exit_code == 0 and "step 2" in result.output, result.output
    resumed = svc.get_training_client("resumed")
    resumed.forward_backward(data)
    assert resumed.optim_step(adam).result().metrics["step"] == 3
    assert abs(resumed.forward(data).result().metrics["loss:sum"] - expected) < 1e-6
    svc.close()

    stop_engine(engine_home)  # SIGTERM, as sess engine down
    info = _engine(engine_home)
    with ServiceClient(info["url"], home=engine_home) as svc:
        status = {s.name: (s.status.value, s.step) for s in svc.list_sessions()}
        assert status["down"] == ("Interrupted", 1) and status["resumed"] == ("Interrupted", 3)
        assert [c["path"] for c in svc.list_checkpoints("down")] == [
            "sess://down/state/shutdown-step000001-001"
        ]
        assert [c["kind"] for c in svc.list_checkpoints("resumed")] == ["state"]
        assert [c["path"] for c in svc.list_checkpoints(saved.name)] == [kept]
        env["SESS_ENGINE_URL"] = info["url"]
        result = CliRunner().invoke(app, ["resume", "down"], env=env)
        assert result.exit_code == 0 and "step 1" in result.output, result.output


CLIENT = """
import sys, time
from sess.engine import ServiceClient
svc = ServiceClient(sys.argv[1])
tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="orphan")
tc.forward_backward([[1, 2, 3, 4]]).result()
print("ready", flush=True)
time.sleep(600)
"""


def test_idle_session_is_saved_and_stopped_and_session_limit(engine_home):
    info = _engine(engine_home, "--idle-timeout", 2, "--max-sessions", 2)
    env = {**os.environ, "SESS_HOME": str(engine_home)}
    child = subprocess.Popen(
        [sys.executable, "-c", CLIENT, info["url"]], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with ServiceClient(info["url"], home=engine_home) as svc:
            # a live client heart-beats: its session outlives the idle timeout
            mine = svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="mine")
            with pytest.raises(InvalidRequest, match="session limit.*limit 2"):
                svc.create_lora_training_client("tiny-llama", rank=4, training_session_name="one-too-many")
            child.kill()
            child.wait()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                status = {s.name: s.status.value for s in svc.list_sessions()}
                if status.get("orphan") == "Stopped":
                    break
                time.sleep(0.3)
            assert status == {"orphan": "Stopped", "mine": "Running"}
            kinds = [c["kind"] for c in svc.list_checkpoints("orphan")]
            assert kinds == ["state"]
            time.sleep(1.0)  # the limit counts live sessions only
            svc.create_lora_training_client("tiny-llama", rank=4, training_session_name="now-fits").stop()
            mine.forward_backward([[1, 2, 3]]).result()
            mine.stop()
    finally:
        child.kill()


def test_sdk_retries_transient_failures_but_not_4xx(monkeypatch, http):
    transport, calls = http.transport, []
    real = transport.client.request

    def flaky(method, path, **kw):
        calls.append(path)
        if len(calls) <= 2:
            raise httpx.ConnectError("connection refused")
        if len(calls) == 3:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return real(method, path, **kw)

    monkeypatch.setattr(transport.client, "request", flaky)
    assert isinstance(http.list_base_models(), list) and len(calls) == 4
    calls.clear()
    monkeypatch.setattr(transport.client, "request", lambda m, p, **kw: calls.append(p) or real(m, p, **kw))
    with pytest.raises(NotFound):
        http.get_training_client("no-such-session")
    assert len(calls) == 1


def test_engine_unreachable_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("sess.engine.sdk.http_transport.RETRY_DEADLINE_S", 0.3)
    with ServiceClient("http://127.0.0.1:9", api_key="x") as svc:
        with pytest.raises(SessError, match="cannot reach the engine"):
            svc.list_base_models()


def test_run_runs_on_the_executor_thread_and_no_client_can_reach_it(sess_home):
    import threading

    from sess.engine.protocol.errors import InvalidRequest
    from sess.engine.runtime.inprocess import shared_engine

    engine = shared_engine(sess_home)
    assert engine.run(lambda runtime: threading.current_thread().name) == "sess-executor"
    with pytest.raises(ZeroDivisionError):
        engine.run(lambda runtime: 1 / 0)
    assert engine.run(lambda runtime: 7) == 7  # the executor carries on
    with pytest.raises(InvalidRequest):
        engine.submit("local", "__local__", {"fn": "print"})
    with pytest.raises(InvalidRequest):
        engine.call("local", "__local__", {"fn": "print"})
