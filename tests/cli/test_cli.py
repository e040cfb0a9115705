"""CLI lifecycle: engine up/status/down, start, list, stop, resume, usage, checkpoints; usage numbers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import SamplingParams, ServiceClient
from sess.engine.protocol.errors import SessError
from sess.engine.sdk.local_engine import engine_info, start_engine
from sess.engine.server.options import EngineOptions
from sess.engine.server.serve import main as server_main
from sess.engine.server.serve import serve

from helpers import SENTENCES, ce_datum

runner = CliRunner()


@pytest.fixture(scope="module")
def env(http_engine, sess_home):
    return {"SESS_HOME": str(sess_home), "SESS_ENGINE_URL": http_engine["url"]}


def sess(env, *args):
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == 0, (args, result.output, result.exception)
    return result.output


CLI = [sys.executable, "-c", "from sess.cli.main import main; main()"]


def test_engine_up_status_down(tmp_path):
    home = str(tmp_path / "home")
    assert runner.invoke(app, ["engine", "status", "--home", home]).exit_code == 1
    # two at once: the second waits on the start lock and finds the first's engine, no second one
    both = [subprocess.Popen([*CLI, "engine", "up", "--detach", "--home", home], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]  # fmt: skip
    outputs = [p.communicate(timeout=180)[0] for p in both]
    assert [p.returncode for p in both] == [0, 0], outputs
    info = engine_info(home)
    assert info is not None and all(f"(pid {info['pid']}" in o for o in outputs), outputs
    assert sum("already running" in o for o in outputs) == 1
    output = outputs[0]
    assert info["url"] in output
    assert info["url"] in sess({}, "engine", "status", "--home", home)
    assert json.loads(sess({}, "engine", "status", "--home", home, "--json"))["pid"] == info["pid"]
    assert "already running" in sess({}, "engine", "up", "--detach", "--home", home)
    assert "stopped" in sess({}, "engine", "down", "--home", home)
    assert engine_info(home) is None
    down_again = runner.invoke(app, ["engine", "down", "--home", home])  # what was asked holds: exit 0
    assert (
        down_again.exit_code == 0 and f"no engine is running for {home}; nothing to stop" in down_again.output
    )
    # a command that starts the local engine says so: it outlives the command
    unknown = subprocess.run(
        [*CLI, "delete", "no-such", "-y"],
        env={**os.environ, "SESS_HOME": home},
        capture_output=True,
        text=True,
    )
    info = engine_info(home)
    try:
        assert unknown.returncode == 1 and "no session 'no-such'" in unknown.stderr
        assert f"started the local engine at {info['url']} (pid {info['pid']}" in unknown.stderr
        assert "sess engine down" in unknown.stderr
    finally:
        sess({}, "engine", "down", "--home", home)


def test_engine_up_with_other_options_than_the_running_engine_fails(env, http_engine):
    home = ["--home", env["SESS_HOME"]]
    port = str(http_engine["port"])
    assert "already running" in sess({}, "engine", "up", "--detach", *home)
    assert "already running" in sess(
        {}, "engine", "up", "--detach", *home, "--port", port, "--idle-timeout", "600"
    )
    other = runner.invoke(
        app, ["engine", "up", "--detach", *home, "--port", "18999", "--memory-budget", "1K"]
    )
    assert other.exit_code == 1, other.output
    assert (
        f"--port {port} (asked 18999)" in other.output
        and "--memory-budget not set (asked 1K)" in other.output
    )
    assert "--idle-timeout" not in other.output  # left at its default: not compared


def test_a_busy_port_is_one_line(tmp_path, http_engine):
    port = http_engine["port"]
    for detach in ([], ["--detach"]):
        result = runner.invoke(app, ["engine", "up", "--home", str(tmp_path), "--port", str(port), *detach])
        assert result.exit_code == 1 and f"port {port} on 127.0.0.1 is in use" in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    with pytest.raises(SystemExit, match=f"^sess engine: port {port} on 127.0.0.1 is in use"):
        serve(EngineOptions(home=str(tmp_path), port=port))
    with pytest.raises(SessError, match=f"^the engine refused to start: port {port} on 127.0.0.1 is in use"):
        start_engine(tmp_path, port=port)  # what --detach reports should the port be taken after its check


@pytest.mark.parametrize(
    "option, message",
    [
        (["--port", "99999"], "--port: expected 1 to 65535 (or 0: any free port), got 99999"),
        (["--max-sessions", "0"], "--max-sessions: expected at least 1"),
        (["--idle-timeout", "-5"], "--idle-timeout: expected a positive number of seconds, got -5.0"),
        (["--idle-timeout", "nan"], "--idle-timeout: expected a positive number of seconds, got nan"),
        (["--idle-timeout", "inf"], "--idle-timeout: expected a positive number of seconds, got inf"),
    ],
)
def test_engine_options_out_of_range_are_refused(tmp_path, option, message):
    result = runner.invoke(app, ["engine", "up", "--detach", "--home", str(tmp_path), *option])
    assert result.exit_code == 1 and message in result.output, result.output
    with pytest.raises(SystemExit, match="^" + re.escape(f"sess engine: {message}")):
        server_main(["--home", str(tmp_path), *option])
    assert engine_info(tmp_path) is None


def test_a_bad_tls_pair_is_one_line_naming_the_files(tmp_path):
    not_pem = tmp_path / "hostname"
    not_pem.write_text("box\n")
    result = runner.invoke(
        app,
        [
            "engine",
            "up",
            "--detach",
            "--home",
            str(tmp_path),
            "--tls-cert",
            str(not_pem),
            "--tls-key",
            str(not_pem),
        ],
    )
    assert result.exit_code == 1 and f"--tls-cert {not_pem} / --tls-key {not_pem}: not a PEM" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_session_command_inputs_are_checked_up_front(env, tmp_path):
    other = runner.invoke(app, ["resume", "cli-a", "--checkpoint", "sess://cli-b/state/s1"], env=env)
    assert other.exit_code == 1 and "is a checkpoint of session 'cli-b', not of 'cli-a'" in other.output
    assert "sess resume cli-b --checkpoint sess://cli-b/state/s1" in other.output
    assert sess(env, "list", "--status", "running") is not None  # any case
    bad = runner.invoke(app, ["list", "--status", "going"], env=env)
    assert bad.exit_code == 1 and "--status: expected one of Starting, Running" in bad.output
    for command in (["list"], ["engine", "status"], ["engine", "keys", "list"]):
        assert "As JSON" in runner.invoke(app, [*command, "--help"]).output, command
    none = runner.invoke(app, ["engine", "keys", "list", "--home", str(tmp_path)])
    assert none.exit_code == 0 and "no keys in" in none.output
    refused = runner.invoke(app, ["engine", "keys", "add", "--max-sessions", "-1", "--home", str(tmp_path)])
    assert refused.exit_code == 1 and "--max-sessions: expected at least 1" in refused.output
    assert not (tmp_path / "keys.json").exists()


def test_public_host_without_keys_is_refused_and_keys_add(tmp_path):
    home = str(tmp_path / "open")
    result = runner.invoke(app, ["engine", "up", "--host", "0.0.0.0", "--home", home])
    assert result.exit_code == 1 and "without API keys" in result.output
    key = runner.invoke(app, ["engine", "keys", "add", "--owner", "alice", "--home", home]).stdout.strip()
    assert key.startswith("tml-")
    assert (tmp_path / "open" / "keys.json").stat().st_mode & 0o777 == 0o600


def test_start_list_stop_resume_checkpoints(env):
    output = sess(env, "start", "model=tiny-llama", "lora.rank=4", "seed=3", "--name", "cli-one")
    assert "cli-one" in output and "rank 4" in output
    svc = ServiceClient(env["SESS_ENGINE_URL"], home=env["SESS_HOME"])
    tc = svc.get_training_client("cli-one")
    tc.forward_backward([ce_datum(tc.get_tokenizer().encode(SENTENCES[0]))])
    tc.optim_step()
    state = tc.save_state(name="s1").result().path
    listed = sess(env, "list")
    assert "cli-one" in listed and "tiny-llama" in listed and "Running" in listed
    listing = sess(env, "checkpoints", "cli-one")
    assert state in listing and "total" in listing
    assert "Stopped" in sess(env, "stop", "cli-one")
    assert "cli-one-b" in sess(env, "resume", "cli-one", "--name", "cli-one-b")
    assert svc.list_sessions(name_contains="cli-one-b")[0].step == 1
    assert "cli-one-c" in sess(env, "resume", "cli-one", "--checkpoint", state, "--name", "cli-one-c")
    bad = runner.invoke(app, ["start", "model=tiny-llama", "lora.rank=0"], env=env)
    assert bad.exit_code != 0 and "rank" in str(bad.exception or bad.output)
    for name in ("cli-one-b", "cli-one-c"):
        svc.stop_session(name)
    declined = runner.invoke(app, ["delete", "cli-one-c"], env=env, input="y\n")  # no terminal: no question
    assert (
        declined.exit_code == 1
        and "stdin is not a terminal" in declined.output
        and "--yes" in declined.output
    )
    assert "[y/N]" not in declined.output
    assert svc.list_sessions(name_contains="cli-one-c")
    # its stop above saved the step it was resumed at (a stop keeps the training: stop-step<N>-<k>)
    assert "deleted with 1 checkpoint(s)" in sess(env, "delete", "cli-one-c", "--yes")
    assert not svc.list_sessions(name_contains="cli-one-c")
    unknown = runner.invoke(app, ["delete", "no-such-session", "--yes"], env=env)
    assert unknown.exit_code == 1 and "no session 'no-such-session'" in unknown.output
    svc.close()


def test_start_composes_like_sess_run(env):
    """`sess start` goes through the Hydra composition of `sess run`: engine=remote engine.url=...,
    lora.* as short for model.lora.*, key checks that name the key."""
    url = env["SESS_ENGINE_URL"]
    home_only = {"SESS_HOME": env["SESS_HOME"]}
    output = sess(
        home_only, "start", "model=tiny-llama", "lora.rank=8", "seed=1", "engine=remote", f"engine.url={url}",
        "--name", "cli-remote",
    )  # fmt: skip
    assert "cli-remote" in output and "rank 8" in output
    assert "rank 6" in sess(env, "start", "model=tiny-llama", "model.lora.rank=6", "--name", "cli-long")
    svc = ServiceClient(url, home=env["SESS_HOME"])
    assert {s.name for s in svc.list_sessions(status_equals="Running")} >= {"cli-remote", "cli-long"}
    typo = runner.invoke(app, ["start", "model=tiny-llama", "lora.rnak=8"], env=env)
    assert typo.exit_code != 0 and "lora.rnak" in str(typo.exception)
    missing = runner.invoke(
        app, ["start", "model=/no/such/model-dir", "--name", "cli-dir"], env=env
    )  # not an option
    assert missing.exit_code != 0 and "/no/such/model-dir" in str(missing.exception), missing.exception
    not_for_start = runner.invoke(app, ["start", "loop=sft"], env=env)
    assert not_for_start.exit_code == 1 and "sess start takes" in not_for_start.output
    assert "lora.rank=N" in runner.invoke(app, ["start", "--help"]).output
    for name in ("cli-remote", "cli-long"):
        svc.stop_session(name)
    svc.close()


def test_usage_counts_match_scripted_calls_and_cli(env):
    started = time.perf_counter()
    svc = ServiceClient(env["SESS_ENGINE_URL"], home=env["SESS_HOME"])
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="usage-check")
    tok = tc.get_tokenizer()
    sc = tc.create_sampling_client()
    prefill = sampled = training = 0
    prompts = [(tok.encode(text), n) for text, n in [("one two", 3), ("three four five", 2)]]
    futures = [
        sc.sample(p, num_samples=n, sampling_params=SamplingParams(max_tokens=6, seed=1)) for p, n in prompts
    ]
    for (prompt, _), future in zip(prompts, futures):  # both in flight together: one decode batch
        prefill += len(prompt)  # once per prompt, not per sample
        sampled += sum(len(s.tokens) for s in future.result().sequences)
    data = [ce_datum(tok.encode(s)) for s in SENTENCES[:3]]
    tc.forward(data).result()
    tc.forward_backward(data).result()
    training += 2 * sum(d.model_input.length for d in data)
    logprob_prompt = tok.encode("six seven")
    sc.compute_logprobs(logprob_prompt).result()
    prefill += len(logprob_prompt)

    usage = svc.get_usage("usage-check")
    assert (usage.prefill_tokens, usage.sampled_tokens, usage.training_tokens) == (prefill, sampled, training)
    report = json.loads(sess(env, "usage", "usage-check", "--json"))
    assert report["usage"]["prefill_tokens"] == prefill and report["usage"]["training_tokens"] == training
    ops = report["operations"]
    assert ops["sample"]["count"] == 2 and ops["sample"]["sampled_tokens"] == sampled
    assert ops["sample"]["prefill_tokens"] + ops["compute_logprobs"]["prefill_tokens"] == prefill
    assert ops["forward"]["training_tokens"] == ops["forward_backward"]["training_tokens"] == training // 2
    # every total is the sum of its rows; wall time is the engine's own time, sampling included
    for key in ("prefill_tokens", "sampled_tokens", "training_tokens", "wall_time_s"):
        assert sum(row[key] for row in ops.values()) == pytest.approx(report["usage"][key], abs=1e-6), key
    assert sum(row["count"] for row in ops.values()) == report["usage"]["operations"]
    assert ops["sample"]["wall_time_s"] > 0 and report["usage"]["wall_time_s"] < time.perf_counter() - started
    [row] = [s for s in json.loads(sess(env, "list", "--json")) if s["name"] == "usage-check"]
    assert row["usage"]["sampled_tokens"] == sampled
    table = sess(env, "list")
    line = next(line for line in table.splitlines() if "usage-check" in line)
    assert str(prefill + sampled + training) in line
    assert "sample" in sess(env, "usage", "usage-check")
    tc.stop()
    svc.close()


def test_errors_are_one_red_line_and_debug_shows_traceback(env):
    code = "from sess.cli.main import main; main()"
    full_env = {**os.environ, **env}
    quiet = subprocess.run(
        [sys.executable, "-c", code, "usage", "no-such-session"], env=full_env, capture_output=True, text=True
    )  # the engine's own error
    assert quiet.returncode == 1 and "no-such-session" in quiet.stderr and "Traceback" not in quiet.stderr
    assert len(quiet.stderr.strip().splitlines()) == 1
    loud = subprocess.run(
        [sys.executable, "-c", code, "--debug", "usage", "no-such-session"],
        env=full_env,
        capture_output=True,
        text=True,
    )
    assert loud.returncode != 0 and "Traceback" in loud.stderr
