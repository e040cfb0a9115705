"""One ``ServiceClient`` shared by threads and by asyncio tasks, as rollout workers use it.

Each case runs in a fresh interpreter, where transformers is not yet imported: transformers resolves
its names lazily and two threads resolving ``AutoTokenizer`` at once fail with "cannot import name"
unless the SDK serialises the import (``service_client.load_tokenizer``). The race check is cheap
and repeated in fresh interpreters, over HTTP and in-process. The full workload (16 threads, then 16
tasks, each with its own session: tokenizer, forward_backward, optim_step, a probe forward,
forward_backward, optim_step, save_weights_and_get_sampling_client, sample) is slow-marked over both
transports: 32 sessions take ~2-4 minutes on 2 shared cores. Every future resolves without an error, and each session's ops
run in the order they were made: the probe forward sees exactly the first step's weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sess.engine.server.keys import KeyStore

SCRIPT = Path(__file__).parent / "sdk_scripts" / "shared_client.py"
N = 16

RACE = textwrap.dedent(
    """
    import json, sys, threading
    from sess.engine import ServiceClient

    svc = ServiceClient(sys.argv[1])
    barrier, errors = threading.Barrier(16), []

    def load():
        try:
            barrier.wait(60)
            svc.get_tokenizer("tiny-llama").encode("hello")
        except BaseException as exc:
            errors.append(repr(exc)[:300])

    threads = [threading.Thread(target=load) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    svc.close()
    print(json.dumps(errors))
    """
)


@pytest.fixture(scope="module")
def roomy_key(sess_home) -> str:
    """A key with room for both phases' 2 * N sessions (the local key's default limit is lower)."""
    return KeyStore(sess_home).add("threads", max_sessions=2 * N + 8)["key"]


def _fresh(args: list[str], key: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "SESS_API_KEY": key}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


@pytest.mark.parametrize("transport", ["http", "inproc"])
def test_sixteen_threads_loading_the_tokenizer_at_once_in_a_fresh_interpreter(transport, request, roomy_key):
    url = request.getfixturevalue("http_engine")["url"] if transport == "http" else "inproc"
    for _ in range(3 if transport == "http" else 1):  # without the lock, 2 to 15 of 16 fail each time
        errors = json.loads(_fresh(["-c", RACE, url], roomy_key, 300).stdout.splitlines()[-1])
        assert errors == []


def _check_workload(url: str, key: str, out: Path) -> None:
    _fresh([str(SCRIPT), url, str(N), str(out)], key, 1200)
    report = json.loads(out.read_text())
    assert report["errors"] == [], "\n".join(report["errors"])
    for phase in ("threads", "tasks"):
        assert sorted(map(int, report[phase])) == list(range(N)), phase
        for worker, seen in report[phase].items():
            first, probe, second = seen["losses"]
            # the probe forward ran after the first optim_step and before the second forward_backward
            assert probe == second and probe != first, (phase, worker, seen)
            assert seen["optim"] == [True, True] and seen["seq"] == 6 and seen["sampled"] == 3


@pytest.mark.slow
def test_one_client_shared_by_threads_and_tasks_over_http(http_engine, roomy_key, tmp_path):
    _check_workload(http_engine["url"], roomy_key, tmp_path / "report.json")


@pytest.mark.slow
def test_one_client_shared_by_threads_and_tasks_in_process(sess_home, roomy_key, tmp_path):
    _check_workload("inproc", roomy_key, tmp_path / "report.json")
