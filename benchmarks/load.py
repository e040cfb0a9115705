"""Many tenants on one engine: throughput, per-key latency, exact billing and budgets under load.

A priced engine server (a real process over HTTP) with ``--keys`` API keys of ``--sessions`` sessions
each on tiny-llama. Every session's client runs a mixed loop for ``--seconds``: forward_backward,
optim_step, sample, compute_logprobs, and a save_state every tenth round. A third of the way in, the
last key's budget is set to what it has spent (its clients are refused with 402 and keep trying);
two thirds in it is raised again, and its sessions must go on. Checked and printed: every accepted op
resolved, no 5xx, each key's tokens and cost on the engine equal the sum of what its clients did,
the engine's RSS in the last third against the middle one, and the over-budget key's sessions
running again after the raise; then throughput and per-key latency percentiles.

    python benchmarks/load.py                 # 4 keys x 4 sessions, 180 s
    python benchmarks/load.py --seconds 60
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from sess.engine import Datum, ModelInput, SamplingParams, ServiceClient  # noqa: E402
from sess.engine.protocol.errors import SessError  # noqa: E402
from sess.engine.protocol.prices import PriceTable, format_cost, load_prices  # noqa: E402
from sess.engine.sdk.local_engine import start_engine, stop_engine  # noqa: E402
from sess.engine.server.keys import KeyStore  # noqa: E402

PRICES = "currency: USD\nmodels:\n  default: {prefill: 0.5, sampled: 2.0, trained: 1.5}\n"
MODEL = "tiny-llama"


class Tenant:
    """One session's client loop and what it saw: per-op latencies and its own count of tokens."""

    def __init__(self, key: dict, index: int, url: str, prices: PriceTable, stop: threading.Event):
        self.key, self.index, self.url, self.prices, self.stop = key, index, url, prices, stop
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.pico = 0
        self.tokens = {"prefill_tokens": 0, "sampled_tokens": 0, "training_tokens": 0}
        self.refused = self.server_errors = 0
        self.other_errors: list[str] = []
        self.ok_after: list[float] = []  # when ops succeeded (monotonic), to see a session go on

    def _count(self, op: str, usage: dict) -> None:
        for k, v in usage.items():
            self.tokens[k] += v
        self.pico += self.prices.cost(MODEL, op, usage)

    def _timed(self, op: str, fn):
        started = time.monotonic()
        try:
            result = fn()
        except SessError as exc:
            if exc.status == 402:
                self.refused += 1
            elif (exc.status or 500) >= 500:
                self.server_errors += 1
            else:
                self.other_errors.append(f"{op}: {exc}")
            return None
        self.latency[op].append(time.monotonic() - started)
        self.ok_after.append(time.monotonic())
        return result

    def run(self) -> None:
        rng = np.random.default_rng(self.index)
        svc = ServiceClient(self.url, api_key=self.key["key"])
        try:
            tc = svc.create_lora_training_client(MODEL, rank=4, seed=self.index)
            sc = tc.create_sampling_client()
            rounds = 0
            while not self.stop.is_set():
                tokens = rng.integers(3, 200, 33).tolist()
                datum = Datum(
                    model_input=ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.array(tokens[1:]),
                        "weights": np.ones(32, np.float32),
                    },
                )
                if (
                    self._timed("forward_backward", lambda d=datum: tc.forward_backward([d]).result())
                    is not None
                ):
                    self._count("forward_backward", {"training_tokens": 32})
                self._timed("optim_step", lambda: tc.optim_step().result())
                prompt = tokens[:6]
                params = SamplingParams(max_tokens=8, seed=rounds)
                out = self._timed(
                    "sample",
                    lambda p=prompt, sp=params: sc.sample(p, num_samples=2, sampling_params=sp).result(),
                )
                if out is not None:
                    sampled = sum(len(s.tokens) for s in out.sequences)
                    self._count("sample", {"prefill_tokens": len(prompt), "sampled_tokens": sampled})
                if (
                    self._timed("compute_logprobs", lambda t=tokens: sc.compute_logprobs(t[:12]).result())
                    is not None
                ):
                    self._count("compute_logprobs", {"prefill_tokens": 12})
                if rounds % 10 == 9:
                    self._timed("save_state", lambda: tc.save_state().result())
                if self.refused:
                    time.sleep(0.2)  # over budget: keep asking, slowly
                rounds += 1
            tc.stop()
        finally:
            svc.close()


def percentile(values, q) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run(seconds: float, keys: int = 4, sessions: int = 4, home: Path | None = None) -> dict:
    """Run the load; a report of what was checked and measured."""
    home = Path(home or tempfile.mkdtemp(prefix="sess-load-"))
    prices_file = home.parent / f"{home.name}-prices.yaml"
    prices_file.write_text(PRICES)
    prices = load_prices(prices_file)
    store = KeyStore(home)
    entries = [store.add(f"tenant{k}", max_sessions=sessions) for k in range(keys)]
    info = start_engine(home, extra_args=["--prices", str(prices_file)])
    stop = threading.Event()
    tenants = [
        Tenant(entries[k], k * sessions + s, info["url"], prices, stop)
        for k in range(keys)
        for s in range(sessions)
    ]
    threads = [threading.Thread(target=t.run, daemon=True) for t in tenants]
    rss: list[tuple[float, int]] = []
    started = time.monotonic()
    try:
        for thread in threads:
            thread.start()
        limited, raised_at = entries[-1], None
        while time.monotonic() - started < seconds:
            elapsed = time.monotonic() - started
            health = httpx.get(f"{info['url']}/healthz", timeout=30).json()
            rss.append((elapsed, health["rss_bytes"]))
            if elapsed > seconds / 3 and not limited.get("limited"):
                spent = _spend(info["url"], limited["key"])
                store.set_budget(limited["id"], spent)  # over budget from its next costly op
                limited["limited"] = True
            if elapsed > 2 * seconds / 3 and raised_at is None:
                store.set_budget(limited["id"], "1000")
                raised_at = time.monotonic()
            time.sleep(2.0)
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
        wall = time.monotonic() - started
        report = _report(info["url"], entries, tenants, prices, rss, wall, raised_at, sessions)
    finally:
        stop.set()
        stop_engine(home)
    return report


def _spend(url: str, key: str) -> str:
    answer = httpx.get(f"{url}/api/usage", headers={"authorization": f"Bearer {key}"}, timeout=60).json()
    return answer["usage"]["cost"]


def _report(url, entries, tenants, prices, rss, wall, raised_at, sessions) -> dict:
    per_key = []
    for k, entry in enumerate(entries):
        mine = tenants[k * sessions : (k + 1) * sessions]
        answer = httpx.get(
            f"{url}/api/usage", headers={"authorization": f"Bearer {entry['key']}"}, timeout=60
        ).json()
        engine_tokens = {f: sum(r[f] for r in answer["operations"].values()) for f in mine[0].tokens}
        client_tokens = {f: sum(t.tokens[f] for t in mine) for f in mine[0].tokens}
        latencies = [x for t in mine for values in t.latency.values() for x in values]
        per_key.append(
            {
                "key": entry["owner"],
                "ops": len(latencies),
                "p50": percentile(latencies, 50),
                "p95": percentile(latencies, 95),
                "engine_tokens": engine_tokens,
                "client_tokens": client_tokens,
                "engine_cost": Decimal(answer["usage"]["cost"]),
                "client_cost": Decimal(format_cost(sum(t.pico for t in mine))),
                "refused": sum(t.refused for t in mine),
                "server_errors": sum(t.server_errors for t in mine),
                "other_errors": [e for t in mine for e in t.other_errors],
                "resumed": all(any(when > raised_at for when in t.ok_after) for t in mine)
                if raised_at
                else None,
            }
        )
    third = [b for when, b in rss if when > 2 * wall / 3]
    middle = [b for when, b in rss if wall / 3 < when <= 2 * wall / 3]
    ops = sum(k["ops"] for k in per_key)
    by_op: dict[str, list[float]] = defaultdict(list)
    for t in tenants:
        for op, values in t.latency.items():
            by_op[op] += values
    tokens = sum(sum(k["engine_tokens"].values()) for k in per_key)
    return {
        "seconds": wall,
        "ops_per_s": ops / wall,
        "tokens_per_s": tokens / wall,
        "rss_middle_mb": max(middle) / 2**20 if middle else float("nan"),
        "rss_last_mb": max(third) / 2**20 if third else float("nan"),
        "keys": per_key,
        "ops": {op: (len(v), percentile(v, 50), percentile(v, 95)) for op, v in sorted(by_op.items())},
        "currency": prices.currency,
    }


def print_report(report: dict, keys: int, sessions: int) -> None:
    print(
        f"{keys} keys x {sessions} sessions, {report['seconds']:.0f} s: {report['ops_per_s']:.1f} ops/s, "
        f"{report['tokens_per_s']:.0f} tokens/s; engine RSS max {report['rss_middle_mb']:.0f} MB (middle third) "
        f"-> {report['rss_last_mb']:.0f} MB (last third)"
    )
    per_op = ", ".join(f"{op} {n} {a:.3f} {b:.3f}" for op, (n, a, b) in report["ops"].items())
    print(f"per op (count, p50 s, p95 s): {per_op}")
    print(
        "key       ops   p50 s   p95 s   402s  5xx  tokens engine/client      cost engine/client    resumed"
    )
    for k in report["keys"]:
        engine, client = sum(k["engine_tokens"].values()), sum(k["client_tokens"].values())
        print(
            f"{k['key']:<9} {k['ops']:>4} {k['p50']:>7.3f} {k['p95']:>7.3f} {k['refused']:>6} {k['server_errors']:>4}"
            f"  {engine:>8}/{client:<8}  {k['engine_cost']}/{k['client_cost']} {report['currency']}"
            f"  {'' if k['resumed'] is None else k['resumed']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=4, help="per key")
    args = parser.parse_args()
    report = run(args.seconds, args.keys, args.sessions)
    print_report(report, args.keys, args.sessions)


if __name__ == "__main__":
    main()
