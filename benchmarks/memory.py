"""Engine memory: peak and held RSS of an engine process over a GRPO step, an SFT step and sampling.

Starts an engine server process (as ``sess engine up`` does, with its malloc settings) on its own
home and drives it over HTTP with the workload of issue 14, reading the engine's RSS from
``/proc/<pid>/status``: VmRSS now, and VmHWM, the peak since the last reset (``clear_refs`` 5), so
every workload gets its own peak:

1. loading: the base model and one session (LoRA rank 32 on attention, MLP and lm_head);
2. a GRPO-shaped step: 8 prompts x 8 completions, 60-100 tokens each (a shared 27-token system
   start, 13-23 prompt tokens of its own, 20-50 completion tokens), ppo loss, forward_backward +
   optim_step + save_weights_and_get_sampling_client;
3. an SFT step: 4 x 1024 tokens, cross entropy, forward_backward + optim_step;
4. sampling: 8 prompts x 8 samples x 64 new tokens (temperature 0.7, no early stop);
5. after the work: RSS at once, and after the engine has been idle long enough to hand freed
   memory back (``engine/runtime/memory/malloc_tuning.py``).

Targets (issue 14): every workload's peak <= 4x the fp32 weights; RSS after the work <= 2x RSS after
loading. Each row prints its throughput next to its peak. With ``--sess-run`` it also runs the
default ``sess run`` (GRPO, 20 steps, ~3 minutes) on a fresh home and reports its engine's peak and
held RSS (target: under 2 GB).

    python benchmarks/memory.py                            # smollm2-135m, fp32
    python benchmarks/memory.py --dtype bfloat16
    python benchmarks/memory.py --model tiny-llama          # a quick check
    python benchmarks/memory.py --sess-run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sess.engine import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient  # noqa: E402
from sess.engine.sdk.local_engine import start_engine, stop_engine  # noqa: E402

from common import memory_status  # noqa: E402

GiB = 1 << 30
TARGET_SESS_RUN = 2e9  # issue 14: the default `sess run` engine under 2 GB (bytes)


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def grpo_batch(vocab: int, seed: int = 0) -> list[Datum]:
    """8 prompts x 8 completions of 60-100 tokens, with sampler logprobs and group advantages."""
    rng = random.Random(seed)
    system = [rng.randrange(10, vocab) for _ in range(27)]
    data = []
    for _ in range(8):
        prompt = system + [rng.randrange(10, vocab) for _ in range(rng.randint(13, 23))]
        for _ in range(8):
            completion = [rng.randrange(10, vocab) for _ in range(rng.randint(20, 50))]
            tokens = prompt + completion
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
            advantage = rng.choice([-1.0, 1.0])
            data.append(
                Datum(
                    ModelInput.from_ints(tokens[:-1]),
                    {
                        "target_tokens": tokens[1:],
                        "logprobs": [-2.0 * w for w in weights],
                        "advantages": [advantage * w for w in weights],
                    },
                )
            )
    return data


def sft_batch(vocab: int, rows: int = 4, length: int = 1024, seed: int = 1) -> list[Datum]:
    rng = random.Random(seed)
    data = []
    for _ in range(rows):
        tokens = [rng.randrange(10, vocab) for _ in range(length + 1)]
        data.append(
            Datum(ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": [1.0] * length})
        )
    return data


def fp32_weight_bytes(home: Path, model: str) -> int:
    """What the model's weights take in fp32: its parameter count x 4 (tied weights once)."""
    from safetensors import safe_open

    from sess.engine.runtime.models.catalog import prepare

    total, seen = 0, set()
    for file in sorted(prepare(model, home, progress=False).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                count = 1
                for n in shape:
                    count *= n
                if key not in seen:
                    seen.add(key)
                    total += count * 4
    return total


def measure(args, home: Path, console: Console) -> dict:
    extra = []
    if args.dtype:
        extra += ["--dtype", args.dtype]
    if args.memory_budget:
        extra += ["--memory-budget", args.memory_budget]
    info = start_engine(home, extra_args=extra)
    pid = info["pid"]
    rows: list[tuple[str, str, float, dict]] = []

    def done(name: str, speed: str, seconds: float, reading: dict) -> None:
        rows.append((name, speed, seconds, reading))  # and a line now: a workload can take minutes
        console.print(
            f"{name}: {seconds:.1f} s {speed}, peak {reading['VmHWM'] / GiB:.2f} GiB, now {reading['VmRSS'] / GiB:.2f} GiB"
        )

    try:
        started = memory_status(pid)
        svc = ServiceClient(info["url"], home=home)
        reset_peak(pid)
        t0 = time.perf_counter()
        tc = svc.create_lora_training_client(args.model, rank=32, alpha=64, seed=0)
        loading_s = time.perf_counter() - t0
        vocab = len(tc.get_tokenizer())
        loaded = memory_status(pid)
        done("loading (model + 1 session)", "", loading_s, loaded)
        adam = AdamParams(learning_rate=1e-5)

        reset_peak(pid)
        grpo = grpo_batch(vocab)
        tokens = sum(d.model_input.length for d in grpo)
        t0 = time.perf_counter()
        fb = tc.forward_backward(grpo, "ppo")
        tc.optim_step(adam).result()
        sc = tc.save_weights_and_get_sampling_client()
        fb.result()
        grpo_s = time.perf_counter() - t0
        done("GRPO step: 64 x 60-100 tokens, ppo", f"{tokens / grpo_s:.0f} tok/s", grpo_s, memory_status(pid))

        reset_peak(pid)
        sft = sft_batch(vocab)
        t0 = time.perf_counter()
        loss = tc.forward_backward(sft).result().metrics["loss:sum"]
        tc.optim_step(adam).result()
        sft_s = time.perf_counter() - t0
        done(
            "SFT step: 4 x 1024 tokens, cross entropy", f"{4096 / sft_s:.0f} tok/s", sft_s, memory_status(pid)
        )

        reset_peak(pid)
        rng = random.Random(2)
        prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(30, 50))] for _ in range(8)]
        params = SamplingParams(max_tokens=64, temperature=0.7, seed=0, stop=[])
        sc = tc.save_weights_and_get_sampling_client()
        t0 = time.perf_counter()
        futures = [sc.sample(p, num_samples=8, sampling_params=params) for p in prompts]
        sampled = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        sample_s = time.perf_counter() - t0
        done(
            "sampling: 8 prompts x 8 x 64",
            f"{sampled / sample_s:.0f} new tok/s",
            sample_s,
            memory_status(pid),
        )

        after = memory_status(pid)
        time.sleep(args.idle_wait)
        idle = memory_status(pid)
        tc.stop()
        svc.close()
    finally:
        stop_engine(home)
    weights = fp32_weight_bytes(home, args.model)
    table = Table(
        title=f"engine RSS, {args.model}, dtype {args.dtype or 'default'} (fp32 weights {weights / GiB:.2f} GiB)"
    )
    for col in ("workload", "throughput", "seconds", "peak RSS GiB", "peak / fp32 weights", "RSS after GiB"):
        table.add_column(col)
    table.add_row("engine started", "", "", "", "", f"{started['VmRSS'] / GiB:.2f}")
    for name, speed, seconds, s in rows:
        table.add_row(
            name,
            speed,
            f"{seconds:.1f}",
            f"{s['VmHWM'] / GiB:.2f}",
            f"{s['VmHWM'] / weights:.2f}x",
            f"{s['VmRSS'] / GiB:.2f}",
        )
    console.print(table)
    peak = max(s["VmHWM"] for _, _, _, s in rows[1:])
    result = {
        "model": args.model,
        "dtype": args.dtype or "default",
        "fp32_weights_gib": weights / GiB,
        "loaded_gib": loaded["VmRSS"] / GiB,
        "peak_gib": peak / GiB,
        "peak_over_weights": peak / weights,
        "after_gib": after["VmRSS"] / GiB,
        "after_idle_gib": idle["VmRSS"] / GiB,
        "after_over_loaded": idle["VmRSS"] / loaded["VmRSS"],
        "sft_loss": loss,
        "workloads": {name: {"seconds": sec, "peak_gib": s["VmHWM"] / GiB} for name, _, sec, s in rows},
    }
    console.print(
        f"peak over the workload {peak / GiB:.2f} GiB = {peak / weights:.2f}x the fp32 weights (target <= 4x); "
        f"RSS after the work {after['VmRSS'] / GiB:.2f} GiB, after {args.idle_wait:.0f} s idle "
        f"{idle['VmRSS'] / GiB:.2f} GiB = {idle['VmRSS'] / loaded['VmRSS']:.2f}x RSS after loading "
        f"({loaded['VmRSS'] / GiB:.2f} GiB; target <= 2x)"
    )
    return result


def sess_run(console: Console) -> dict:
    """The default ``sess run`` on a fresh home, its engine's peak and held RSS read at the end."""
    home = Path(tempfile.mkdtemp(prefix="sess-memory-run-"))
    models = Path(os.environ.get("SESS_HOME", Path.home() / ".sess")) / "models" / "smollm2-135m"
    if models.is_dir():  # reuse a converted smollm2 instead of converting it again
        (home / "models").mkdir(parents=True)
        (home / "models" / "smollm2-135m").symlink_to(models)
    env = {**os.environ, "SESS_HOME": str(home)}
    t0 = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "sess"), "run"], env=env, check=True, cwd=home)
    seconds = time.perf_counter() - t0
    info = json.loads((home / "engine.json").read_text())
    s = memory_status(info["pid"])
    stop_engine(home)
    console.print(
        f"sess run (default GRPO, {seconds:.0f} s): engine peak {s['VmHWM'] / GiB:.2f} GiB "
        f"= {s['VmHWM'] / 1e9:.3f} GB, held at the end {s['VmRSS'] / GiB:.2f} GiB (target: under 2 GB, "
        f"{'met' if s['VmHWM'] < TARGET_SESS_RUN else 'NOT met'})"
    )
    return {"seconds": seconds, "peak_gib": s["VmHWM"] / GiB, "held_gib": s["VmRSS"] / GiB}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=None, help="the engine's --dtype (default: the engine's default)")
    parser.add_argument("--memory-budget", default=None, help="the engine's --memory-budget")
    parser.add_argument("--home", default=None, help="engine home (default: a fresh one; models are reused)")
    parser.add_argument("--idle-wait", type=float, default=12.0, help="seconds idle before the last reading")
    parser.add_argument("--sess-run", action="store_true", help="also measure the default `sess run`")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    console = Console()
    if args.home:
        home = Path(args.home)
    else:
        home = Path(tempfile.mkdtemp(prefix="sess-memory-"))
        models = Path(os.environ.get("SESS_HOME", Path.home() / ".sess")) / "models"
        if models.is_dir():
            (home / "models").mkdir(parents=True)
            for model in models.iterdir():
                if model.is_dir():
                    (home / "models" / model.name).symlink_to(model)
    result = measure(args, home, console)
    if args.sess_run:
        result["sess_run"] = sess_run(console)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
