"""vLLM as the engine's sampler vs the built-in sampler, side by side on one workload.

Two engine processes on the same home's model files: one with the built-in sampler, one started with
``--sampler vllm --sampler-python PY`` (vLLM in an environment of its own). On each, a rank-8 session
on every linear layer (LoRA B = 0, so both sample the base model's distribution through a LoRA) takes
P prompts x K samples x T new tokens at temperature 0.7, all requests in flight at once; the first
round (cold: vLLM loads the LoRA) and the median of the warm rounds are timed from the client. The
table also gives each engine's start and session creation (vLLM loads the base model there) and the
vLLM sampler's drift: mean and max |logp_vllm - logp_trainer| over the sampled tokens.

    python benchmarks/vllm_sampler.py --sampler-python ~/vllm-venv/bin/python             # smollm2-135m
    python benchmarks/vllm_sampler.py --sampler-python PY --device cuda --dtype bfloat16  # on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sess.engine import Datum, ModelInput, SamplingParams, ServiceClient
from sess.engine.runtime.models import catalog
from sess.engine.sdk.local_engine import start_engine, stop_engine

PROMPTS = ["The capital of France is", "12 + 30 =", "Once upon a time", "def fibonacci(n):", "Water boils at"]


def trainer_logprobs(tc, prompt: list[int], tokens: list[int]) -> list[float]:
    full = prompt + tokens
    datum = Datum(
        ModelInput.from_ints(full[:-1]), {"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)}
    )
    return tc.forward([datum]).result().loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]


def measure(home: Path, args, extra: list[str]) -> dict:
    started = time.perf_counter()
    info = start_engine(home, device=args.device, extra_args=extra, timeout=1800)
    row = {"start_s": time.perf_counter() - started}
    svc = ServiceClient(info["url"], home=home)
    try:
        started = time.perf_counter()
        tc = svc.create_lora_training_client(args.model, rank=8, seed=0)
        row["session_s"] = time.perf_counter() - started
        tok, sc = tc.get_tokenizer(), tc.create_sampling_client()
        prompts = [tok.encode(p) for p in (PROMPTS * args.prompts)[: args.prompts]]
        params = SamplingParams(max_tokens=args.tokens, temperature=0.7, seed=1)
        rounds = []
        for _ in range(1 + args.rounds):
            started = time.perf_counter()
            futures = [sc.sample(p, args.samples, params) for p in prompts]
            results = [f.result() for f in futures]
            tokens = sum(len(s.tokens) for r in results for s in r.sequences)
            rounds.append(tokens / (time.perf_counter() - started))
        row["cold"], row["warm"] = rounds[0], statistics.median(rounds[1:])
        diffs = []
        for prompt, result in zip(prompts, results):
            for seq in result.sequences:
                diffs += [abs(a - b) for a, b in zip(seq.logprobs, trainer_logprobs(tc, prompt, seq.tokens))]
        row["drift"] = (statistics.fmean(diffs), max(diffs))
    finally:
        svc.close()
        stop_engine(home)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sampler-python", required=True, help="the Python of an environment with vLLM")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="warm rounds after the first")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for vLLM on CPU (its default: 4)
    models = catalog.prepare(args.model).parent  # converted once, shared by both engines
    dtype = ["--dtype", args.dtype] if args.dtype else []
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (
            ("built-in", []),
            ("vLLM", ["--sampler", "vllm", "--sampler-python", args.sampler_python]),
        ):
            home = Path(tmp) / name
            home.mkdir()
            (home / "models").symlink_to(models)
            rows[name] = measure(home, args, extra + dtype)
    table = Table(
        title=f"{args.model} on {args.device}: {args.prompts} prompts x {args.samples} x {args.tokens} tokens"
    )
    for column in (
        "sampler",
        "engine start",
        "session",
        "cold tok/s",
        "warm tok/s",
        "mean |dlogp|",
        "max |dlogp|",
    ):
        table.add_column(column)
    for name, r in rows.items():
        table.add_row(
            name, f"{r['start_s']:.1f} s", f"{r['session_s']:.1f} s", f"{r['cold']:.1f}", f"{r['warm']:.1f}",
            f"{r['drift'][0]:.2e}", f"{r['drift'][1]:.2e}",
        )  # fmt: skip
    Console().print(table)
    ratio = rows["vLLM"]["warm"] / rows["built-in"]["warm"]
    print(f"warm throughput vLLM / built-in: {ratio:.2f}x")


if __name__ == "__main__":
    main()
