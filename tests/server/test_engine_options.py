"""The engine's options, defined once (:class:`sess.engine.server.options.EngineOptions`): ``sess engine up``
and ``python -m sess.engine.server`` take the same flags with the same defaults, a command line carries
them to an engine process unchanged, and one check refuses what neither may start with."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine.server.options import EngineOptions
from sess.engine.server.serve import main as server_main

runner = CliRunner()


def test_every_option_is_a_flag_of_both_commands_with_its_help():
    """`sess engine up --help` shows every field's flag and the start of its help; the module's
    parser has the same flags and defaults."""
    shown = " ".join(runner.invoke(app, ["engine", "up", "--help"], terminal_width=200).output.split())
    shown = re.sub(r"[│╭╮╰╯─]", " ", shown)
    shown = " ".join(shown.split())
    parser = EngineOptions.parser("python -m sess.engine.server", "")
    module = {a.dest: a for a in parser._actions if a.dest != "help"}
    for f in dataclasses.fields(EngineOptions):
        flag = EngineOptions.flag(f.name)
        assert flag in shown, flag
        assert " ".join(f.metadata["help"].split()[:4]) in shown, f.name
        assert module[f.name].option_strings == [flag] and module[f.name].default == f.default


def test_a_command_line_carries_the_options_unchanged(tmp_path):
    prices = tmp_path / "prices.yaml"
    given = EngineOptions(
        home=str(tmp_path),
        port=18123,
        idle_timeout=30.5,
        max_sessions=3,
        dtype="bfloat16",
        memory_budget="1G",
        prices=str(prices),
        queue="arrival",
        nnodes=2,
        node_rank=1,
        master="10.0.0.1:29500",
    )
    line = given.argv()
    assert "--max-queued" not in line and "--device" not in line  # at their defaults: not written
    back = EngineOptions.parse(line, "python -m sess.engine.server", "")
    assert back == dataclasses.replace(given, prices=str(prices.resolve()))
    assert EngineOptions.parse([], "python -m sess.engine.server", "") == EngineOptions()
    assert given.argv(only=("nnodes", "node_rank")) == ["--nnodes", "2", "--node-rank", "1"]


@pytest.mark.parametrize(
    "option, message",
    [
        (["--queue", "lifo"], "--queue: expected fair or arrival, got 'lifo'"),
        (["--device", "tpu"], "--device: expected cpu or cuda, got 'tpu'"),
        (["--max-queued", "0"], "--max-queued: expected at least 1 queued op per key, got 0"),
        (["--nnodes", "2"], "--master: --nnodes 2 needs the address of node 0"),
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
    ],
)
def test_both_commands_refuse_with_the_same_line(tmp_path, option, message):
    result = runner.invoke(app, ["engine", "up", "--detach", "--home", str(tmp_path), *option])
    assert result.exit_code == 1 and message in " ".join(result.output.split()), result.output
    with pytest.raises(SystemExit, match="^" + re.escape(f"sess engine: {message}")):
        server_main(["--home", str(tmp_path), *option])
    assert not (Path(tmp_path) / "engine.json").exists()
