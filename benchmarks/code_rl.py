"""Code RL's learning check: `sess run loop=code_rl` (smollm2-135m, generated tasks, CPU), then HumanEval.

Runs the default code RL run through the runner `sess run` uses (or reads a finished one with
``--run``), prints the held-out greedy pass rate on generated tasks before and after, the training
reward per step, the wall time, and the greedy pass@1 on HumanEval of the base model and of the
trained adapter (its last saved state), ``--humaneval`` problems (164: all) at ``--humaneval-tokens``
tokens per answer.

    python benchmarks/code_rl.py                          # the default run, then HumanEval (164)
    python benchmarks/code_rl.py --run runs/benchmarks/<dir> --humaneval 164
    python benchmarks/code_rl.py loop.steps=10 --humaneval 0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sess.loops import code_data, config, evaluation, runner
from sess.loops.records import RunRecord, read_jsonl
from sess.loops.rollouts import derive_seed


def learning(run_dir: Path, wall_s: float | None) -> dict:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    train = [r for r in rows if r["kind"] == "train"]
    first, last = evals[0], evals[-1]
    return {
        "run": str(run_dir),
        "steps": last["step"],
        "eval_n": first["eval/n"],
        "pass_before": first["eval/accuracy/generated"],
        "pass_after": last["eval/accuracy/generated"],
        "pass_by_eval": {r["step"]: round(r["eval/accuracy/generated"], 4) for r in evals},
        "gain_points": round(100 * (last["eval/accuracy/generated"] - first["eval/accuracy/generated"]), 2),
        "train_reward": [round(r["reward/mean"], 3) for r in train],
        "train_reward_first_last_5": [
            round(sum(r["reward/mean"] for r in train[:5]) / 5, 3),
            round(sum(r["reward/mean"] for r in train[-5:]) / 5, 3),
        ],
        "wall_s": wall_s,
    }


def humaneval(run_dir: Path, n: int, max_tokens: int) -> dict:
    """Greedy pass@1 on the first ``n`` HumanEval problems: the base model, then the trained adapter."""
    cfg = config.load(run_dir / "config.yaml")
    grader = code_data.SharedGrader(cfg.grader)
    envs = [code_data._env(p, grader, cfg.data.format_penalty) for p in code_data.humaneval_problems()[:n]]
    seeds = [derive_seed(cfg.seed, "humaneval", i) for i in range(n)]
    svc = runner.service_client(cfg.engine)
    out = {"n": n, "max_tokens": max_tokens}
    lora = cfg.model.lora
    base = svc.create_lora_training_client(cfg.model.base_model, rank=lora.rank, alpha=lora.alpha, seed=0)
    state = RunRecord(run_dir).last_state()
    trained = svc.create_training_client_from_state(state["path"])
    for name, tc in (("base", base), ("trained", trained)):
        started = time.perf_counter()
        metrics = evaluation.greedy_episodes(tc, envs, max_tokens, seeds, 1)
        out[name] = {"pass": metrics["eval/accuracy"], "has_code": metrics["eval/has_code"]}
        out[name]["seconds"] = round(time.perf_counter() - started, 1)
        tc.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="a finished run directory to read instead of training")
    parser.add_argument("--runs-dir", default="runs/benchmarks")
    parser.add_argument("--humaneval", type=int, default=164, help="HumanEval problems (0: skip)")
    parser.add_argument("--humaneval-tokens", type=int, default=256)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    wall_s = None
    if args.run:
        run_dir = Path(args.run)
    else:
        started = time.perf_counter()
        run_dir = runner.start(
            ["loop=code_rl", f"runs_dir={args.runs_dir}", "keep_session=false", *args.overrides]
        )
        wall_s = round(time.perf_counter() - started, 1)
    result = {"command": "sess run loop=code_rl " + " ".join(args.overrides), **learning(run_dir, wall_s)}
    print(json.dumps(result), flush=True)
    if args.humaneval:
        print(
            json.dumps({"humaneval": humaneval(run_dir, args.humaneval, args.humaneval_tokens)}), flush=True
        )


if __name__ == "__main__":
    main()
