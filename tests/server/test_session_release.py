"""Sessions whose client is gone stop holding their key's session limit: a session whose client
heart-beat and then fell silent for the heartbeat lapse (``SESS_HEARTBEAT_LAPSE_S``) is saved and
stopped, long before the idle timeout; it resumes from that state and its usage is counted once.
A client that keeps heart-beating keeps its session however long it sends nothing else."""

from __future__ import annotations

import time

import pytest

from sess.engine import AdamParams, ServiceClient
from sess.engine.sdk.local_engine import start_engine, stop_engine

from helpers import SENTENCES, ce_datum

LAPSE_S = 1.5


@pytest.fixture()
def engine(tmp_path, monkeypatch):
    """An engine with a 1.5 s heartbeat lapse, the default 600 s idle timeout, one live session a key."""
    monkeypatch.setenv("SESS_HEARTBEAT_LAPSE_S", str(LAPSE_S))
    home = tmp_path / "home"
    info = start_engine(home, extra_args=["--max-sessions", "1"])
    yield info["url"], home
    stop_engine(home)


def _status(svc: ServiceClient, name: str, want: str, within: float) -> float:
    """Seconds until session ``name`` is ``want`` (fails after ``within``)."""
    start = time.monotonic()
    while (status := svc.list_sessions(name_contains=name)[0].status.value) != want:
        assert time.monotonic() - start < within, f"{name} still {status} after {within} s"
        time.sleep(0.2)
    return time.monotonic() - start


def test_silent_client_releases_its_session_resumable_and_counted_once(engine):
    url, home = engine
    gone = ServiceClient(url, home=home)
    tc = gone.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="gone")
    tokens = tc.get_tokenizer().encode(SENTENCES[0])
    fb = tc.forward_backward([ce_datum(tokens)]).result()
    tc.optim_step(AdamParams(learning_rate=1e-2)).result()
    gone.close()  # its heartbeats stop, as when its process exits
    with ServiceClient(url, home=home) as svc:
        waited = _status(svc, "gone", "Stopped", within=15)
        assert waited < 10 * LAPSE_S
        states = svc.list_checkpoints("gone")
        assert [c["kind"] for c in states] == ["state"]
        # the key's one session is free again, and a live client's session outlives the lapse
        live = svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="live")
        time.sleep(3 * LAPSE_S)
        assert svc.list_sessions(name_contains="live")[0].status.value == "Running"
        live.stop()
        # resumed from the state saved at release: the same step, the same loss after it
        again = svc.create_training_client_from_state_with_optimizer(
            states[0]["path"], training_session_name="gone"
        )
        assert svc.list_sessions(name_contains="gone")[0].step == 1
        after = again.forward([ce_datum(tokens)]).result()
        assert after.metrics["loss:sum"] < fb.metrics["loss:sum"]
        again.stop()
        # usage: each op once, the release's save adds no tokens
        usage = svc.get_usage("gone")
        assert usage.training_tokens == 2 * (len(tokens) - 1)
        rows = svc.transport.usage("gone", by="operation")["rows"]
        assert sum(r["training_tokens"] for r in rows.values()) == usage.training_tokens
        by_session = svc.transport.usage(by="session")["rows"]
        assert by_session["gone"]["training_tokens"] == usage.training_tokens
