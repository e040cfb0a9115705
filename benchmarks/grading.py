"""How many solutions per second sess's sandboxed grader (`sess.sandbox.Grader`) grades, by pool size.

Each round grades the same mix through `grade_many`: half passing solutions, a third failing ones
(a wrong answer, an exception), and the rest timeouts, half busy loops (killed by the CPU limit,
1 s) and half sleepers (killed by the wall limit, 2 s); then the same mix without its timeouts, which
is the sandbox's own rate. Every verdict is checked against what the job should get. Before that, the latency of one passing job alone, in the sandbox and, as the baseline,
the same harness script in a bare `python -I` (no isolation), the cost the sandbox adds to a run.

    python benchmarks/grading.py                    # pools 1, 2, 4, 8; 48 jobs a round
    python benchmarks/grading.py --pools 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

from sess.sandbox import GradeJob, Grader, Limits
from sess.sandbox.process import run_bounded
from sess.sandbox.protocol import REPORT_BYTES, build_script, read_verdict

LIMITS = Limits(cpu_s=1, wall_s=2, memory_mb=256)
ADD = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add('a', 'b') == 'ab'\n"


def job_mix(n: int) -> list[tuple[GradeJob, str]]:
    """`n` jobs (a multiple of 12) with the reason kind each should get, interleaved."""
    kinds = [
        (GradeJob(ADD, TESTS), "passed"),
        (GradeJob("def add(a, b):\n    return sorted([a, b])[0] + 1\n", TESTS), "tests failed"),
        (GradeJob("import json\n" + ADD, TESTS + "assert add(*json.loads('[2, 2]')) == 4\n"), "passed"),
        (GradeJob("def add(a, b):\n    raise ValueError('no')\n", TESTS), "tests failed"),
        (GradeJob("while True:\n    pass\n", TESTS), "timeout"),
        (GradeJob("import re\n" + ADD, TESTS + "assert re.fullmatch('a+', 'aaa')\n"), "passed"),
        (GradeJob(ADD.replace("a + b", "a - b"), TESTS), "tests failed"),
        (GradeJob("import collections\n" + ADD, TESTS), "passed"),
        (GradeJob("import time\ntime.sleep(60)\n", TESTS), "timeout"),
        (GradeJob(ADD, TESTS + "assert add([1], [2]) == [1, 2]\n"), "passed"),
        (GradeJob("def add(a, b):\n    return a + b + 0\n", TESTS), "tests failed"),
        (GradeJob("import itertools\n" + ADD, TESTS), "passed"),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def single_latency(grader: Grader, repeats: int) -> tuple[float, float]:
    """Median seconds for one passing job: in the sandbox, and as a bare `python -I` (no isolation)."""
    job = GradeJob(ADD, TESTS)
    sandboxed, bare = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        assert grader.grade(job).passed
        sandboxed.append(time.perf_counter() - started)
        script, nonce = build_script(job)
        started = time.perf_counter()
        outcome = run_bounded(
            [grader.sandbox.python, "-I", "-B", "-c", script], nonce, LIMITS.wall_s, 1 << 20
        )
        assert read_verdict(outcome, nonce, replace(LIMITS, output_bytes=REPORT_BYTES)).passed
        bare.append(time.perf_counter() - started)
    return statistics.median(sandboxed), statistics.median(bare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="1,2,4,8", help="pool sizes (max_workers) to measure")
    parser.add_argument("--jobs", type=int, default=48, help="jobs a round (rounded up to a multiple of 12)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per pool size; the best is reported")
    args = parser.parse_args()
    mix = job_mix(-(-args.jobs // 12) * 12)
    counts = {kind: sum(1 for _, k in mix if k == kind) for kind in ("passed", "tests failed", "timeout")}
    print(f"python {sys.version.split()[0]}, limits {LIMITS}")
    print(f"mix of {len(mix)} jobs: {counts}")

    with Grader(max_workers=1, limits=LIMITS) as grader:
        sandboxed, bare = single_latency(grader, repeats=20)
    print(
        f"one passing job alone (median of 20): sandboxed {sandboxed * 1000:.1f} ms, "
        f"bare python -I {bare * 1000:.1f} ms, sandbox adds {(sandboxed - bare) * 1000:.1f} ms"
    )

    quick = [(job, want) for job, want in mix if want != "timeout"]
    print(f"{'pool':>5} {'mix s':>7} {'jobs/s':>7} {'no-timeout s':>13} {'jobs/s':>7}")
    for pool in [int(p) for p in args.pools.split(",")]:
        with Grader(max_workers=pool, limits=LIMITS) as grader:
            mixed, fast = best_time(grader, mix, args.rounds), best_time(grader, quick, args.rounds)
        print(f"{pool:>5} {mixed:>7.2f} {len(mix) / mixed:>7.2f} {fast:>13.2f} {len(quick) / fast:>7.2f}")


def best_time(grader: Grader, jobs: list[tuple[GradeJob, str]], rounds: int) -> float:
    """The fastest of `rounds` runs of `grade_many`, after checking every verdict."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        results = grader.grade_many(job for job, _ in jobs)
        best = min(best, time.perf_counter() - started)
        wrong = [(r.reason, want) for r, (_, want) in zip(results, jobs) if r.kind != want]
        assert not wrong, wrong[:3]
    return best


if __name__ == "__main__":
    main()
