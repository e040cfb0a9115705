"""keys.json under concurrent writers: `sess engine keys add` processes started together each keep
their key (a lock around the read-modify-write, a temp file renamed into place), and every printed
key authenticates against a running engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore

WRITERS, TRIALS = 6, 3


def add_keys_at_once(home) -> list[str]:
    command = [str(Path(sys.executable).parent / "sess"), "engine", "keys", "add", "--home", str(home)]
    procs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(WRITERS)
    ]
    keys = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        keys.append(out.strip().splitlines()[-1])
    return keys


def test_concurrent_key_adds_keep_every_key(tmp_path):
    home = tmp_path / "home"
    info = start_engine(home)
    try:
        printed = []
        for _ in range(TRIALS):
            printed += add_keys_at_once(home)
        store = KeyStore(home)
        assert len(set(printed)) == WRITERS * TRIALS
        assert all(store.entry(key) is not None for key in printed)
        assert len(store.load()) == WRITERS * TRIALS + 1  # and the home's own key
        assert not list(home.glob(".keys.json.*")), "a temp file was left behind"
        for key in printed:  # the running engine takes each one
            answer = httpx.post(
                f"{info['url']}/api/call",
                json={"name": "list_sessions"},
                headers={"authorization": f"Bearer {key}"},
            )
            assert answer.status_code == 200, answer.text
    finally:
        stop_engine(home)
