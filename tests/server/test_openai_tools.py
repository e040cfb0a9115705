"""The tools people point at an OpenAI endpoint, installed unmodified in venvs of their own, against
the engine's /v1 (slow: each builds its venv): LangChain's ChatOpenAI and OpenAI classes, and
lm-evaluation-harness's local-completions model on smollm2-135m, scored against lm-eval's own hf
model on the engine's converted weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sess.engine import ServiceClient

SCRIPTS = Path(__file__).parent / "openai_scripts"


def make_venv(root: Path, packages: list[list[str]]) -> Path:
    """A venv with ``packages`` installed in turn (pip runs from this interpreter): its python.
    ``SESS_TEST_VENV_<NAME>`` names a prebuilt one instead (name: the venv folder's)."""
    prebuilt = os.environ.get(f"SESS_TEST_VENV_{root.name.upper().replace('-', '_')}")
    if prebuilt:
        return Path(prebuilt) / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    for group in packages:
        subprocess.run(pip + group, check=True, capture_output=True, text=True)
    return python


def run(
    python: Path, args: list[str], timeout: float, env: dict | None = None
) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SESS_", "OPENAI_"))}
    environment.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    done = subprocess.run(
        [str(python), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**environment, **(env or {})},
    )
    assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


@pytest.fixture(scope="module")
def key(http_engine, sess_home) -> str:
    svc = ServiceClient(http_engine["url"], home=sess_home)
    yield svc.transport.api_key
    svc.close()


@pytest.mark.slow
def test_langchain_chat_and_completions(http_engine, key, tmp_path_factory):
    root = tmp_path_factory.mktemp("langchain")
    python = make_venv(root / "langchain-venv", [["langchain-openai"]])
    spec = {
        "model": "tiny-llama",
        "base_url": f"{http_engine['url']}/v1",
        "key": key,
        "out": str(root / "out.json"),
    }
    run(python, [str(SCRIPTS / "langchain_client.py"), json.dumps(spec)], timeout=300)
    seen = json.loads((root / "out.json").read_text())
    assert seen["short"]["usage"]["completion_tokens"] <= 3  # max_tokens arrives as max_completion_tokens
    assert isinstance(seen["invoke"], str) and len(seen["batch"]) == 2
    assert len(seen["stream"]) > 2 and "".join(seen["stream"]) == seen["invoke"]  # same seed, same text
    assert isinstance(seen["completion"], str) and seen["completions"][0] == seen["completion"]
