"""Training at length: forward_backward time and peak memory of one sequence of 1K to 8K tokens.

Each length runs in a fresh engine process (so each peak RSS, VmHWM, is that length's alone): one
warm-up ``forward_backward`` of 64 tokens (model load, the activation probe), then one of the
length, timed, with the engine's defaults unless ``--memory-budget`` is given. Prints seconds,
tokens/s, peak RSS and the growth of the peak per 1K tokens between lengths (linear memory: a flat
slope). The output layer never holds a sequence's whole logits; a sequence longer than the budget's
micro-batches runs with activation checkpointing (docs/engine.md, Memory).

    python benchmarks/long_context.py                              # smollm2-135m, 1K 2K 4K 8K
    python benchmarks/long_context.py --model tiny-llama --lengths 256,512
    python benchmarks/long_context.py --memory-budget 1500M
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402

from sess.engine import Datum, ModelInput  # noqa: E402

from common import add_device_options, as_engine_process, in_process_client, memory_status  # noqa: E402


def _datum(vocab: int, length: int, seed: int) -> Datum:
    tokens = np.random.default_rng(seed).integers(10, vocab - 10, length + 1)
    inputs = {"target_tokens": tokens[1:], "weights": np.ones(length, np.float32)}
    return Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs)


def one_length(args) -> dict:
    """Time one ``forward_backward`` of ``args.length`` tokens in this process."""
    svc = in_process_client(args.home, args.device, args.dtype, args.memory_budget)
    tc = svc.create_lora_training_client(args.model, rank=8, alpha=16, seed=0)
    vocab = len(tc.get_tokenizer())
    tc.forward_backward([_datum(vocab, 64, 0)], "cross_entropy").result()
    started = time.perf_counter()
    out = tc.forward_backward([_datum(vocab, args.length, 1)], "cross_entropy").result()
    seconds = time.perf_counter() - started
    assert np.isfinite(out.metrics["loss:sum"])
    return {"length": args.length, "seconds": seconds, "peak_rss": memory_status()["VmHWM"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="1024,2048,4096,8192", help="comma-separated token counts")
    parser.add_argument("--home", default=None, help="SESS_HOME (default: the usual)")
    parser.add_argument("--length", type=int, default=None, help=argparse.SUPPRESS)  # one length, as JSON
    add_device_options(parser)
    args = parser.parse_args()
    if args.length is not None:
        as_engine_process(args.device)
        print(json.dumps(one_length(args)))
        return
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        command = [sys.executable, __file__, *sys.argv[1:], "--length", str(length)]
        answer = subprocess.run(command, capture_output=True, text=True)
        if answer.returncode != 0:
            sys.exit(f"length {length}: {answer.stderr.strip().splitlines()[-1]}")
        rows.append(json.loads(answer.stdout.strip().splitlines()[-1]))
    print(f"{args.model}, memory budget {args.memory_budget or 'default'}")
    print(f"{'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'peak RSS':>10} {'MB per 1K more':>15}")
    for i, row in enumerate(rows):
        slope = ""
        if i:
            grown = (row["peak_rss"] - rows[i - 1]["peak_rss"]) / 2**20
            slope = f"{grown / ((row['length'] - rows[i - 1]['length']) / 1024):.0f}"
        rate = row["length"] / row["seconds"]
        print(
            f"{row['length']:>7} {row['seconds']:>8.2f} {rate:>9.0f} {row['peak_rss'] / 2**30:>8.2f}GB {slope:>15}"
        )


if __name__ == "__main__":
    main()
