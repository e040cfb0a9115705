"""Sampling on every rank: 2 ranks x 1 thread against 1 rank x 2 threads, on one workload.

Starts two real engines on a temporary home, one after the other: ``--nproc 2`` (the agent gives
each rank one OpenMP thread) and one rank with two threads. Each creates a LoRA session and sends
P sample requests at once (K samples x T new tokens each, temperature 1, seeded) to its live
weights, a warm-up round first; it prints new tokens/s (best of the rounds), their ratio, whether
the two engines sampled the same tokens, and each rank's KV cache peak as the engine reports it
(``/healthz`` ``sampling_ranks``) against what one rank's cache held for all the rows (the same
bytes per row, measured on the two-rank engine, times every row). Then it sends ``compute_logprobs``
of every sampled sequence (prompt + completion) at once, a warm-up round first, and prints the
tokens scored per second (best of the rounds), their ratio, each rank's share of the requests and
how far the two engines' logprobs are apart.

    python benchmarks/ranks_sampling.py                       # smollm2-135m, 8 x 4 x 32
    python benchmarks/ranks_sampling.py --model tiny-llama    # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import urllib.request

from rich.console import Console
from rich.table import Table

from sess.engine import SamplingParams, ServiceClient
from sess.engine.sdk.local_engine import start_engine, stop_engine

TEXTS = [
    "Write a story about the sea.",
    "Describe a robot that learns to paint.",
    "What happens in winter in a small town?",
    "A city at night, seen from a tower.",
    "An old library with a secret room.",
    "Climbing mountains in the rain.",
    "A cat that owns a bookshop.",
    "The moon, from the moon's side.",
]


def run(home: str, nproc: int, threads: int, args) -> dict:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    engine = start_engine(home, extra_args=["--nproc", str(nproc)], timeout=600)
    try:
        svc = ServiceClient(engine["url"], home=home)
        tc = svc.create_lora_training_client(args.model, rank=8, seed=1)
        tok = tc.get_tokenizer()
        prompts = [tok.encode(TEXTS[i % len(TEXTS)]) for i in range(args.prompts)]
        live = tc.create_sampling_client()
        rates, tokens = [], None
        for round_ in range(args.rounds + 1):
            started = time.perf_counter()
            futures = [
                live.sample(
                    p,
                    num_samples=args.samples,
                    sampling_params=SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=100 + i),
                )
                for i, p in enumerate(prompts)
            ]
            results = [f.result() for f in futures]
            seconds = time.perf_counter() - started
            new = sum(len(s.tokens) for r in results for s in r.sequences)
            if round_:  # the first round warms up (calibration, prepacking)
                rates.append(new / seconds)
            tokens = [[s.tokens for s in r.sequences] for r in results]
        scored, scoring = _score(live, prompts, tokens, args.rounds)
        with urllib.request.urlopen(f"{engine['url']}/healthz", timeout=10) as response:
            health = json.loads(response.read())
        svc.close()
        return {
            "rate": max(rates),
            "tokens": tokens,
            "ranks": health.get("sampling_ranks"),
            "score_rate": scoring,
            "scored": scored,
        }
    finally:
        stop_engine(home)


def _score(live, prompts, tokens, rounds: int) -> tuple[list, float]:
    """``compute_logprobs`` of every sampled sequence (prompt + completion), all sent at once: the
    logprobs, and the prompt tokens scored per second (best of ``rounds`` after a warm-up)."""
    sequences = [p + t for p, row in zip(prompts, tokens) for t in row]
    rates, scored = [], []
    for round_ in range(rounds + 1):
        started = time.perf_counter()
        scored = [f.result() for f in [live.compute_logprobs(s) for s in sequences]]
        if round_:
            rates.append(sum(map(len, sequences)) / (time.perf_counter() - started))
    return scored, max(rates)


def _diff(a: list, b: list) -> float:
    return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p[1:], q[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="sess-ranks-bench-")
    try:
        two = run(home, 2, 1, args)
        one = run(home, 1, 2, args)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    table = Table(
        title=f"{args.model}: {args.prompts} requests x {args.samples} samples x {args.tokens} tokens"
    )
    for column in ("engine", "new tokens/s", "ratio", "KV cache peak per rank", "scored tokens/s", "ratio"):
        table.add_column(column)
    spread = two["ranks"]
    rows = sum(spread["rows_decoded"]) // (args.rounds + 1)
    # a round's rows decode together, so a rank's peak held its rows of one round
    rounds = args.rounds + 1
    per_row = max(p * rounds / r for p, r in zip(spread["peak_kv_cache_bytes"], spread["rows_decoded"]) if r)
    peaks = ", ".join(f"{p / 1e6:.2f} MB" for p in spread["peak_kv_cache_bytes"])
    table.add_row(
        "1 rank x 2 threads",
        f"{one['rate']:.1f}",
        "1.00",
        f"{rows * per_row / 1e6:.2f} MB (all {rows} rows)",
        f"{one['score_rate']:.1f}",
        "1.00",
    )
    table.add_row(
        "2 ranks x 1 thread",
        f"{two['rate']:.1f}",
        f"{two['rate'] / one['rate']:.2f}",
        peaks,
        f"{two['score_rate']:.1f}",
        f"{two['score_rate'] / one['score_rate']:.2f}",
    )
    Console().print(table)
    print(
        f"rows decoded per rank (all rounds): {spread['rows_decoded']}; same tokens: {one['tokens'] == two['tokens']}"
    )
    print(
        f"compute_logprobs requests per rank (all rounds): {spread['logprob_requests']}; "
        f"max |logprob difference| from one rank: {_diff(one['scored'], two['scored']):.1e}"
    )


if __name__ == "__main__":
    main()
