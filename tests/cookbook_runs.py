"""Running tinker-cookbook recipes as a user types them, for the recipe suites of each cookbook
release (tests/tinker/test_cookbook_recipes.py for 0.5.8, test_cookbook061_recipes.py for 0.6.1)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

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
    cookbook, workdir, engine, module: str, log: Path, *options: str, env=None, timeout=1800
) -> dict:
    """Run ``python -m tinker_cookbook.recipes.MODULE`` in the stand-ins' directory; assert it exits 0,
    writes metrics and makes no failed API call. Its metrics rows, output and seconds."""
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
    command += [f"log_path={log}", "behavior_if_log_dir_exists=delete"]
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
