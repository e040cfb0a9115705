"""One engine over two "hosts" (two launchers on this machine, one rank each, one shared home)
against one rank: the same training and sampling; a host that never joins; a host that dies; bad
--nnodes/--node-rank/--master refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import AdamParams, SamplingParams, ServiceClient
from sess.engine.sdk.local_engine import engine_info, start_engine, stop_engine

from helpers import SENTENCES, ce_datum, free_port, process_alive

ADAM = AdamParams(learning_rate=2e-3, weight_decay=0.01, grad_clip_norm=1.0)
PROMPT = "Two plus three"
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # two engines' ranks on two shared cores


def _node_args(rank: int, port: int, join_timeout: float = 120) -> list[str]:
    return [
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--master",
        f"127.0.0.1:{port}",
        "--join-timeout",
        str(join_timeout),
    ]


def _server(home, *args: str) -> list[str]:
    return [sys.executable, "-m", "sess.engine.server", "--home", str(home), *args]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "0"], "--nnodes: expected 1 or more hosts, got 0"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:29500"],
            "--node-rank: expected 0 to 1",
        ),
        (
            ["--nnodes", "2", "--node-rank", "-1", "--master", "127.0.0.1:29500"],
            "--node-rank: expected 0 to 1",
        ),
        (["--nnodes", "2", "--master", "node0"], "--master: expected HOST:PORT"),
        (["--nnodes", "2", "--master", "node0:99999"], "--master: expected HOST:PORT"),
        (["--nnodes", "2"], "--master: --nnodes 2 needs the address of node 0"),
        (["--master", "node0:29500"], "--master: only for an engine of several hosts"),
        (
            ["--nnodes", "2", "--master", "node0:29500", "--join-timeout", "0"],
            "--join-timeout: expected a positive",
        ),
    ],
)
def test_bad_host_options_are_refused_before_anything_starts(tmp_path, args, message):
    result = CliRunner().invoke(app, ["engine", "up", "--home", str(tmp_path), *args])
    assert result.exit_code != 0
    assert message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "engine.json").exists() and not (tmp_path / "registry.db").exists()


def test_bad_host_options_are_refused_by_the_server_command(tmp_path):
    done = subprocess.run(
        _server(tmp_path, "--nnodes", "3", "--node-rank", "3", "--master", "127.0.0.1:29500"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "sess engine: --node-rank: expected 0 to 2 (--nnodes 3), got 3" in done.stderr
    assert not (tmp_path / "engine.json").exists()


def test_a_host_that_never_joins_times_out_naming_it(tmp_path):
    port = free_port()
    started = time.monotonic()
    node0 = subprocess.run(
        _server(tmp_path, *_node_args(0, port, join_timeout=3)), capture_output=True, text=True, timeout=120
    )
    assert node0.returncode == 1
    assert "node 1 of 2 did not join within 3 s (--join-timeout)" in node0.stderr, node0.stderr
    assert f"--node-rank 1 --master 127.0.0.1:{port}" in node0.stderr
    # and node 1 with no node 0 to meet
    node1 = subprocess.run(
        _server(tmp_path, *_node_args(1, port, join_timeout=3)), capture_output=True, text=True, timeout=120
    )
    assert node1.returncode == 1
    assert f"node 0 of 2 (--master 127.0.0.1:{port}) did not answer within 3 s" in node1.stderr, node1.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "engine.json").exists()


def _phase(url: str, home, tag: str) -> dict:
    """Two steps on uneven batches (the second leaves rank 1 without a datum), a live sample and
    ``compute_logprobs`` after each, a saved sampler's samples, and a state saved."""
    svc = ServiceClient(url, home=home)
    try:
        tc = svc.create_lora_training_client(
            "tiny-llama", rank=4, seed=5, training_session_name=f"nodes-{tag}"
        )
        tok = tc.get_tokenizer()
        data = [ce_datum(tok.encode(s)) for s in SENTENCES]
        prompt = tok.encode(PROMPT)
        record: dict = {"numbers": [], "tokens": [], "logprobs": []}
        for batch in (data[:5], data[3:4]):
            loss = tc.forward_backward(batch).result().metrics["loss:sum"]
            record["numbers"] += [loss, tc.optim_step(ADAM).result().metrics["grad_norm"]]
            live = tc.create_sampling_client()
            params = SamplingParams(max_tokens=10, temperature=1.0, seed=29)
            for seq in live.sample(prompt, num_samples=3, sampling_params=params).result().sequences:
                record["tokens"].append(seq.tokens)
                record["logprobs"].append(seq.logprobs)
            record["logprobs"].append(live.compute_logprobs(prompt).result()[1:])
        # requests sent together: rank 0 hands some to node 1's rank, which decodes them there
        futures = [
            live.sample(p, num_samples=2, sampling_params=SamplingParams(max_tokens=8, seed=50 + i))
            for i, p in enumerate(tok.encode(s) for s in SENTENCES[:4])
        ]
        for future in futures:
            for seq in future.result().sequences:
                record["tokens"].append(seq.tokens)
                record["logprobs"].append(seq.logprobs)
        sampler = tc.save_weights_and_get_sampling_client(name="sampler")
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=17)
        for seq in sampler.sample(prompt, num_samples=3, sampling_params=params).result().sequences:
            record["tokens"].append(seq.tokens)
            record["logprobs"].append(seq.logprobs)
        record["state"] = tc.save_state(name="state").result().path
        record["forward"] = [o["logprobs"].tolist() for o in tc.forward(data).result().loss_fn_outputs]
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as response:
            record["spread"] = json.loads(response.read()).get("sampling_ranks")
        return record
    finally:
        svc.close()


def _max_diff(a, b) -> float:
    if isinstance(a, list | tuple):
        assert len(a) == len(b)
        return max((_max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return abs(float(a) - float(b)) / max(1.0, abs(float(a)))


@pytest.mark.slow
def test_two_hosts_train_and_sample_like_one_rank_and_a_dead_host_interrupts(tmp_path, monkeypatch):
    """Node 1 and node 0 each started as `sess engine up --nnodes 2` would (one rank each, the same
    home); a session trains and samples; node 1 (its agent and rank) is killed as a host dies; node
    0 stops naming it, the session is Interrupted; one rank resumes it, and one rank's run of the
    same session gives the same numbers."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen(
            _server(home, *_node_args(1, port)),
            stdout=log,
            stderr=log,
            start_new_session=True,
            env=ONE_THREAD,
        )
    try:
        two = start_engine(home, extra_args=_node_args(0, port))
        try:
            assert len(two["rank_pids"]) == 2
            double = _phase(two["url"], home, "two")
            assert all(rows > 0 for rows in double["spread"]["rows_decoded"]), double["spread"]
            os.killpg(node1.pid, signal.SIGKILL)  # the host's agent and its rank
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and process_alive(two["pid"]):
                time.sleep(0.2)
            assert not process_alive(two["pid"]), "node 0 kept serving without node 1"
        finally:
            if process_alive(two["pid"]):
                stop_engine(home)
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()
    stopped = [
        line for line in (home / "engine.log").read_text().splitlines() if line.startswith("sess engine: ")
    ]
    assert len(stopped) == 1, stopped
    assert "node 1 of 2 (host " in stopped[0] and "stopped answering" in stopped[0], stopped
    assert "nodes-two" in stopped[0].split("Sessions now Interrupted: ")[1]
    with sqlite3.connect(home / "registry.db") as db:
        assert db.execute("SELECT status FROM sessions WHERE name='nodes-two'").fetchone() == ("Interrupted",)
    assert engine_info(home) is None

    one = start_engine(home)
    try:
        svc = ServiceClient(one["url"], home=home)
        try:  # resumable: its saved state loads on one rank, to the same logprobs
            resumed = svc.create_training_client_from_state(double["state"])
            data = [ce_datum(resumed.get_tokenizer().encode(s)) for s in SENTENCES]
            forward = [o["logprobs"].tolist() for o in resumed.forward(data).result().loss_fn_outputs]
            assert _max_diff(forward, double["forward"]) < 1e-5
        finally:
            svc.close()
        single = _phase(one["url"], home, "one")
    finally:
        stop_engine(home)
    assert _max_diff(single["numbers"], double["numbers"]) < 1e-5
    assert single["tokens"] == double["tokens"]
    assert len({tuple(t) for t in double["tokens"]}) > 1
    assert _max_diff(single["logprobs"], double["logprobs"]) < 1e-5
    assert _max_diff(single["forward"], double["forward"]) < 1e-5


def test_a_host_with_another_home_is_refused_naming_it(tmp_path):
    """Node 1 with a home of its own: it cannot read node 0's checkpoints, so it stops at start
    with a message naming its home, and node 0 stops naming node 1."""
    port = free_port()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen(
            _server(tmp_path / "b", *_node_args(1, port, join_timeout=60)),
            stdout=log,
            stderr=log,
            env=ONE_THREAD,
        )
    try:
        node0 = subprocess.run(
            _server(tmp_path / "a", *_node_args(0, port, join_timeout=60)),
            capture_output=True,
            text=True,
            timeout=240,
            env=ONE_THREAD,
        )
        node1.wait(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert node0.returncode == 1
    assert "node 1 of 2 (host " in node0.stderr, node0.stderr
    assert (
        f"--home {tmp_path / 'b'} on this host is not rank 0's home" in (tmp_path / "node1.log").read_text()
    )
