"""What the HTTP engine costs over the same runtime in-process.

Measures, in one process run and on one engine home:
  1. round-trip time of a trivial op (an ordered ``noop``: submit + long-poll) over HTTP and in-process,
     p50 and p99 over ``--trivial`` calls;
  2. wall time of ``forward_backward + optim_step`` on the same batch (``--batch`` rows of ``--seq``
     random tokens, cross_entropy) through an engine server process vs the in-process runtime,
     alternating the two so drift hits both, and the ratio of their medians.

    python benchmarks/overhead.py                       # smollm2-135m, 8x128 (the target: ratio <= 1.05)
    python benchmarks/overhead.py --model tiny-llama    # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common import as_engine_process


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def trivial_rtts(tc, n: int) -> list[float]:
    rtts = []
    for _ in range(n):
        started = time.perf_counter()
        tc.noop().result()
        rtts.append(time.perf_counter() - started)
    return rtts


def train_step(tc, data) -> float:
    from sess.engine import AdamParams

    started = time.perf_counter()
    fb = tc.forward_backward(data)
    opt = tc.optim_step(AdamParams(learning_rate=1e-5))
    fb.result(), opt.result()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed fb+optim steps per transport")
    parser.add_argument("--trivial", type=int, default=300, help="trivial ops per transport")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--home", default=None, help="engine home (default: a temp dir; models cache there)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = parser.parse_args()
    as_engine_process()

    from sess.engine import Datum, ModelInput, ServiceClient
    from sess.engine.runtime.inprocess import shared_engine
    from sess.engine.sdk.local_engine import start_engine, stop_engine

    home = args.home
    if home is None:  # a fresh home (no sessions, no registry) that shares the usual model cache
        home = Path(tempfile.mkdtemp(prefix="sess-bench-"))
        models = Path(os.environ.get("SESS_HOME") or Path.home() / ".sess") / "models"
        if models.is_dir():
            (home / "models").symlink_to(models)
    shared_engine(home, device=args.device)  # the in-process engine, on the same device
    info = start_engine(home, device=args.device)
    clients = {"http": ServiceClient(info["url"], home=home), "inproc": ServiceClient("inproc", home=home)}
    try:
        sessions = {
            k: c.create_lora_training_client(args.model, rank=32, alpha=64, seed=0)
            for k, c in clients.items()
        }
        vocab = len(sessions["inproc"].get_tokenizer())
        rng = np.random.default_rng(0)
        data = []
        for _ in range(args.batch):
            tokens = rng.integers(0, vocab, args.seq + 1)
            data.append(
                Datum(
                    ModelInput.from_ints(tokens[:-1].tolist()),
                    {"target_tokens": tokens[1:], "weights": np.ones(args.seq, np.float32)},
                )
            )
        for tc in sessions.values():  # warm-up: allocator, kernels, connections
            trivial_rtts(tc, 20)
            train_step(tc, data)
        rtts = {k: trivial_rtts(tc, args.trivial) for k, tc in sessions.items()}
        steps: dict[str, list[float]] = {"http": [], "inproc": []}
        for _ in range(args.steps):
            for kind, tc in sessions.items():
                steps[kind].append(train_step(tc, data))
        figures = {
            "model": args.model,
            "batch": f"{args.batch}x{args.seq}",
            "device": args.device,
            **{
                f"trivial_{k}_ms": {"p50": percentile(v, 50) * 1e3, "p99": percentile(v, 99) * 1e3}
                for k, v in rtts.items()
            },
            **{f"step_{k}_s": statistics.median(v) for k, v in steps.items()},
            "step_ratio_http_over_inproc": statistics.median(steps["http"])
            / statistics.median(steps["inproc"]),
        }
        for tc in sessions.values():
            tc.stop()
    finally:
        for client in clients.values():
            client.close()
        stop_engine(home)
    if args.json:
        print(json.dumps(figures))
        return
    print(f"model {figures['model']}, batch {figures['batch']}, device {figures['device']}")
    for kind in ("http", "inproc"):
        t = figures[f"trivial_{kind}_ms"]
        print(f"trivial op {kind:>6}: p50 {t['p50']:.2f} ms  p99 {t['p99']:.2f} ms")
    print(f"fb+optim step: http {figures['step_http_s']:.3f} s  inproc {figures['step_inproc_s']:.3f} s")
    print(f"ratio http/inproc: {figures['step_ratio_http_over_inproc']:.3f}")


if __name__ == "__main__":
    main()
