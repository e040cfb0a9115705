"""How long the CLI's read commands take against a running engine, next to ``sess --help``.

The SDK and the CLI's read commands import no torch, transformers or peft, so a read costs the
interpreter, the CLI's own imports and one HTTP round trip. Starts an engine on a temporary home
with one tiny-llama session, then runs each command ``--repeats`` times in a fresh process and
prints the median wall time and its ratio to ``sess --help`` (the target: ``sess list`` at most 3x).

    python benchmarks/cli.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = {
    "sess --help": ["--help"],
    "sess list": ["list"],
    "sess usage": ["usage"],
    "sess checkpoints NAME": ["checkpoints", "{session}"],
    "sess engine status": ["engine", "status"],
    "sess runs": ["runs", "--dir", "{runs}"],
}


def timed(argv: list[str], env: dict) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    sess = str(Path(sys.executable).with_name("sess"))
    with tempfile.TemporaryDirectory(prefix="sess-cli-bench-") as tmp:
        env = {**os.environ, "SESS_HOME": str(Path(tmp) / "home"), "HF_HUB_OFFLINE": "1"}
        subprocess.run([sess, "engine", "up", "--detach"], env=env, check=True, capture_output=True)
        try:
            out = subprocess.run(
                [sess, "start", "model=tiny-llama", "--name", "bench"],
                env=env,
                check=True,
                capture_output=True,
            )
            assert b"bench" in out.stdout, out
            medians = {}
            for label, argv in COMMANDS.items():
                argv = [a.format(session="bench", runs=tmp) for a in argv]
                timed([sess, *argv], env)  # warm the file cache
                medians[label] = statistics.median(timed([sess, *argv], env) for _ in range(args.repeats))
        finally:
            subprocess.run([sess, "engine", "down"], env=env, capture_output=True)
    base = medians["sess --help"]
    print(f"{'command':<24}{'median s':>10}{'vs --help':>11}")
    for label, seconds in medians.items():
        print(f"{label:<24}{seconds:>10.3f}{seconds / base:>10.2f}x")


if __name__ == "__main__":
    main()
