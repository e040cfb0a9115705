"""`sess attach NAME`: a REPL bound to a live session, driven through stdin."""

from __future__ import annotations

from typer.testing import CliRunner

from sess.cli.main import app


def test_attach_runs_forward_backward_on_the_live_session(svc):
    NAME = "attach-inproc" if svc.url == "inproc" else "attach-http"
    tc = svc.create_lora_training_client("tiny-llama", rank=4, alpha=8, seed=0, training_session_name=NAME)
    name = NAME
    try:
        script = (
            "out = tc.forward_backward([tok.encode('two plus two is four')]).result()\n"
            "print('LOSS', round(out.metrics['loss:sum'], 4))\n"
            "print('SAMPLED', len(sc.sample(tok.encode('hi'), 1, SamplingParams(max_tokens=3, seed=1)).result().sequences))\n"
        )
        result = CliRunner().invoke(app, ["attach", name, "--url", svc.url], input=script)
        assert result.exit_code == 0, result.output + repr(result.exception)
        assert f"sess attach: session {name} on tiny-llama" in result.output
        loss_line = next(line for line in result.output.splitlines() if "LOSS" in line)
        assert float(loss_line.split("LOSS")[1]) > 0
        assert "SAMPLED 1" in result.output
        assert tc.current_sequence_number == 0  # attach used its own client; the session saw the op
        assert svc.get_usage(name).training_tokens > 0
    finally:
        tc.stop()


def test_attach_to_a_missing_session_is_one_line(svc):
    result = CliRunner().invoke(app, ["attach", "no-such-session", "--url", svc.url])
    assert result.exit_code == 1 and "no-such-session" in result.output


def test_attach_to_a_malformed_url_names_the_option():
    result = CliRunner().invoke(app, ["attach", "s1", "--url", "garbage"])
    assert (
        result.exit_code == 1 and result.output.startswith("error: --url:") and "'garbage'" in result.output
    )
