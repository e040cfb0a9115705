"""Many sessions on one base model: engine memory (RSS) and aggregate sampling throughput.

For 1, 2, 4 and 8 live sessions on one base model (each with its own LoRA adapter and AdamW state
after one training step), prints the process RSS, what each extra session added against its
adapter + optimizer size (weights, grads, two moments: 4 fp32 copies of the LoRA parameters), and
the aggregate new tokens/s when every session samples at once (one request each) against one
session sampling alone. Targets: each extra session adds <= 1.5x its adapter + optimizer size;
4 sessions sample >= 2x the tokens/s of one.

    python benchmarks/sessions.py                     # smollm2-135m
    python benchmarks/sessions.py --model tiny-llama
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sess.engine import AdamParams, SamplingParams, ServiceClient  # noqa: E402

from common import as_engine_process  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--home", default=None)
    args = parser.parse_args()
    as_engine_process()
    svc = ServiceClient("inproc", home=args.home)
    runtime = svc.transport.engine.runtime
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=0)

    sessions, samplers = [], []
    table = Table(title=f"sessions on one {args.model} (LoRA rank {args.rank})")
    for col in (
        "sessions",
        "RSS MB",
        "added per session MB",
        "adapter+optimizer MB",
        "ratio",
        "tokens/s",
        "vs 1 session",
    ):
        table.add_column(col)
    single_tps, last_rss, last_count = None, None, 0
    for count in (1, 2, 4, 8):
        while len(sessions) < count:
            tc = svc.create_lora_training_client(args.model, rank=args.rank, seed=len(sessions))
            tok = tc.get_tokenizer()
            prompt = tok.encode(f"Session {len(sessions)} writes a story about the sea.")
            tc.forward_backward([prompt]).result()
            tc.optim_step(AdamParams(learning_rate=1e-4)).result()
            sessions.append(tc)
            samplers.append((tc.create_sampling_client(), prompt))
        for _ in range(2):  # the first round warms up kernels for the new batch shapes
            start = time.perf_counter()
            futures = [sc.sample(p, num_samples=args.samples, sampling_params=params) for sc, p in samplers]
            tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
            tps = tokens / (time.perf_counter() - start)
        # after sampling, so the base model's one-off sampler state (prepacked weights) is in the
        # one-session figure and not charged to the second session
        gc.collect()
        rss = rss_mb()
        n_params = sum(p.numel() for p in runtime.sessions[sessions[0].name].params.values())
        state_mb = n_params * 4 * 4 / 2**20  # weights + grads + exp_avg + exp_avg_sq, fp32
        added = (rss - last_rss) / (count - last_count) if last_rss is not None else float("nan")
        single_tps = single_tps or tps
        table.add_row(
            str(count),
            f"{rss:.0f}",
            "-" if last_rss is None else f"{added:.1f}",
            f"{state_mb:.1f}",
            "-" if last_rss is None else f"{added / state_mb:.2f}x",
            f"{tps:.1f}",
            f"{tps / single_tps:.2f}x",
        )
        last_rss, last_count = rss, count
    Console().print(table)
    for tc in sessions:
        tc.stop()
    svc.close()


if __name__ == "__main__":
    main()
