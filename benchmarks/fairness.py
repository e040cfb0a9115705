"""Fair queues: how long a light tenant's trivial op waits while another key floods the engine.

Two API keys on one engine server (a real process over HTTP). The heavy key keeps ``--flood``
forward_backward calls of ``--batch`` x ``--length`` tokens queued at all times (a new one as each
finishes); the light key sends one trivial op at a time (a forward of one 8-token datum) and times
it from call to result. Printed per queue policy (``sess engine up --queue fair|arrival``): the
light op's p50/p95 latency without the flood and with it, and the heavy op's own time, so "waits at
most about one heavy op" can be read off the table. Target: with fair queues, the light op's p95
under the flood is at most about one heavy op plus its quiet latency; with arrival order it waits
for the whole queue.

The heavy op's time under the flood is not the time it takes alone when other work shares the
machine, so each light op is also matched with the engine's own record of the ops (its registry:
when each finished, how long it ran): how many heavy ops finished while it waited, and its latency
over the engine time of the heavy op that was running when it was sent. A second table splits the
fair queue's waits into that heavy op's remaining time, the light op's own engine time, and the
rest (HTTP, queueing, recording).

    python benchmarks/fairness.py                         # tiny-llama, 50 x (8 x 512)
    python benchmarks/fairness.py --flood 20 --samples 5  # quicker
    (in arrival order each light op waits for the whole queue: --arrival-samples of them, 3 by default)
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sess.engine import Datum, ModelInput, ServiceClient  # noqa: E402
from sess.engine.sdk.local_engine import start_engine, stop_engine  # noqa: E402
from sess.engine.server.keys import KeyStore  # noqa: E402


def batch(n: int, length: int, seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, 200, length + 1)
        out.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1].tolist()),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.ones(length, np.float32)},
            )
        )
    return out


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def behind(home: Path, op_id: str, called: float, latency: float) -> dict:
    """What a light op sent at ``called`` (wall clock) waited behind, from the engine's registry: the
    heavy ops that finished while it waited, the one running when it was sent, and its own time."""
    db = sqlite3.connect(f"file:{home / 'registry.db'}?mode=ro", uri=True)
    try:
        finished, own = db.execute(
            "SELECT finished, wall_time_s FROM operations WHERE id = ?", (op_id,)
        ).fetchone()
        heavy = db.execute(
            "SELECT finished, wall_time_s FROM operations WHERE name = 'forward_backward' "
            "AND finished > ? AND finished <= ? ORDER BY finished",
            (called, finished),
        ).fetchall()
    finally:
        db.close()
    running = heavy[0] if heavy else (called, float("nan"))  # the first to finish ran when it came
    remaining = running[0] - called
    return {
        "ops_behind": len(heavy),
        "ratio": latency / running[1],
        "remaining_s": remaining,
        "own_s": own,
        "rest_s": latency - own - (heavy[-1][0] - called if heavy else 0.0),
    }


def measure(policy: str, args) -> dict:
    home = Path(tempfile.mkdtemp(prefix=f"fairness-{policy}-"))
    keys = KeyStore(home)
    heavy_key, light_key = keys.add("heavy")["key"], keys.add("light")["key"]
    info = start_engine(home, extra_args=["--queue", policy])
    heavy_svc, light_svc = (
        ServiceClient(info["url"], api_key=heavy_key),
        ServiceClient(info["url"], api_key=light_key),
    )
    try:
        heavy = heavy_svc.create_lora_training_client(args.model, rank=8, seed=0)
        light = light_svc.create_lora_training_client(args.model, rank=8, seed=0)
        heavy_data, light_data = batch(args.batch, args.length, 0), batch(1, 8, 1)
        heavy.forward_backward(heavy_data).result()  # warm-up
        heavy_s = statistics.median(
            timed(lambda: heavy.forward_backward(heavy_data).result()) for _ in range(3)
        )
        quiet = [timed(lambda: light.forward(light_data).result()) for _ in range(args.samples)]

        stop, pending = threading.Event(), deque()

        def flood() -> None:
            try:
                while not stop.is_set():
                    while len(pending) < args.flood:
                        pending.append(heavy.forward_backward(heavy_data))
                    pending.popleft().result()
            except Exception:
                if not stop.is_set():  # after stop, the engine is closing under the queued flood
                    raise

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        time.sleep(2.0)  # the queue is full
        loaded, sent = [], []
        for _ in range(args.samples if policy == "fair" else args.arrival_samples):
            called = time.time()
            future = light.forward(light_data)
            future.result()
            loaded.append(time.time() - called)
            sent.append((future.operation_id, called, loaded[-1]))
            time.sleep(0.2)
        stop.set()  # the queued flood is dropped with the engine below, not waited for
        waits = [behind(home, op_id, called, latency) for op_id, called, latency in sent]
        return {"policy": policy, "heavy_s": heavy_s, "quiet": quiet, "loaded": loaded, "waits": waits}
    finally:
        heavy_svc.close()
        light_svc.close()
        stop_engine(home)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--flood", type=int, default=50, help="heavy ops kept queued")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--samples", type=int, default=10, help="light ops timed per phase")
    parser.add_argument(
        "--arrival-samples",
        type=int,
        default=3,
        help="light ops timed under the flood in arrival order (slow)",
    )
    args = parser.parse_args()
    results = [measure(policy, args) for policy in ("fair", "arrival")]
    table = Table(
        "queue",
        "heavy op s",
        "light p50 quiet",
        "light p95 quiet",
        "light p50 flood",
        "light p95 flood",
        "p95 flood / heavy op",
        "heavy ops behind, max",
        "p95 of wait / heavy op running",
        title=f"light tenant's latency (s) while another key keeps {args.flood} x forward_backward "
        f"of {args.batch} x {args.length} tokens queued ({args.model})",
    )
    for r in results:
        table.add_row(
            r["policy"],
            f"{r['heavy_s']:.3f}",
            f"{percentile(r['quiet'], 50):.3f}",
            f"{percentile(r['quiet'], 95):.3f}",
            f"{percentile(r['loaded'], 50):.3f}",
            f"{percentile(r['loaded'], 95):.3f}",
            f"{percentile(r['loaded'], 95) / r['heavy_s']:.2f}",
            str(max(w["ops_behind"] for w in r["waits"])),
            f"{percentile([w['ratio'] for w in r['waits']], 95):.2f}",
        )
    console = Console(width=170)
    console.print(table)
    fair = results[0]["waits"]
    parts = Table(
        "part of the wait (s)",
        "p50",
        "max",
        title="where the light op's wait under the flood goes (fair queues)",
    )
    for key, label in (
        ("remaining_s", "the heavy op running when it was sent, until it finished"),
        ("own_s", "the light op's own engine time"),
        ("rest_s", "the rest: HTTP, queueing, recording"),
    ):
        values = [w[key] for w in fair]
        parts.add_row(label, f"{percentile(values, 50):.3f}", f"{max(values):.3f}")
    console.print(parts)


if __name__ == "__main__":
    main()
