"""tinker-cookbook's recipes, unchanged, against the engine (slow: minutes on a CPU): the RL trainer
on generated arithmetic and the supervised trainer on a local chat JSONL file, both on
smollm2-135m, write their metrics and checkpoints; the RL run resumes from its last checkpoint
with its optimizer state. The multi-turn ``multiplayer_rl.guess_number`` recipe (up to ten guesses
with higher/lower feedback), which has no ``base_url`` option, reaches the engine through
``TINKER_BASE_URL`` alone. The cookbook runs in a client environment of its own, as on a laptop
talking to a GPU host: ``pip install torch==2.13.0 tinker==0.38.0 'tinker-cookbook[math-rl]==0.5.8'``.
The commands are the README's ("The Tinker SDK and tinker-cookbook")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sess.engine import ServiceClient
from sess.engine.server.keys import KeyStore

from tinker_helpers import make_cookbook_venv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cookbook(tmp_path_factory) -> Path:
    return make_cookbook_venv(tmp_path_factory.mktemp("cookbook"))


@pytest.fixture(scope="module")
def engine(http_engine, sess_home):
    """(url, key, model_name, sess SDK client): model_name is the engine's directory of smollm2-135m,
    which holds its tokenizer (the cookbook tokenizes on the client) and names the model by its
    last part."""
    key = KeyStore(sess_home).add("cookbook", max_sessions=50)["key"]
    svc = ServiceClient(http_engine["url"], api_key=key)
    directory = svc.transport.call(
        "model_info",
        {"base_model": "smollm2-135m"},
    )["directory"]
    yield http_engine["url"], key, directory, svc
    for summary in svc.list_sessions(status_equals="Running"):
        svc.stop_session(summary.name)
    svc.close()


def _run(
    python: Path, recipe: str, url: str, key: str, *options: str, by_env: bool = False, timeout: int = 1800
) -> str:
    """Run a recipe's ``train`` module; ``by_env`` gives the URL as TINKER_BASE_URL, not base_url=."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TINKER_")},
        "TINKER_API_KEY": key,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        **({"TINKER_BASE_URL": url} if by_env else {}),
    }
    where = [] if by_env else [f"base_url={url}"]
    command = [str(python), "-m", f"tinker_cookbook.recipes.{recipe}.train", *where, *options]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout + done.stderr


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_rl_recipe_trains_writes_metrics_and_resumes(cookbook, engine, tmp_path):
    url, key, model_name, svc = engine
    log = tmp_path / "rl"
    common = [
        f"model_name={model_name}",
        "renderer_name=role_colon",
        "env=arithmetic",
        "lora_rank=8",
        "group_size=2",
        "groups_per_batch=2",
        "max_tokens=5",
        "learning_rate=1e-5",
        "save_every=2",
        "eval_every=0",
        f"log_path={log}",
    ]
    _run(cookbook, "math_rl", url, key, *common, "max_steps=3", "behavior_if_log_dir_exists=delete")
    metrics = _lines(log / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert {"env/all/reward/total", "grad_norm:mean", "optim/entropy"} <= set(m)
        # the sampler's logprobs are the trainer's: their KL estimate is zero to float precision
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m["optim/kl_sample_train_v1"]
    records = _lines(log / "checkpoints.jsonl")
    assert [r["name"] for r in records] == ["000002", "final"]
    first_run = records[-1]["state_path"].split("/")[2]
    assert records[-1]["state_path"] == f"tinker://{first_run}/weights/final"

    # resume from the last checkpoint (weights and optimizer state) with one step more
    _run(cookbook, "math_rl", url, key, *common, "max_steps=4", "behavior_if_log_dir_exists=resume")
    metrics = _lines(log / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    resumed = _lines(log / "checkpoints.jsonl")[-1]
    run = resumed["state_path"].split("/")[2]
    assert resumed["name"] == "final" and resumed["batch"] == 4 and run != first_run
    # the resumed run continued the first one's optimizer: it carries its step count (3) plus one
    assert svc.transport.call("session_info", {"name": run.replace(":", ".")})["step"] == 4


def test_supervised_recipe_trains_on_a_local_chat_file(cookbook, engine, tmp_path):
    url, key, model_name, _ = engine
    data = tmp_path / "conversations.jsonl"
    site = next((cookbook.parent.parent / "lib").glob("python*/site-packages"))
    shutil.copy(site / "tinker_cookbook" / "example_data" / "conversations.jsonl", data)
    log = tmp_path / "sl"
    options = [
        f"model_name={model_name}",
        "renderer_name=role_colon",
        f"dataset={data}",
        "batch_size=4",
        "max_length=256",
        "lora_rank=8",
        "learning_rate=1e-4",
        "lr_schedule=linear",
        "num_epochs=1",
        "max_steps=3",
        "save_every=2",
        "eval_every=0",
        "infrequent_eval_every=0",
        f"log_path={log}",
        "behavior_if_log_dir_exists=delete",
    ]
    _run(cookbook, "chat_sl", url, key, *options)
    metrics = _lines(log / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(m["train_mean_nll"] > 0 and m["num_sequences"] == 4 and "grad_norm:mean" in m for m in metrics)
    assert [m["learning_rate"] for m in metrics] == pytest.approx([1e-4, 1e-4 * 2 / 3, 1e-4 / 3])
    records = _lines(log / "checkpoints.jsonl")
    assert [r["name"] for r in records] == ["000002", "final"]
    assert all(r["state_path"].startswith("tinker://") for r in records)


def test_multi_turn_guess_number_recipe_through_tinker_base_url(cookbook, engine, tmp_path):
    url, key, model_name, _ = engine
    log = tmp_path / "guess"
    options = [
        f"model_name={model_name}",
        "renderer_name=role_colon",
        "group_size=2",
        "batch_size=1",
        "max_tokens=8",
        "learning_rate=1e-5",
        "eval_every=0",
        "save_every=0",
        "max_steps=2",
        f"log_path={log}",
        "behavior_if_log_dir_exists=delete",
    ]
    # a step samples 20 turns of 8 tokens and trains on ~5,000 tokens (each turn carries the game so
    # far): ~4 minutes on 2 busy cores (load 9-14), plus ~5 for the cookbook's venv
    _run(cookbook, "multiplayer_rl.guess_number", url, key, *options, by_env=True, timeout=3600)
    metrics = _lines(log / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        # one group of 2 episodes, each at least one guess (a turn) and at most ten
        assert m["env/all/total_episodes"] == 2 and 1 <= m["env/all/turns_per_episode"] <= 10, m
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m["optim/kl_sample_train_v1"]
