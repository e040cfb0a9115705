"""Running tinker-cookbook recipes as a user types them, for the recipe suites of each cookbook
release (tests/tinker/test_cookbook_recipes.py for 0.5.8, test_cookbook061_recipes.py for 0.6.1)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

from cookbook_standins import CODE_TASKS
from tinker_helpers import run_client

# what a failed API call leaves in a recipe's output: the SDK's non-retryable errors and retries of
# failed requests (not its long-poll "try_again"), an HTTP error status, a traceback. Not the rubric
# recipe's "Failed to extract score from grader response": the judge (tiny-llama) answered, with
# text that holds no score (rubric/data.py:86), and the recipe scores it 0.
FAILED_CALL = re.compile(
    r"Request failed|non-retryable|Error code: [45]\d\d|HTTP/1\.1\" [45]\d\d|Traceback|heartbeat failed"
    r"|Failed to (?!extract score)|Exception logged|due to billing|APIStatusError|APIConnectionError"
    r"|BadRequestError",
)
SMALL_RL = [
    "group_size=2",
    "groups_per_batch=2",
    "max_tokens=8",
    "lora_rank=8",
    "eval_every=0",
    "save_every=0",
]


def run_recipe(
    cookbook, workdir, engine, module: str, log: Path, *options: str, env=None, timeout=1800, fresh_log=True
) -> dict:
    """Run ``python -m tinker_cookbook.recipes.MODULE`` in the stand-ins' directory; assert it exits 0,
    writes metrics and makes no failed API call. Its metrics rows, output and seconds. ``fresh_log``:
    pass ``behavior_if_log_dir_exists=delete`` (a recipe without that option, rl_loop, gets False)."""
    url, key, _, _ = engine
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "SESS_"))},
        "TINKER_BASE_URL": url,
        "TINKER_API_KEY": key,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(workdir / ".datasets-cache"),
        **(env or {}),
    }
    command = [str(cookbook), "-m", f"tinker_cookbook.recipes.{module}", *options]
    command += [f"log_path={log}", *(["behavior_if_log_dir_exists=delete"] if fresh_log else [])]
    started = time.monotonic()
    done = subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, env=environment, timeout=timeout
    )
    seconds = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    failed = sorted({m.group(0) for m in FAILED_CALL.finditer(output)})
    assert not failed, (failed, output[-8000:])
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert metrics, f"{module} wrote no metrics"
    return {"metrics": metrics, "output": output, "seconds": seconds}


def tiny_options(engine) -> list[str]:
    return [f"model_name={engine[2]['tiny-llama']}", "renderer_name=role_colon"]


def code_rl_after_sft(cookbook, workdir, engine, sandbox_url: str, tmp_path: Path) -> dict:
    """The seeds' workload through the cookbook's own code, on smollm2-135m (ChatML, the cookbook's
    ``qwen3_instruct`` renderer): a short ``chat_sl`` SFT on the stand-in tasks, asked as the code
    recipe asks them and answered in python code blocks, then ``code_rl`` from that state on those
    tasks and four it was not taught, graded by sess's sandbox at ``sandbox_url``. Asserts the SFT
    learned the answers and that every RL step's reward is a grade, passed and failed both seen.
    Each step's (format, correct, reward) and the seconds per step of both runs."""
    svc = engine[3]
    smol = svc.transport.call("model_info", {"base_model": "smollm2-135m"})["directory"]
    data = tmp_path / "code_sft.jsonl"
    spec = {"renderer_name": "qwen3_instruct", "model_name": smol, "path": str(data), "repeats": 4}
    spec |= {
        "tasks": [[problem, solution] for problem, _, solution in CODE_TASKS],
        "out": str(tmp_path / "sft.json"),
    }
    # the script imports the cookbook (transformers, datasets, sympy): minutes on a loaded machine
    run_client(cookbook, "code_sft_data.py", spec, url="", key="", timeout=1200)
    common = [
        f"model_name={smol}",
        "renderer_name=qwen3_instruct",
        "lora_rank=16",
        "save_every=0",
        "eval_every=0",
    ]
    sft_options = [f"dataset={data}", "batch_size=8", "max_length=1024", "learning_rate=1e-3"]
    sft_options += ["lr_schedule=constant", "num_epochs=2", "infrequent_eval_every=0"]
    sft = run_recipe(cookbook, workdir, engine, "chat_sl.train", tmp_path / "code-sft", *common, *sft_options)
    assert sft["metrics"][-1]["train_mean_nll"] < sft["metrics"][0]["train_mean_nll"] / 2
    saved = (tmp_path / "code-sft" / "checkpoints.jsonl").read_text().splitlines()
    state = json.loads(saved[-1])["state_path"]
    # one rollout at a time (the cookbook's tokenizer race, docs/tinker.md): one task per step
    rl_options = [f"load_checkpoint_path={state}", "group_size=1", "groups_per_batch=1", "max_tokens=64"]
    rl_options += ["learning_rate=1e-5", "max_steps=6"]
    rl = run_recipe(
        cookbook,
        workdir,
        engine,
        "code_rl.train",
        tmp_path / "code-rl",
        *common,
        *rl_options,
        env={"SANDBOX_URL": sandbox_url},
    )
    rows = [m for m in rl["metrics"] if "env/all/reward/total" in m]
    steps = [(m["env/all/format"], m["env/all/correct"], m["env/all/reward/total"]) for m in rows]
    print("\ncode_rl after SFT (format, correct, reward) per step:", steps)
    # every answer a code block the sandbox graded (reward 1 passed, 0 failed; -0.1 is no code block)
    assert len(steps) == 6 and all(f == 1.0 and r in (0.0, 1.0) and r == c for f, c, r in steps), steps
    assert any(c == 1.0 for _, c, _ in steps) and any(c == 0.0 for _, c, _ in steps), steps  # both grades
    return {
        "steps": steps,
        "sft_seconds_per_step": round(sft["seconds"] / len(sft["metrics"]), 1),
        "rl_seconds_per_step": round(rl["seconds"] / len(steps), 1),
    }
