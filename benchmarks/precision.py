"""bf16 vs fp32 on this machine: training and sampling speed and the engine's memory, per base-model dtype.

One command runs each dtype in its own fresh process (an in-process engine started with ``--dtype``,
as ``sess engine up --dtype`` does), alternating fp32, bf16, fp32, bf16 ... for ``--rounds`` rounds so
machine noise hits both alike, and prints the medians and the ratios bf16 / fp32. Each process:
loads the model with one LoRA session (RSS before and after), one warm-up then one timed
forward_backward + optim_step on ``--rows`` x ``--length`` tokens, one timed sampling batch of
``--prompts`` x ``--samples`` x ``--max-tokens`` new tokens (temperature 0.7), and its peak RSS
(VmHWM) over all of it. The LoRA weights and AdamW state are fp32 in both.

    python benchmarks/precision.py                      # smollm2-135m, 4 x 128 training, 4 x 4 x 32 sampling
    python benchmarks/precision.py --rounds 3 --rows 8
    python benchmarks/precision.py --device cuda        # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

GB = 1 << 30
DTYPES = ("float32", "bfloat16")


def child(args) -> dict:
    """One dtype's figures, measured in this process (an in-process engine)."""
    import torch

    from sess.engine import AdamParams, Datum, ModelInput, SamplingParams

    from common import as_engine_process, in_process_client, memory_status

    as_engine_process(args.device)
    svc = in_process_client(args.home, args.device, args.dtype)
    at_start = memory_status()["VmRSS"]
    started = time.perf_counter()
    tc = svc.create_lora_training_client(args.model, rank=args.rank, alpha=2 * args.rank, seed=0)
    load_s = time.perf_counter() - started
    loaded = memory_status()["VmRSS"]
    vocab = len(tc.get_tokenizer())
    g = torch.Generator().manual_seed(0)

    def train_step() -> tuple[float, float]:
        rows = torch.randint(10, vocab - 10, (args.rows, args.length + 1), generator=g)
        data = [
            Datum(
                ModelInput.from_ints(row[:-1].tolist()),
                {"target_tokens": row[1:].numpy(), "weights": torch.ones(args.length).numpy()},
            )
            for row in rows
        ]
        start = time.perf_counter()
        fb = tc.forward_backward(data)
        opt = tc.optim_step(AdamParams(learning_rate=1e-4))
        loss = fb.result().metrics["loss:sum"]
        opt.result()
        return time.perf_counter() - start, loss

    train_step()  # warm-up
    train_s, loss = train_step()
    sc = tc.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=0)
    warm_up = ModelInput.from_ints(torch.randint(10, vocab - 10, (32,), generator=g).tolist())
    sc.sample(warm_up, num_samples=1, sampling_params=SamplingParams(max_tokens=4, seed=0)).result()
    prompts = [
        ModelInput.from_ints(torch.randint(10, vocab - 10, (32,), generator=g).tolist())
        for _ in range(args.prompts)
    ]
    start = time.perf_counter()
    futures = [sc.sample(p, num_samples=args.samples, sampling_params=params) for p in prompts]
    new_tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
    sample_s = time.perf_counter() - start
    tc.stop()
    svc.close()
    return {
        "dtype": args.dtype,
        "load_s": load_s,
        "rss_start": at_start,
        "rss_loaded": loaded,
        "peak": memory_status()["VmHWM"],
        "train_tok_s": args.rows * args.length / train_s,
        "train_loss": loss,
        "sample_tok_s": new_tokens / sample_s,
        "new_tokens": new_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternating fp32/bf16 rounds")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--home", default=None, help="engine home (default: SESS_HOME or ~/.sess)")
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)  # a child process's dtype
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_json:
        Path(args.child_json).write_text(json.dumps(child(args)))
        return

    from rich.console import Console
    from rich.table import Table

    results: dict[str, list[dict]] = {d: [] for d in DTYPES}
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"sess-precision-{os.getpid()}.json"
    passed = [
        f"--{key.replace('_', '-')}={value}"
        for key, value in vars(args).items()
        if value is not None and key not in ("rounds", "dtype", "child_json")
    ]
    for r in range(args.rounds):
        for dtype in DTYPES:
            print(f"round {r + 1}/{args.rounds}: {dtype} ...", flush=True)
            cmd = [sys.executable, __file__, *passed, "--dtype", dtype, "--child-json", str(out)]
            subprocess.run(cmd, check=True)
            results[dtype].append(json.loads(out.read_text()))
            print(json.dumps(results[dtype][-1]), flush=True)
    out.unlink(missing_ok=True)

    def med(dtype: str, key: str) -> float:
        return statistics.median(r[key] for r in results[dtype])

    table = Table(
        title=f"{args.model} on {args.device}: training {args.rows}x{args.length}, sampling "
        f"{args.prompts}x{args.samples}x{args.max_tokens}, LoRA rank {args.rank}, median of {args.rounds}"
    )
    for col in ("", *DTYPES, "bf16 / fp32"):
        table.add_column(col)
    rows = [
        ("training tok/s", "train_tok_s", 1, "{:.1f}"),
        ("sampling new tok/s", "sample_tok_s", 1, "{:.1f}"),
        ("RSS before loading, GiB", "rss_start", GB, "{:.2f}"),
        ("RSS after loading, GiB", "rss_loaded", GB, "{:.2f}"),
        ("peak RSS, GiB", "peak", GB, "{:.2f}"),
        ("load s", "load_s", 1, "{:.1f}"),
    ]
    for label, key, unit, fmt in rows:
        a, b = med("float32", key) / unit, med("bfloat16", key) / unit
        table.add_row(label, fmt.format(a), fmt.format(b), f"{b / a:.3f}")
    Console().print(table)
    losses = {d: results[d][-1]["train_loss"] for d in DTYPES}
    print(f"training loss (same batch): fp32 {losses['float32']:.3f}, bf16 {losses['bfloat16']:.3f}")


if __name__ == "__main__":
    main()
