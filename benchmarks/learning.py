"""The headline learning check: default `sess run` (GRPO, smollm2-135m, arithmetic, CPU) and `loop=sft`.

Runs each through the same runner `sess run` uses, then prints held-out greedy accuracy before and
after (on data.eval_size >= 64 problems), the steps and the wall time. Pass extra Hydra overrides
after the script name; ``--only grpo`` or ``--only sft`` runs one of the two.

    python benchmarks/learning.py                      # both, defaults (20 steps each)
    python benchmarks/learning.py --only grpo engine=inprocess loop.steps=20
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sess.harness import runner
from sess.harness.records import read_jsonl


def measure(loop: str, overrides: list[str], runs_dir: str) -> dict:
    started = time.perf_counter()
    run_dir = runner.start([f"loop={loop}", f"runs_dir={runs_dir}", *overrides])
    evals = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r["kind"] == "eval"]
    return {
        "loop": loop,
        "run": str(run_dir),
        "steps": evals[-1]["step"],
        "eval_n": evals[0]["eval/n"],
        "accuracy_before": evals[0]["eval/accuracy"],
        "accuracy_after": evals[-1]["eval/accuracy"],
        "gain_points": 100 * (evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"]),
        "wall_s": round(time.perf_counter() - started, 1),
        "command": f"sess run loop={loop} " + " ".join(overrides),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["grpo", "sft"])
    parser.add_argument("--runs-dir", default="runs/benchmarks")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    for loop in [args.only] if args.only else ["grpo", "sft"]:
        print(json.dumps(measure(loop, args.overrides, args.runs_dir)), flush=True)


if __name__ == "__main__":
    main()
