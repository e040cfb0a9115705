"""The seed loop of API.md, run as a user writes it (only the model name and sizes differ)."""

from __future__ import annotations

import seed_loop

from sess.engine import SessionStatus


def test_seed_loop_runs_as_written(monkeypatch, sess_home):
    monkeypatch.setenv("SESS_ENGINE_URL", "inproc")
    svc = seed_loop.run("gsm8k-grpo")
    [summary] = svc.list_sessions(name_contains="gsm8k-grpo")
    assert summary.status == SessionStatus.Stopped and summary.step == seed_loop.NUM_STEPS
    kinds = sorted({c["kind"] for c in svc.list_checkpoints("gsm8k-grpo")})
    assert kinds == ["merged", "state"]  # the loop's samplers were transient: gone with the session
    assert summary.usage.sampled_tokens > 0 and summary.usage.training_tokens > 0
    svc.delete_session("gsm8k-grpo")
