"""Code RL's learning check: `sess run loop=code_rl` (smollm2-135m, generated tasks, CPU), then HumanEval.

Runs the default code RL run through the runner `sess run` uses (or reads a run directory with
``--run``), prints the held-out pass rate on generated tasks before and after, greedy and sampled
(``eval_samples`` answers a problem at the loop's temperature), the training
reward per step, the wall time, and the greedy pass@1 on HumanEval of the base model and of the
trained weights, ``--humaneval`` problems (164: all) at ``--humaneval-tokens`` tokens per answer.

A run that cannot finish in the time there is (a shared CPU) stops cleanly after the step during
which ``--budget-s`` ran out; "after" is then the same held-out evaluation of the session's weights
at that step, and the HumanEval comparison uses those weights. ``--run DIR`` of such a stopped run
(its session still live on the engine) evaluates it the same way.

    python benchmarks/code_rl.py                          # the default run, then HumanEval (164)
    python benchmarks/code_rl.py --budget-s 3600 --humaneval 40
    python benchmarks/code_rl.py --run runs/benchmarks/<dir> --humaneval 164
    python benchmarks/code_rl.py loop.steps=10 --humaneval 0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from sess.engine import TrainingClient
from sess.harness import config, hooks, runner
from sess.harness.records import RunRecord, read_jsonl
from sess.rl import evaluation
from sess.rl.rollouts import derive_seed
from sess.tasks import sources as datasets
from sess.tasks.code.grader_config import SharedGrader, env_of
from sess.tasks.humaneval.problems import humaneval_problems


def learning(run_dir: Path, wall_s: float | None, after: dict | None) -> dict:
    """Before/after from the run's own evaluations, or (a stopped run) ``after`` of its live session."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    train = [r for r in rows if r["kind"] == "train"]
    if after is not None:
        evals = [*evals, after]
    first, last = evals[0], evals[-1]
    n5 = min(5, len(train))
    return {
        "run": str(run_dir),
        "steps": len(train),
        "eval_n": first["eval/n"],
        "pass_before": first["eval/accuracy/generated"],
        "pass_after": last["eval/accuracy/generated"],
        "pass_by_eval": {r["step"]: round(r["eval/accuracy/generated"], 4) for r in evals},
        "gain_points": round(100 * (last["eval/accuracy/generated"] - first["eval/accuracy/generated"]), 2),
        **sampled(evals),
        "train_reward": [round(r["reward/mean"], 3) for r in train],
        "train_accuracy": [round(r["accuracy"], 3) for r in train],
        "train_reward_first_last": [
            round(sum(r["reward/mean"] for r in train[:n5]) / max(n5, 1), 3),
            round(sum(r["reward/mean"] for r in train[-n5:]) / max(n5, 1), 3),
        ],
        "step_seconds": [round(r["seconds"], 1) for r in train],
        "eval_seconds": [round(r["eval/seconds"], 1) for r in evals],
        "wall_s": wall_s,
    }


def sampled(evals: list[dict]) -> dict:
    """The sampled held-out pass rate (``eval_samples`` answers a problem) before, after, at each eval."""
    key = "eval/sampled/accuracy/generated"
    evals = [r for r in evals if key in r]
    if not evals:
        return {}
    first, last = evals[0][key], evals[-1][key]
    return {
        "eval_sampled_n": evals[0]["eval/sampled/n"],
        "sampled_pass_before": first,
        "sampled_pass_after": last,
        "sampled_pass_by_eval": {r["step"]: round(r[key], 4) for r in evals},
        "sampled_gain_points": round(100 * (last - first), 2),
    }


def evaluate_live(run_dir: Path, tc: TrainingClient) -> dict:
    """The runner's held-out evaluation of the session's current weights (a run stopped early)."""
    cfg = config.load(run_dir / "config.yaml")
    envs = datasets.load(cfg.data, int(cfg.seed), cfg.grader).envs.held_out
    done = sum(1 for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train")
    started = time.perf_counter()
    metrics = hooks.env_evaluation(cfg, tc, envs, done, cfg.loop.max_turns)
    return {"kind": "eval", "step": done, **metrics, "eval/seconds": time.perf_counter() - started}


def humaneval(run_dir: Path, trained: TrainingClient | None, n: int, max_tokens: int) -> dict:
    """Greedy pass@1 on the first ``n`` HumanEval problems: the base model, then the trained weights."""
    cfg = config.load(run_dir / "config.yaml")
    grader = SharedGrader(cfg.grader)
    envs = [env_of(p, grader, cfg.data.format_penalty) for p in humaneval_problems()[:n]]
    seeds = [derive_seed(cfg.seed, "humaneval", i) for i in range(n)]
    svc = runner.service_client(cfg.engine)
    out = {"n": n, "max_tokens": max_tokens}
    lora = cfg.model.lora
    base = svc.create_lora_training_client(cfg.model.base_model, rank=lora.rank, alpha=lora.alpha, seed=0)
    models = [("base", base)] + ([("trained", trained)] if trained is not None else [])
    for name, tc in models:
        started = time.perf_counter()
        metrics = evaluation.greedy_episodes(tc, envs, max_tokens, seeds, 1)
        out[name] = {"pass": metrics["eval/accuracy"], "has_code": metrics["eval/has_code"]}
        out[name]["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps({f"humaneval/{name}": out[name]}), flush=True)
    base.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="a run directory to read (a stopped one: its live session) instead")
    parser.add_argument("--runs-dir", default="runs/benchmarks")
    parser.add_argument(
        "--budget-s", type=float, default=0, help="stop after the step that passes it (0: none)"
    )
    parser.add_argument("--humaneval", type=int, default=164, help="HumanEval problems (0: skip)")
    parser.add_argument("--humaneval-tokens", type=int, default=256)
    parser.add_argument(
        "--base-only",
        action="store_true",
        help="HumanEval of the base model only; no evaluation of a stopped run's weights (short of CPU time)",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    wall_s = None
    started = time.perf_counter()
    if args.run:
        run_dir = Path(args.run)
    else:

        def stop_when_out_of_time(done: int) -> None:
            if args.budget_s and time.perf_counter() - started > args.budget_s:
                raise runner.RunInterrupted()

        overrides = ["loop=code_rl", f"runs_dir={args.runs_dir}", "keep_session=false", *args.overrides]
        try:
            run_dir = runner.start(overrides, on_step=stop_when_out_of_time)
        except runner.RunInterrupted:
            run_dir = max(Path(args.runs_dir).iterdir(), key=lambda p: p.stat().st_mtime)
        wall_s = round(time.perf_counter() - started, 1)
    record = RunRecord(run_dir)
    meta = json.loads((run_dir / "meta.json").read_text())
    svc = runner.service_client(config.load(run_dir / "config.yaml").engine)
    after, trained = None, None
    if meta["status"] != "completed" and not args.base_only:  # stopped: its session holds its last step
        trained = svc.get_training_client(meta["session"])
        after = evaluate_live(run_dir, trained)
        print(json.dumps({"after": after}), flush=True)
    overrides = yaml.safe_load((run_dir / "overrides.yaml").read_text()) or []
    result = {"command": "sess run " + " ".join(overrides), "status": meta["status"]}
    print(json.dumps({**result, **learning(run_dir, wall_s, after)}), flush=True)
    if args.humaneval:
        if trained is None and not args.base_only:
            trained = svc.create_training_client_from_state(record.last_state()["path"])
        print(json.dumps({"humaneval": humaneval(run_dir, trained, args.humaneval, args.humaneval_tokens)}))
    if trained is not None:
        trained.stop()


if __name__ == "__main__":
    main()
