"""A machine that only drives a remote engine installs the client without torch or peft, and the
seed loop of API.md runs there against an engine process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from sess.engine.protocol.home import read_local_key

ROOT = Path(__file__).resolve().parents[2]


def test_the_seed_loop_runs_from_a_client_only_install(tmp_path, http_engine, sess_home):
    source = tmp_path / "src"  # pip builds in the source tree: a copy keeps the work tree clean
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".*", "runs", "build", "*.egg-info", "__pycache__")
    )
    venv = tmp_path / "client"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", str(source)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    python = str(venv / "bin" / "python")
    missing = "import importlib.util as u; print([m for m in ('torch', 'peft', 'fastapi') if u.find_spec(m)])"
    assert subprocess.run([python, "-c", missing], capture_output=True, text=True).stdout.strip() == "[]"
    env = {
        **os.environ,
        "SESS_ENGINE_URL": http_engine["url"],
        "SESS_API_KEY": read_local_key(sess_home),
        "SESS_HOME": str(tmp_path / "client-home"),  # the client's own home: nothing shared with the engine
    }
    out = subprocess.run(
        [python, str(ROOT / "tests" / "seed_loop.py"), "client-only-grpo"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["torch"] is False
    assert result["status"] == "Stopped" and result["step"] == 3
    assert result["kinds"] == ["merged", "state"]  # the loop's samplers were transient: gone with the session
    assert result["sampled_tokens"] > 0 and result["training_tokens"] > 0
